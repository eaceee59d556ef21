"""Goodput of colocated against disaggregated serving on the same devices (source note 002;
DistServe's metric): the highest arrival rate at which at least `--attainment` of the
requests meet both a TTFT and a TPOT SLO.

Per device count N: colocated N replicas (each prefills and decodes; prefill_first or
chunked prefill), against disaggregated p prefill + (N - p) decode instances for every
split p; each over Poisson rates, under each SLO pair. Simulated at GPU scale by default
(Llama-3-8B shape on H100, the KV move charged over NVLink); `--simulate=` (empty) runs
the same comparison for real on host CPU devices with a tiny model.

    python -m experiments disaggregation                                   # simulated H100, 2/4/8 devices
    python -m experiments disaggregation --simulate= --model=tiny-llama --num_devices=4 \\
        --rates_per_device=2,4 --prompt_low=64 --prompt_high=192 --output_low=16 --output_high=48 \\
        --max_seq_len=256 --num_requests=48 --slos=tight=300:60,loose=3000:400
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama3-8b", "Model: a simulator shape, or (real runs) a preset or checkpoint.")
flags.DEFINE_string("simulate", "h100", "Accelerator preset to simulate; empty: run for real on host CPU devices.")
flags.DEFINE_list("num_devices", ["2", "4", "8"], "Device counts to compare at.")
flags.DEFINE_list("rates_per_device", ["3", "6", "9", "12"],
                  "Poisson arrival rates, requests/s per device.")
flags.DEFINE_list("slos", ["tight=200:12", "medium=400:15", "loose=2000:40"],
                  "SLO pairs name=TTFT_ms:TPOT_ms (TPOT: a request's mean time per output token after the first).")
flags.DEFINE_float("attainment", 0.9, "Fraction of requests that must meet the SLO (DistServe: 90%).",
                   lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("num_requests", 240, "Requests per run.", lower_bound=1)
flags.DEFINE_integer("prompt_low", 1024, "Shortest prompt.", lower_bound=1)
flags.DEFINE_integer("prompt_high", 3072, "Longest prompt.", lower_bound=1)
flags.DEFINE_integer("output_low", 64, "Shortest output (EOS ignored).", lower_bound=1)
flags.DEFINE_integer("output_high", 256, "Longest output.", lower_bound=1)
flags.DEFINE_integer("num_slots", 64, "Slots per instance.", lower_bound=1)
flags.DEFINE_integer("max_seq_len", 4096, "Context per request.", lower_bound=2)
flags.DEFINE_integer("split_step", 1, "Disaggregated splits tried: 1, 1 + step, ... prefill instances.",
                     lower_bound=1)
flags.DEFINE_integer("chunk_tokens", 512, "Colocated chunked: the token budget of a mixed step.", lower_bound=1)
flags.DEFINE_string("kv_link", None, "Simulated: the link a KV move crosses (default: the accelerator's).")
flags.DEFINE_integer("host_devices", 8, "Real runs: host CPU devices to expose (XLA_FLAGS).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("output_dir", "results/disaggregation", "Where the JSON, table and plot go.")
common.validate_list("num_devices", int, 2, "device counts >= 2")
common.validate_list("rates_per_device", float, 1e-9, "positive rates")


def parse_slos(items) -> dict[str, tuple[float, float]]:
    out = {}
    for item in items:
        name, _, pair = item.partition("=")
        ttft, _, tpot = pair.partition(":")
        out[name] = (float(ttft), float(tpot))
        if not name or min(out[name]) <= 0:
            raise ValueError(item)
    return out


def _slos_ok(items) -> bool:
    try:
        return bool(parse_slos(items))
    except ValueError:
        return False


flags.register_validator("slos", _slos_ok, message="--slos takes name=TTFT_ms:TPOT_ms items, both positive")


def configurations(n: int) -> list[tuple[str, dict]]:
    """(label, how to build) for `n` devices: colocated replicas, then every split."""
    configs = [(f"colocated-prefill_first x{n}", dict(data_parallel=n)),
               (f"colocated-chunked x{n}", dict(data_parallel=n, merge_mode="chunked",
                                                max_num_batched_tokens=FLAGS.chunk_tokens))]
    configs += [(f"disaggregated {p}P:{n - p}D", dict(prefill_instances=p, decode_instances=n - p))
                for p in range(1, n, FLAGS.split_step)]
    return configs


def build(model, options: dict, devices):
    from cbjax import LLM, Replicas

    simulate = FLAGS.simulate or None
    common_options = dict(num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len, dtype="bfloat16",
                          kv_cache="paged")
    if simulate:  # a GPU engine's ragged paged kernels: real tokens, causal pairs, live pages
        common_options["attention"] = "pallas"
    if "data_parallel" in options:
        return Replicas(model, routing="least_loaded", simulate=simulate,
                        devices=None if simulate else devices, **common_options, **options)
    extra = dict(kv_link=FLAGS.kv_link) if simulate else dict(devices=devices)
    return LLM(model, simulate=simulate, **common_options, **options, **extra)


def workload(vocab_size: int, rate: float):
    from cbjax.experimental import LengthDist, synthetic

    return synthetic(FLAGS.num_requests, prompt_len=LengthDist("uniform", low=FLAGS.prompt_low, high=FLAGS.prompt_high),
                     output_len=LengthDist("uniform", low=FLAGS.output_low, high=FLAGS.output_high),
                     vocab_size=vocab_size, seed=FLAGS.seed, arrival="poisson", qps=rate)


def attainment(outputs, ttft_ms: float, tpot_ms: float) -> float:
    from cbjax.experimental import RequestTimes, SLO

    slo = SLO(ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    times = [RequestTimes.from_output(o) for o in outputs if o.finish_reason in ("stop", "length")]
    return sum(slo.met(t.ttft, t.tpot, t.e2el) for t in times) / len(outputs)


def goodput(points: list[tuple[float, float]], target: float) -> float:
    """The highest rate whose attainment (and every lower rate's) reaches `target`."""
    best = 0.0
    for rate, fraction in sorted(points):
        if fraction < target:
            break
        best = rate
    return best


def main(argv):
    del argv
    if not FLAGS.simulate:
        from cbjax.experimental import expose_host_devices

        expose_host_devices(FLAGS.host_devices)
    import jax

    from cbjax.experimental import machine_info, summarize_outputs

    slos = parse_slos(FLAGS.slos)
    model = common.load_model(FLAGS.model, "bfloat16")
    devices = None if FLAGS.simulate else jax.devices()
    rows, results = [], {}
    t_start = time.perf_counter()
    for n in map(int, FLAGS.num_devices):
        if devices is not None and n > len(devices):
            raise app.UsageError(f"--num_devices={n} but {len(devices)} host devices are exposed")
        for label, options in configurations(n):
            points = {name: [] for name in slos}
            for per_device in map(float, FLAGS.rates_per_device):
                rate = per_device * n
                front = build(model, options, devices)
                if not FLAGS.simulate:
                    front.warmup()
                outputs = front.replay([w.as_tuple() for w in workload(model.config.vocab_size, rate)],
                                       desc=f"{label} @ {rate:g}/s")
                getattr(getattr(front, "core", None), "close", lambda: None)()
                getattr(front, "close", lambda: None)()
                metrics = summarize_outputs(outputs)
                entry = {"rate": rate, "devices": n, "median_ttft_ms": metrics["median_ttft_ms"],
                         "p90_ttft_ms": metrics["p90_ttft_ms"], "median_tpot_ms": metrics["median_tpot_ms"],
                         "p90_tpot_ms": metrics["p90_tpot_ms"], "throughput_req_s": metrics["request_throughput"],
                         "attainment": {name: attainment(outputs, *pair) for name, pair in slos.items()}}
                results.setdefault(label, []).append(entry)
                for name in slos:
                    points[name].append((rate, entry["attainment"][name]))
            row = {"config": label, "devices": n}
            row.update({name: goodput(points[name], FLAGS.attainment) for name in slos})
            rows.append(row)
    table = format_table(rows, slos)
    print(table)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "table.md"), "w") as f:
        f.write(table + "\n")
    common.write_json({"flags": common.script_flags(), "machine": machine_info(), "slos_ms": slos,
                       "goodput_req_s": rows, "runs": results, "wall_s": time.perf_counter() - t_start},
                      os.path.join(FLAGS.output_dir, "disaggregation.json"))
    plot(results, slos, os.path.join(FLAGS.output_dir, "disaggregation.png"))


