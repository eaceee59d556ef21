"""The simulator against measurements: on this machine, the compare_batching and
latency_sweep settings run for real and simulated (with a calibration from
calibrate_simulator.py), side by side, with the error of each metric; or, with
--published, against published GPU measurements (configs/published_gpu_measurements.json:
TensorRT-LLM's, NIM's and vLLM's tables on A100 and H100), source | setup | published |
simulated | ratio.

    python -m experiments calibrate_simulator && python -m experiments validate_simulator
    python -m experiments validate_simulator --published=configs/published_gpu_measurements.json
    python -m experiments validate_simulator --published=configs/published_gpu_measurements.json --fit
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_string("calibration", "results/sim_calibration.json", "Cost model from calibrate_simulator.py.")
flags.DEFINE_list("policies", ["static", "continuous"], "Policies to validate.")
flags.DEFINE_list("max_gen_lens", ["8", "32", "128"], "Throughput columns (compare_batching_cpu's).")
flags.DEFINE_integer("prompt_len", 16, "Throughput prompts' length.", lower_bound=1)
flags.DEFINE_integer("num_slots", 8, "Slots at the largest max generation length (equal KV memory across "
                     "columns) and in the latency runs.", lower_bound=1)
flags.DEFINE_list("qps", ["1", "3"], "Latency runs' request rates (latency_sweep_cpu's).")
flags.DEFINE_integer("max_seq_len", 256, "Latency runs' context.", lower_bound=8)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and KV-cache dtype.")
flags.DEFINE_string("output_dir", "results/validate_simulator", "Where the JSON and the plot go.")
common.define_workload_flags(num_requests=24, output_mean=32.0, output_cap=96)
flags.adopt_module_key_flags(common)
common.validate_list("policies", lambda p: 0 if p in ("static", "dynamic", "continuous") else -1, 0,
                     "policies among static, dynamic, continuous")
common.validate_list("max_gen_lens", int, 1, "positive integers")
common.validate_list("qps", float, 1e-6, "positive request rates")
flags.DEFINE_string("published", "", "A file of published GPU measurements: compare the simulator's accelerator "
                    "presets with them instead of this machine's runs.")
flags.DEFINE_bool("fit", False, "With --published: refit the presets' efficiencies on the rows marked 'fit' and "
                  "print them (to freeze in cbjax/simulator/hardware.py) before the table.")
flags.register_multi_flags_validator(
    ["calibration", "published"], lambda f: bool(f["published"]) or os.path.isfile(f["calibration"]),
    message="--calibration must be an existing file (run experiments/studies/calibrate_simulator.py first)")
flags.register_validator("published", lambda p: not p or os.path.isfile(p), message="--published must be a file")

METRICS = ("output_throughput", "median_ttft_ms", "median_e2el_ms")


def throughput_run(llm, work) -> dict:
    from cbjax.experimental import summarize_outputs

    llm.warmup()
    t0 = llm.clock()
    outs = llm.generate([w.prompt for w in work], [w.sampling for w in work], use_tqdm=True,
                        desc=("sim " if llm.engine_info.kind == "simulated" else "real ") + "generate")
    metrics = summarize_outputs(outs, duration=llm.clock() - t0)
    return {k: metrics[k] for k in METRICS}


def main(argv):
    del argv
    if FLAGS.published:
        from experiments.lib import published_validation

        published_validation.run(FLAGS.published, FLAGS.fit, FLAGS.output_dir)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cbjax import LLM
    from cbjax.experimental import CalibratedCost, LengthDist, load_model, SlotCache, synthetic, write_json

    start = time.perf_counter()
    model = load_model(FLAGS.model, dtype=FLAGS.dtype, with_tokenizer=False)
    cost = CalibratedCost.load(FLAGS.calibration)
    rows = []

    def compare(name: str, real: dict, sim: dict) -> None:
        for k in METRICS:
            rows.append({"scenario": name, "metric": k, "real": real[k], "simulated": sim[k],
                         "error": sim[k] / real[k] - 1.0 if real[k] else float("nan")})

    caps = [int(x) for x in FLAGS.max_gen_lens]
    budget = FLAGS.num_slots * SlotCache.bytes_per_slot(model.config, FLAGS.prompt_len + max(caps), FLAGS.dtype)
    for cap in caps:
        max_len = FLAGS.prompt_len + cap
        slots = max(1, budget // SlotCache.bytes_per_slot(model.config, max_len, FLAGS.dtype))
        work = synthetic(FLAGS.num_requests, prompt_len=LengthDist("fixed", value=FLAGS.prompt_len),
                         output_len=LengthDist("capped_exponential", mean=FLAGS.output_mean, cap=cap),
                         vocab_size=model.config.vocab_size, seed=FLAGS.seed)
        for policy in FLAGS.policies:
            options = dict(policy=policy, num_slots=slots, batch_size=slots, max_seq_len=max_len, dtype=FLAGS.dtype)
            real = throughput_run(LLM(model, **options), work)
            sim = throughput_run(LLM(model, **options, simulate=cost), work)
            compare(f"all at once, gen<={cap}, {policy}", real, sim)
    for qps in (float(q) for q in FLAGS.qps):
        work = common.make_workload(model, "poisson", qps)
        for policy in FLAGS.policies:
            options = dict(policy=policy, num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len, dtype=FLAGS.dtype)
            real = common.run_replay(LLM(model, **options), work, desc=f"real {policy}@{qps:g}")
            sim = common.run_replay(LLM(model, **options, simulate=cost), work, desc=f"sim {policy}@{qps:g}")
            compare(f"Poisson {qps:g} req/s, {policy}", real, sim)

    width = max(len(r["scenario"]) for r in rows) + 2
    header = f"{'scenario':<{width}}{'metric':<20}{'real':>12}{'simulated':>12}{'error':>9}"
    lines = [header, "-" * len(header)] + [
        f"{r['scenario']:<{width}}{r['metric']:<20}{r['real']:>12.1f}{r['simulated']:>12.1f}{100 * r['error']:>8.1f}%"
        for r in rows]
    errors = {k: [abs(r["error"]) for r in rows if r["metric"] == k] for k in METRICS}
    lines.append("mean |error|: " + ", ".join(f"{k} {100 * sum(v) / len(v):.1f}%" for k, v in errors.items()))
    lines.append("max |error|:  " + ", ".join(f"{k} {100 * max(v):.1f}%" for k, v in errors.items()))
    table = "\n".join(lines)
    print("\n" + table)

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.6 * len(METRICS), 4.2))
    for ax, k in zip(axes, METRICS):
        real = [r["real"] for r in rows if r["metric"] == k]
        sim = [r["simulated"] for r in rows if r["metric"] == k]
        top = max(real + sim) * 1.1
        ax.plot([0, top], [0, top], color="grey", lw=0.8)
        ax.scatter(real, sim)
        ax.set_title(k)
        ax.set_xlabel("real")
        ax.set_ylabel("simulated")
        ax.grid(alpha=0.3)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    common.savefig(fig, os.path.join(FLAGS.output_dir, "simulated_vs_real.png"))
    write_json(os.path.join(FLAGS.output_dir, "validate_simulator.json"),
               {"flags": common.script_flags(), "calibration": cost.describe(), "rows": rows, "table": table,
                "wall_s": time.perf_counter() - start})
    print(f"\nwrote {FLAGS.output_dir}/validate_simulator.json and simulated_vs_real.png "
          f"in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
