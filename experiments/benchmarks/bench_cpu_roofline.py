"""The CPU roofline both sides, measured several times in one run: is the reference stable?

Each run measures what the CPU benchmarks report against (experiments/lib/cpu_roofline.py):
the memory side by every read method over a buffer larger than the caches, and the compute
side, the model's decode matmuls at each batch through the best GEMM at their shapes. Prints
each run, then per figure the median and the spread (max / min - 1) over the runs; a roof
is fit to report against when its spread is within 10%. The matvec over one large matrix,
the old reference, is among the memory methods for comparison. Writes a JSON file.

    python -m experiments bench_cpu_roofline
    python -m experiments bench_cpu_roofline --runs=5 --batches=1,8,32,64
"""

from __future__ import annotations

import platform

from experiments.lib import common  # noqa: F401  (quiets transformers and matplotlib)

from absl import app, flags

from experiments.lib.cpu_roofline import compute_side, define_read_flag, memory_side

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset or Hugging Face directory whose decode matmuls the compute side times.")
flags.DEFINE_list("batches", ["1", "8", "32", "64"], "Rows of the decode steps whose matmuls are timed.")
common.validate_list("batches", int, 1, "positive integers")
flags.DEFINE_integer("runs", 5, "Measurements of both sides, one after another.", lower_bound=1)
flags.DEFINE_integer("repeats", 12, "Timed passes of each method in a run, the methods in turn (the fastest is its "
                     "figure).", lower_bound=1)
flags.DEFINE_string("output_json", "results/bench_cpu_roofline.json", "Where to write the results.")
define_read_flag()


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1.0


def main(argv):
    del argv
    import jax
    import numpy as np
    from tqdm.auto import tqdm

    from cbjax.experimental import load_model

    config = load_model(FLAGS.model, dtype="float32").config
    batches = sorted({int(b) for b in FLAGS.batches})
    runs = []
    for _ in tqdm(range(FLAGS.runs), desc="roofline runs"):
        memory = memory_side(FLAGS.roofline_read_mb << 20, FLAGS.repeats)
        compute = compute_side(config, batches, FLAGS.repeats)
        runs.append({"memory": memory, "compute": compute})
        tqdm.write(f"memory {memory['GBps']:.1f} GB/s ({memory['method']}); compute "
                   + ", ".join(f"{b} rows {compute[b]['GFLOPs']:.0f} GFLOP/s" for b in batches))
    figures = {"memory GB/s (the roof)": [r["memory"]["GBps"] for r in runs]}
    for name in runs[0]["memory"]["methods_GBps"]:
        figures[f"  read by {name}"] = [r["memory"]["methods_GBps"][name] for r in runs]
    for b in batches:
        figures[f"compute GFLOP/s at {b} rows"] = [r["compute"][b]["GFLOPs"] for r in runs]
    width = max(map(len, figures))
    print(f"\n{'figure':<{width}} | {'median':>8} | {'min':>8} | {'max':>8} | spread")
    summary = {}
    for name, values in figures.items():
        s = spread(values)
        summary[name.strip()] = {"values": values, "median": float(np.median(values)), "spread": s}
        print(f"{name:<{width}} | {np.median(values):>8.1f} | {min(values):>8.1f} | {max(values):>8.1f} | "
              f"{100 * s:.1f}%" + ("  (over 10%: not fit as a reference)" if s > 0.10 else ""))
    common.write_json({
        "model": FLAGS.model, "batches": batches, "runs": [
            {"memory": r["memory"], "compute": {str(b): c for b, c in r["compute"].items()}} for r in runs],
        "summary": summary, "machine": {"platform": platform.platform(), "jax": jax.__version__}}, FLAGS.output_json)


if __name__ == "__main__":
    app.run(main)
