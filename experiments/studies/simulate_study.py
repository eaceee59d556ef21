"""The Anyscale study ("How continuous batching enables 23x throughput in LLM inference")
in simulation: OPT-13B on an A100-40GB, 512-token prompts, output budgets capped at
32/128/512/1536 (EOS ignored), naive static batching vs continuous batching vs
continuous batching on a paged KV cache (vLLM's design), at equal KV memory; then the
latency at Poisson 1 and 4 req/s; then one run of --scale_requests requests, timed on
the wall clock, to show what the simulator costs.

    python -m experiments simulate_study
    python -m experiments simulate_study --accelerator=h100 --model=llama3-8b
"""

from __future__ import annotations

import gc
import os
import time

from absl import app, flags

from experiments.lib import common

FLAGS = flags.FLAGS
flags.DEFINE_string("accelerator", "a100-40gb", "Roofline accelerator (h100, h200, a100-40gb, a100-80gb, tpu-v5e) "
                    "or a calibration .json.")
flags.DEFINE_string("model", "opt-13b", "A shape from cbjax.simulator.MODEL_SHAPES, or a loadable model.")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Weights and KV-cache dtype.")
flags.DEFINE_integer("prompt_len", 512, "Prompt length (the study's).", lower_bound=1)
flags.DEFINE_list("max_gen_lens", ["32", "128", "512", "1536"], "Max generation lengths (the study's columns).")
flags.DEFINE_float("output_mean", 128.0, "Mean of the capped-exponential output budget.", lower_bound=1.0)
flags.DEFINE_integer("num_requests", 1000, "Requests per throughput cell.", lower_bound=1)
flags.DEFINE_integer("kv_cache_bytes", None, "KV memory (default: the accelerator's memory less 10% and the "
                     "weights).", lower_bound=1)
flags.DEFINE_integer("page_size", 16, "Tokens per page.", lower_bound=1)
flags.DEFINE_list("qps", ["1", "4"], "Poisson rates of the latency table (the study's).")
flags.DEFINE_integer("latency_requests", 500, "Requests per latency cell.", lower_bound=1)
flags.DEFINE_integer("latency_max_gen_len", 512, "Output cap of the latency workload.", lower_bound=1)
flags.DEFINE_integer("scale_requests", 100_000, "Requests of the timed scale run (0: skip).", lower_bound=0)
flags.DEFINE_string("scale_model", "llama3-8b", "Model of the scale run.")
flags.DEFINE_string("scale_accelerator", "h100", "Accelerator of the scale run (its memory less 10% and the "
                    "weights is the KV memory; up to 256 sequences, vLLM's default).")
flags.DEFINE_integer("seed", 0, "Workload seed.", lower_bound=0)
flags.DEFINE_string("output_dir", "results/simulate_study", "Where the JSON and the plot go.")
common.validate_list("max_gen_lens", int, 1, "positive integers")
common.validate_list("qps", float, 1e-6, "positive request rates")
flags.register_validator("scale_accelerator", lambda v: v in ("h100", "h200", "a100-40gb", "a100-80gb", "tpu-v5e"),
                         message="--scale_accelerator must name an accelerator")
flags.register_validator("accelerator", common.simulate_ok, message="--accelerator must name an accelerator "
                         "(h100, h200, a100-40gb, a100-80gb, tpu-v5e) or an existing calibration .json file")

ROWS = ("static", "continuous", "continuous-paged")
# What the study reports (its tables are images; these are the figures its text gives).
PUBLISHED = ("Anyscale, OPT-13B on A100-40GB: naive static batching falls to 81 tokens/s at cap 1536; "
             "vLLM (continuous + paged) reaches 23x that; continuous batching (TGI, Ray Serve) up to 8x; "
             "vLLM more than 2x naive continuous batching at every cap; continuous batching lowers the median "
             "latency at QPS 1 and 4.")


