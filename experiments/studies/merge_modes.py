"""Prefill meets decode: prefill_first vs fused (Orca) vs chunked (Sarathi-Serve) prefill.

Short prompts with long outputs start decoding at once; long prompts then arrive at
Poisson times into the running decodes. Under prefill_first each long prefill runs
as its own call while every decode waits (a generation stall); fused runs it in the
same step as the decodes, which still wait for it; chunked cuts it into pieces under
a per-step token budget, so a decode never waits longer than one budget's step. Per
mode: the decoders' inter-token latency (median, p99, max: the stalls), the long
prompts' TTFT, TPOT, and throughput; a budget sweep for chunked. Writes JSON and a
PNG (p99/max ITL and long-prompt TTFT per run).

    python -m experiments merge_modes --flagfile=configs/merge_modes_cpu.cfg
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import common
from cbjax.experimental import engine_args
from cbjax import EngineArgs

FLAGS = flags.FLAGS
common.define_simulate_flag()
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_integer("num_decoders", 6, "Short-prompt requests that decode from the start.", lower_bound=1)
flags.DEFINE_integer("decoder_prompt_len", 16, "Their prompt length.", lower_bound=1)
flags.DEFINE_integer("decoder_output_len", 128, "Their output length (EOS ignored).", lower_bound=2)
flags.DEFINE_integer("num_long", 6, "Long prompts arriving into the running decodes.", lower_bound=1)
flags.DEFINE_integer("long_prompt_len", 384, "Their prompt length.", lower_bound=1)
flags.DEFINE_integer("long_output_len", 16, "Their output length (EOS ignored).", lower_bound=1)
flags.DEFINE_float("long_qps", 1.0, "Poisson rate of the long prompts (requests per second).", lower_bound=1e-6)
flags.DEFINE_float("long_start_s", 0.5, "When the first long prompt may arrive.", lower_bound=0.0)
EngineArgs.define_flags(["num_slots", "max_seq_len", "kv_cache", "dtype"])
flags.adopt_module_key_flags(engine_args)  # the EngineArgs knobs, in --help
flags.DEFINE_list("modes", ["prefill_first", "fused", "chunked"], "Merge modes to run.")
flags.DEFINE_list("chunked_budgets", ["32", "64", "128", "256"], "Token budgets per step for chunked (the sweep).")
flags.DEFINE_integer("fused_budget", None, "Token budget per step for fused (default: max_seq_len).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Workload seed.", lower_bound=0)
flags.DEFINE_string("output_dir", "results/merge_modes", "Where the JSON and the plot go.")
common.validate_list("modes", lambda m: 0 if m in ("prefill_first", "fused", "chunked") else -1, 0,
                     "merge modes among prefill_first, fused, chunked")
common.validate_list("chunked_budgets", int, 2, "token budgets >= 2")
flags.register_multi_flags_validator(
    ["long_prompt_len", "long_output_len", "decoder_prompt_len", "decoder_output_len", "max_seq_len"],
    lambda v: max(v["long_prompt_len"] + v["long_output_len"], v["decoder_prompt_len"] + v["decoder_output_len"])
    <= v["max_seq_len"], message="prompts plus outputs must fit --max_seq_len")

KEYS = ("decoder_median_itl_ms", "decoder_p99_itl_ms", "decoder_max_itl_ms", "long_median_ttft_ms",
        "median_tpot_ms", "output_throughput")


def workload(vocab: int):
    import numpy as np

    from cbjax import SamplingParams

    rng = np.random.default_rng(FLAGS.seed)
    items = [(0.0, rng.integers(3, vocab, size=FLAGS.decoder_prompt_len).tolist(),
              SamplingParams(max_tokens=FLAGS.decoder_output_len, ignore_eos=True)) for _ in range(FLAGS.num_decoders)]
    arrivals = FLAGS.long_start_s + np.cumsum(rng.exponential(1.0 / FLAGS.long_qps, size=FLAGS.num_long))
    items += [(float(t), rng.integers(3, vocab, size=FLAGS.long_prompt_len).tolist(),
               SamplingParams(max_tokens=FLAGS.long_output_len, ignore_eos=True)) for t in arrivals]
    return items


def run(model, items, mode: str, budget: int | None) -> dict:
    from cbjax import LLM
    from cbjax.experimental import Engine, summarize_outputs

    common.release_programs()
    llm = LLM(model, num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len, kv_cache=FLAGS.kv_cache,
              dtype=FLAGS.dtype, merge_mode=mode, max_num_batched_tokens=budget, **common.llm_options())
    name = mode if budget is None or mode == "fused" else f"{mode}@{budget}"
    llm.warmup()
    compiled = Engine.num_backend_compilations()
    outs = llm.replay(items, use_tqdm=True, desc=name)
    if Engine.num_backend_compilations() != compiled:
        print(f"warning: {name} compiled during the timed run")
    metrics = summarize_outputs(outs)
    decoders = summarize_outputs(outs[:FLAGS.num_decoders])
    longs = summarize_outputs(outs[FLAGS.num_decoders:])
    metrics.update({f"decoder_{k}": v for k, v in decoders.items() if "itl" in k})
    metrics.update({f"long_{k}": v for k, v in longs.items() if "ttft" in k})
    return {"mode": mode, "budget": budget, "name": name, "mean_running": llm.stats.mean_running, **metrics}


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["name"] for r in runs]
    x = np.arange(len(runs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for offset, (key, label) in zip((-0.2, 0.2), (("decoder_p99_itl_ms", "p99"), ("decoder_max_itl_ms", "max"))):
        ax1.bar(x + offset, [r[key] for r in runs], 0.4, label=f"{label} inter-token latency")
    ax1.set_ylabel("decoders' inter-token latency (ms)")
    ax1.set_title("generation stalls while long prompts prefill")
    ax2.bar(x, [r["long_median_ttft_ms"] for r in runs], 0.6, color="tab:green")
    ax2.set_ylabel("long prompts' median TTFT (ms)")
    ax2.set_title("what the long prompts pay")
    for ax in (ax1, ax2):
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.grid(alpha=0.3, axis="y")
    ax1.legend()
    common.savefig(fig, path)


def main(argv):
    del argv
    from cbjax.experimental import write_json

    start = time.perf_counter()
    model = common.load_model(FLAGS.model, FLAGS.dtype)
    items = workload(model.config.vocab_size)
    runs = []
    for mode in FLAGS.modes:
        if mode == "chunked":
            runs += [run(model, items, mode, int(b)) for b in FLAGS.chunked_budgets]
        else:
            runs.append(run(model, items, mode, (FLAGS.fused_budget or FLAGS.max_seq_len) if mode == "fused" else None))
    width = max(len("mode"), *(len(r["name"]) for r in runs)) + 2
    header = f"{'mode':<{width}}" + "".join(f"{k:>24}" for k in KEYS)
    table = "\n".join([header, "-" * len(header)] + [
        f"{r['name']:<{width}}" + "".join(f"{r[k]:>24.1f}" for k in KEYS) for r in runs])
    print("\n" + table)
    base = next((r for r in runs if r["mode"] == "prefill_first"), None)
    if base is not None:
        for r in runs:
            if r is not base:
                print(f"{r['name']}: p99 ITL {r['decoder_p99_itl_ms'] / base['decoder_p99_itl_ms']:.2f}x, max ITL "
                      f"{r['decoder_max_itl_ms'] / base['decoder_max_itl_ms']:.2f}x, long TTFT "
                      f"{r['long_median_ttft_ms'] / base['long_median_ttft_ms']:.2f}x, throughput "
                      f"{r['output_throughput'] / base['output_throughput']:.2f}x of prefill_first")
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    write_json(os.path.join(FLAGS.output_dir, "merge_modes.json"),
               {"flags": common.script_flags(), "runs": runs, "table": table, "wall_s": time.perf_counter() - start})
    plot(runs, os.path.join(FLAGS.output_dir, "merge_modes.png"))
    print(f"\nwrote {FLAGS.output_dir}/merge_modes.json and .png in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