def format_table(rows: list[dict], slos: dict) -> str:
    names = list(slos)
    head = "| devices | configuration | " + " | ".join(
        f"goodput {n} (TTFT<={slos[n][0]:g} ms, TPOT<={slos[n][1]:g} ms) req/s" for n in names) + " |"
    lines = [head, "| --- | --- |" + " ---: |" * len(names)]
    for n in sorted({r["devices"] for r in rows}):
        group = [r for r in rows if r["devices"] == n]
        best = {name: max(r[name] for r in group) for name in names}
        for r in group:
            cells = [f"**{r[name]:g}**" if r[name] == best[name] and best[name] > 0 else f"{r[name]:g}"
                     for name in names]
            lines.append(f"| {n} | {r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, slos: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({e["devices"] for entries in results.values() for e in entries})
    fig, axes = plt.subplots(len(counts), len(slos), figsize=(4.6 * len(slos), 3.4 * len(counts)), squeeze=False)
    for row, n in zip(axes, counts):
        for ax, name in zip(row, slos):
            for label, entries in results.items():
                if entries[0]["devices"] != n:
                    continue
                style = "--" if label.startswith("colocated") else "-"
                ax.plot([e["rate"] for e in entries], [e["attainment"][name] for e in entries], style,
                        marker="o", ms=3, label=label.replace(f" x{n}", ""))
            ax.axhline(FLAGS.attainment, color="gray", lw=0.8)
            ax.set_title(f"{n} devices, SLO {name} ({slos[name][0]:g} / {slos[name][1]:g} ms)", fontsize=9)
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_ylabel("SLO attainment")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    common.savefig(fig, path)


if __name__ == "__main__":
    app.run(main)