def make_llm(model, row: str, max_len: int, budget: int, mean_len: float):
    from cbjax import LLM
    from cbjax.experimental import SlotCache

    per_token = SlotCache.bytes_per_slot(model.config, 1, FLAGS.dtype)
    common_options = dict(simulate=FLAGS.accelerator, dtype=FLAGS.dtype, decode_steps=1)
    if row == "continuous-paged":
        page = FLAGS.page_size
        max_len = -(-max_len // page) * page
        seqs = max(1, int(budget // per_token // mean_len))
        return LLM(model, policy="continuous", kv_cache="paged", kv_cache_bytes=int(budget), page_size=page,
                   num_slots=seqs, max_seq_len=max_len, attention="pallas", **common_options)
    slots = max(1, budget // (per_token * max_len))
    return LLM(model, policy=row, num_slots=slots, batch_size=slots, max_seq_len=max_len, **common_options)


def main(argv):
    del argv
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cbjax import LLM
    from cbjax.experimental import ACCELERATORS, model_for_simulation, summarize_outputs, weight_bytes, write_json
    from cbjax.experimental import LengthDist, synthetic

    start = time.perf_counter()
    model = model_for_simulation(FLAGS.model, FLAGS.dtype)
    dtype_bytes = 2 if FLAGS.dtype == "bfloat16" else 4
    budget = FLAGS.kv_cache_bytes
    if budget is None:
        if FLAGS.accelerator.lower() not in ACCELERATORS:
            raise app.UsageError("--kv_cache_bytes is needed with a calibration file")
        budget = ACCELERATORS[FLAGS.accelerator.lower()].kv_budget(weight_bytes(model.config, dtype_bytes))
    mean_len = FLAGS.prompt_len + FLAGS.output_mean
    caps = [int(x) for x in FLAGS.max_gen_lens]
    throughput = {row: {} for row in ROWS}
    for cap in caps:
        work = synthetic(FLAGS.num_requests, prompt_len=LengthDist("fixed", value=FLAGS.prompt_len),
                         output_len=LengthDist("capped_exponential", mean=FLAGS.output_mean, cap=cap),
                         vocab_size=model.config.vocab_size, seed=FLAGS.seed)
        for row in ROWS:
            llm = make_llm(model, row, FLAGS.prompt_len + cap, budget, mean_len)
            outs = llm.generate([w.prompt for w in work], [w.sampling for w in work], desc=f"{row} gen<={cap}")
            tokens = sum(len(o.token_ids) for o in outs)
            throughput[row][cap] = {"tokens_per_s": tokens / llm.clock(), "seconds": llm.clock(),
                                    "sequences": llm.engine_info.num_slots, "mean_running": llm.stats.mean_running}

    lines = [f"{FLAGS.model} on {FLAGS.accelerator}, KV memory {budget / 1e9:.1f} GB, prompts {FLAGS.prompt_len}, "
             f"{FLAGS.num_requests} requests per column (simulated)", ""]
    header = f"{'tokens/s':<30}" + "".join(f"{'gen<=' + str(c):>12}" for c in caps)
    lines += [header, "-" * len(header)]
    for row in ROWS:
        lines.append(f"{row:<30}" + "".join(f"{throughput[row][c]['tokens_per_s']:>12.1f}" for c in caps))
    for row in ROWS:
        lines.append(f"{row + ' sequences':<30}" + "".join(f"{throughput[row][c]['sequences']:>12}" for c in caps))
    for num, den in (("continuous", "static"), ("continuous-paged", "static"), ("continuous-paged", "continuous")):
        lines.append(f"{num + ' / ' + den:<30}" + "".join(
            f"{throughput[num][c]['tokens_per_s'] / throughput[den][c]['tokens_per_s']:>11.2f}x" for c in caps))

    latency = {}
    for qps in (float(q) for q in FLAGS.qps):
        work = synthetic(FLAGS.latency_requests, prompt_len=LengthDist("fixed", value=FLAGS.prompt_len),
                         output_len=LengthDist("capped_exponential", mean=FLAGS.output_mean,
                                               cap=FLAGS.latency_max_gen_len),
                         vocab_size=model.config.vocab_size, seed=FLAGS.seed, arrival="poisson", qps=qps)
        for row in ROWS:
            llm = make_llm(model, row, FLAGS.prompt_len + FLAGS.latency_max_gen_len, budget, mean_len)
            outs = llm.replay([w.as_tuple() for w in work], desc=f"{row}@{qps:g}")
            latency[f"{row}@{qps:g}"] = summarize_outputs(outs)
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_e2el_ms", "p99_e2el_ms", "output_throughput")
    header = f"{'latency (ms), policy @ qps':<30}" + "".join(f"{k:>18}" for k in keys)
    lines += ["", header, "-" * len(header)]
    for name, m in latency.items():
        lines.append(f"{name:<30}" + "".join(f"{m[k]:>18.1f}" for k in keys))
    lines += ["", "published: " + PUBLISHED]

    scale = None
    if FLAGS.scale_requests:
        scale_model = model_for_simulation(FLAGS.scale_model, FLAGS.dtype)
        accelerator = ACCELERATORS[FLAGS.scale_accelerator]
        work = synthetic(FLAGS.scale_requests, prompt_len=LengthDist("uniform", low=32, high=FLAGS.prompt_len),
                         output_len=LengthDist("capped_exponential", mean=FLAGS.output_mean, cap=512),
                         vocab_size=scale_model.config.vocab_size, seed=FLAGS.seed)
        llm = LLM(scale_model, simulate=FLAGS.scale_accelerator, kv_cache="paged", num_slots=256,
                  max_seq_len=FLAGS.prompt_len + 512, attention="pallas", dtype=FLAGS.dtype,
                  kv_cache_bytes=accelerator.kv_budget(weight_bytes(scale_model.config, dtype_bytes)))
        # Millions of long-lived lists (each request's tokens and token times): the cyclic
        # collector's full passes over them cost about a third of the run; nothing here
        # makes cycles, so it is paused.
        gc.disable()
        try:
            t0 = time.perf_counter()
            outs = llm.generate([w.prompt for w in work], [w.sampling for w in work], desc="scale run")
            wall = time.perf_counter() - t0
        finally:
            gc.enable()
        tokens = sum(len(o.token_ids) for o in outs)
        scale = {"requests": len(outs), "output_tokens": tokens, "wall_s": wall, "simulated_s": llm.clock(),
                 "rounds": llm.stats.rounds, "model": FLAGS.scale_model, "accelerator": FLAGS.scale_accelerator}
        lines.append(f"scale run: {len(outs):,} requests ({FLAGS.scale_model} on {FLAGS.scale_accelerator}, "
                     f"{tokens:,} output tokens, {llm.stats.rounds:,} rounds, {llm.clock():.0f} simulated seconds) "
                     f"simulated in {wall:.1f} s of wall time")
    table = "\n".join(lines)
    print("\n" + table)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for row in ROWS:
        ax.plot(caps, [throughput[row][c]["tokens_per_s"] for c in caps], marker="o", label=row)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("max generation length")
    ax.set_ylabel("output tokens/s (simulated)")
    ax.set_title(f"{FLAGS.model} on {FLAGS.accelerator}, simulated")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    common.savefig(fig, os.path.join(FLAGS.output_dir, "simulate_study.png"))
    write_json(os.path.join(FLAGS.output_dir, "simulate_study.json"),
               {"flags": common.script_flags(), "kv_cache_bytes": budget, "throughput": throughput,
                "latency": latency, "scale": scale, "published": PUBLISHED, "table": table,
                "wall_s": time.perf_counter() - start})
    print(f"\nwrote {FLAGS.output_dir}/simulate_study.json and simulate_study.png in "
          f"{time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
