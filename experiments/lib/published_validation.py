"""validate_simulator.py --published: the accelerator presets against published GPU
measurements. Rows marked `fit` set the presets' efficiencies (--fit refits and prints
them); the `validate` rows are the check: median and worst |ratio - 1|."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from experiments.lib import common


def refit(sources: dict, rows) -> None:
    """Fit each accelerator's efficiencies, with the engine parameters each source names in
    its "fit" list, on the accelerator's `fit` rows; print them for hardware.py and the
    measurements file."""
    from cbjax.experimental import ACCELERATORS, FIT_PARAMETERS, fit_published as fit

    for name in sorted({m.accelerator for m in rows if m.role == "fit"}):
        mine = [m for m in rows if m.role == "fit" and m.accelerator == name]
        keys = {s: sources[s].get("fit", []) for s in {m.source for m in mine} if sources[s].get("fit")}
        # refine from the frozen values (Nelder-Mead from the priors needs several restarts to get there)
        start = {n: getattr(ACCELERATORS[name].efficiency, n) for n in FIT_PARAMETERS}
        start.update({s: sources[s].get("efficiency", {}).get(name, {}) for s in keys})
        shared, engines, loss = fit(mine, ACCELERATORS[name], keys, start=start)
        print(f"{name}: fitted on {len(mine)} rows (loss {loss:.4f}): "
              + ", ".join(f"{k}={v:.3g}" for k, v in shared.items()))
        for source, values in engines.items():
            print(f"  source {source} on {name}: " + ", ".join(f"{k}={v:.3g}" for k, v in values.items()))


def memory_used(m) -> float:
    """Weights and the peak KV cache of measurement `m` over its devices' memory."""
    from cbjax.experimental import ACCELERATORS, DTYPE_BYTES, MODEL_SHAPES, kv_bytes_per_token, weight_bytes

    config, device = MODEL_SHAPES[m.model], ACCELERATORS[m.accelerator]
    sequences = m.batch if m.mode == "static" else m.concurrency
    kv = sequences * (m.input + m.output) * kv_bytes_per_token(config, DTYPE_BYTES[m.kv_dtype or m.weight_dtype])
    return (weight_bytes(config, DTYPE_BYTES[m.weight_dtype]) + kv) / (m.tp * device.memory_bytes)


def run(path: str, refit_first: bool, output_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tqdm.auto import tqdm

    from cbjax.experimental import ACCELERATORS, load_published as load, simulate_published as simulate, write_json

    start = time.perf_counter()
    sources, rows = load(path)
    if refit_first:
        refit(sources, rows)
    results = []
    for m in tqdm(rows, desc="simulating published setups", unit="row"):
        simulated = simulate(m)
        results.append({**dataclasses.asdict(m), "setup": m.setup, "simulated": simulated,
                        "ratio": simulated / m.published, "memory_used": memory_used(m)})
    lines = [f"{'source':<16}{'role':<9}{'setup':<58}{'metric':<19}{'published':>10}{'simulated':>10}{'ratio':>7}"
             f"{'memory':>8}", "-" * 137]
    lines += [f"{r['source']:<16}{r['role']:<9}{r['setup']:<58}{r['metric']:<19}{r['published']:>10.1f}"
              f"{r['simulated']:>10.1f}{r['ratio']:>7.3f}{100 * r['memory_used']:>7.0f}%" for r in results]
    lines.append("memory: weights + the KV cache the run holds at its peak, as a share of the devices' memory "
                 "(the presets leave 10% for activations: above 90% the preset would not fit it)")
    summary = {}
    for role in ("fit", "validate"):
        errors = np.array([abs(r["ratio"] - 1) for r in results if r["role"] == role])
        if errors.size:
            summary[role] = {"rows": int(errors.size), "median_abs_error": float(np.median(errors)),
                             "max_abs_error": float(errors.max()), "within_15pct": int((errors <= 0.15).sum())}
            lines.append(f"{role} rows: {errors.size}, median |ratio - 1| {100 * np.median(errors):.1f}%, "
                         f"worst {100 * errors.max():.1f}%, {int((errors <= 0.15).sum())} within 15%")
    table = "\n".join(lines)
    print("\n" + table)

    fig, ax = plt.subplots(figsize=(6, 5.5))
    for role, marker in (("fit", "s"), ("validate", "o")):
        mine = [r for r in results if r["role"] == role]
        ax.scatter([r["published"] for r in mine], [r["simulated"] for r in mine], marker=marker, label=role)
    values = [v for r in results for v in (r["published"], r["simulated"])]
    span = np.array([min(values) / 1.3, max(values) * 1.3])
    ax.plot(span, span, color="grey", lw=0.8)
    ax.fill_between(span, span * 0.95, span * 1.05, color="grey", alpha=0.15, label="within 5%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("published (tokens/s or ms)")
    ax.set_ylabel("simulated")
    ax.set_title("simulator vs published GPU measurements")
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(output_dir, exist_ok=True)
    common.savefig(fig, os.path.join(output_dir, "simulated_vs_published.png"))
    write_json(os.path.join(output_dir, "validate_published.json"),
               {"file": path, "sources": sources, "presets": {k: dataclasses.asdict(v) for k, v in ACCELERATORS.items()},
                "rows": results, "summary": summary, "table": table, "wall_s": time.perf_counter() - start})
    print(f"\nwrote {output_dir}/validate_published.json and simulated_vs_published.png "
          f"in {time.perf_counter() - start:.0f}s")
