"""Capacity in the manner of Sarathi-Serve: the highest Poisson rate a scheduler sustains
with the P99 time between tokens under an SLO (and the median scheduling delay bounded,
so that a queue growing without end does not count as sustained).

prefill_first (vLLM's scheduler at the time: a new prompt's whole prefill runs while every
decode waits) against chunked prefill at a few token budgets (Sarathi-Serve's stall-free
batching), on ShareGPT-length and Azure-trace workloads. Each probe replays
--num_requests requests at one rate; the rate doubles until a probe fails, then bisects.
The table prints each scheduler's capacity, its ratio to prefill_first, and Sarathi-Serve's
published ratio (2.6x for Mistral-7B on one A100 under the strict SLO) beside it.

    python -m experiments capacity --flagfile=configs/capacity_cpu.cfg
    python -m experiments capacity --flagfile=configs/capacity_a100.cfg   # simulated Mistral-7B
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags

from experiments.lib import common
from cbjax.experimental import engine_args
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory "
                    "(under --simulate also a shape: mistral-7b, llama3-8b, ...).")
flags.DEFINE_list("workloads", ["sharegpt", "azure_conv"], "Workloads, one table block each: synthetic, sharegpt, a trace "
                  "name (azure_code, azure_conv, mooncake, mooncake_synthetic) or a trace file. Arrivals are "
                  "Poisson at the probed rate (a trace keeps its burstiness unless --time_scale is set).")
flags.DEFINE_list("schedulers", ["prefill_first", "chunked@64", "chunked@128"], "prefill_first, fused, or "
                  "chunked@BUDGET (Sarathi-Serve's token budget per step).")
EngineArgs.define_flags(["num_slots", "max_seq_len", "dtype", "kv_cache", "kv_cache_bytes", "page_size",
                         "attention"], max_seq_len=512)
flags.adopt_module_key_flags(engine_args)  # the EngineArgs knobs, in --help
flags.DEFINE_float("tbt_slo_ms", None, "P99 time-between-tokens SLO in ms. Unset: --slo_scale times one decode "
                   "step of --slo_batch requests with --slo_context-token prompts and no prefill beside them, measured "
                   "(or simulated) here: Sarathi-Serve's strict SLO is 5x such a step (batch 32, 4k context), its "
                   "relaxed one 25x.", lower_bound=1e-6)
flags.DEFINE_float("slo_scale", 5.0, "The SLO as a multiple of that decode step (when --tbt_slo_ms is unset).",
                   lower_bound=1.0)
flags.DEFINE_integer("slo_batch", 8, "Requests decoding together in the step that sets the SLO (at most "
                     "--num_slots; Sarathi-Serve: 32).", lower_bound=1)
flags.DEFINE_integer("slo_context", 256, "Their prompt length (below --max_seq_len; Sarathi-Serve: 4096).",
                     lower_bound=1)
flags.DEFINE_float("max_scheduling_delay_s", 2.0, "A probe also fails when the median time from arrival to the "
                   "first scheduled prefill, over the later half of its arrivals, exceeds this (Sarathi-Serve: the "
                   "median over all, 2 s; a probe of a few hundred requests ends before a growing queue moves the "
                   "median over all).", lower_bound=0.0)
flags.DEFINE_float("qps_start", 0.5, "First rate probed (requests per second).", lower_bound=1e-6)
flags.DEFINE_float("qps_max", 64.0, "Highest rate probed.", lower_bound=1e-6)
flags.DEFINE_float("qps_min", 0.05, "Below this rate a scheduler that still fails has capacity 0.", lower_bound=1e-9)
flags.DEFINE_integer("search_steps", 3, "Bisection steps after the bracket is found.", lower_bound=0)
flags.DEFINE_float("published_ratio", 2.6, "The published capacity ratio printed beside ours (Sarathi-Serve, "
                   "Mistral-7B, one A100, strict SLO, against vLLM).", lower_bound=0.0)
flags.DEFINE_string("output_dir", "results/capacity", "Where the JSON and the plot go.")
common.define_simulate_flag()
common.define_workload_flags(num_requests=48, output_mean=64.0, output_cap=128)
flags.adopt_module_key_flags(common)
common.validate_list("workloads", lambda w: 0 if w == "synthetic" or common.trace_ok(w) else -1, 0,
                     "workloads: synthetic, sharegpt, a trace name or a trace file")


SLO_TOKENS = 17  # tokens each request of the SLO's decode step generates


def parse_scheduler(name: str) -> tuple[str, int | None]:
    """'prefill_first' / 'fused' -> (mode, None); 'chunked@128' -> ('chunked', 128)."""
    mode, _, budget = name.partition("@")
    if mode not in ("prefill_first", "fused", "chunked") or (mode == "chunked") != bool(budget):
        raise ValueError(name)
    if budget and int(budget) < 2:
        raise ValueError(name)
    return mode, int(budget) if budget else None


common.validate_list("schedulers", lambda s: 0 if parse_scheduler(s) else -1, 0,
                     "schedulers: prefill_first, fused or chunked@BUDGET (BUDGET >= 2)")
flags.register_multi_flags_validator(
    ["tbt_slo_ms", "slo_batch", "slo_context", "num_slots", "max_seq_len"],
    lambda v: v["tbt_slo_ms"] is not None or (v["slo_batch"] <= v["num_slots"]
                                              and v["slo_context"] + SLO_TOKENS <= v["max_seq_len"]),
    message="the SLO's decode step needs --slo_batch <= --num_slots and --slo_context + 17 <= --max_seq_len "
            "(or give --tbt_slo_ms)")


def decode_step_ms(model, llm) -> float:
    """One decode step of --slo_batch requests with --slo_context-token prompts: the median
    gap between their tokens once all have started (their prefills come first)."""
    import numpy as np

    from cbjax import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, FLAGS.slo_context).tolist() for _ in range(FLAGS.slo_batch)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=SLO_TOKENS, ignore_eos=True), use_tqdm=False)
    started = max(o.metrics.first_token_time for o in outs)
    gaps = [b - a for o in outs for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:]) if a >= started]
    return 1000 * statistics.median(gaps)


def make_llm(model, scheduler: str):
    from cbjax import LLM

    mode, budget = parse_scheduler(scheduler)
    llm = LLM(model, policy="continuous", num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len, dtype=FLAGS.dtype,
              kv_cache=FLAGS.kv_cache, kv_cache_bytes=FLAGS.kv_cache_bytes, page_size=FLAGS.page_size,
              attention=FLAGS.attention, merge_mode=mode,
              max_num_batched_tokens=budget, **common.llm_options())
    llm.warmup()
    return llm


def probe(llm, model, workload_name: str, scheduler: str, qps: float, slo_ms: float) -> dict:
    FLAGS.workload = workload_name
    workload = common.make_workload(model, "poisson", qps)
    llm.reset_stats()
    metrics = common.measure_replay(llm, workload, desc=f"{workload_name} {scheduler} @{qps:.3g}")
    later = metrics["scheduling_delay_s"][len(workload) // 2:]
    delays = [d for d in later if d is not None]
    delay = statistics.median(delays) if delays else float("inf")
    ok = bool(metrics["p99_itl_ms"] <= slo_ms and delay <= FLAGS.max_scheduling_delay_s)
    return {"qps": qps, "passes": ok, "median_scheduling_delay_s": delay, "p99_tbt_ms": metrics["p99_itl_ms"],
            "median_ttft_ms": metrics["median_ttft_ms"], "output_throughput": metrics["output_throughput"],
            "mean_running": metrics["mean_running"]}


def print_table(results: dict, slo_ms: float) -> str:
    lines = [f"P99 TBT SLO {slo_ms:.1f} ms, later arrivals' median scheduling delay <= "
             f"{FLAGS.max_scheduling_delay_s:g} s; "
             f"{FLAGS.model}{' on ' + FLAGS.simulate + ' (simulated)' if FLAGS.simulate else ''}"]
    header = f"{'workload':<14}{'scheduler':<16}{'capacity req/s':>16}{'vs prefill_first':>18}" \
             f"{'P99 TBT ms':>12}{'med TTFT ms':>13}{'published':>11}"
    lines += [header, "-" * len(header)]
    for workload_name, rows in results.items():
        base = rows.get("prefill_first", {}).get("capacity")
        for scheduler, row in rows.items():
            at = row["at_capacity"]
            ratio = "" if not base or scheduler == "prefill_first" else f"{row['capacity'] / base:.2f}x"
            if base == 0 and scheduler != "prefill_first":
                ratio = "inf" if row["capacity"] > 0 else "-"
            published = f"{FLAGS.published_ratio:.1f}x" if scheduler.startswith("chunked") else ""
            lines.append(f"{workload_name:<14}{scheduler:<16}{row['capacity']:>16.3g}{ratio:>18}"
                         f"{at['p99_tbt_ms'] if at else float('nan'):>12.1f}"
                         f"{at['median_ttft_ms'] if at else float('nan'):>13.0f}{published:>11}")
    return "\n".join(lines)


def plot(results: dict, slo_ms: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.6 * len(results), 4.2), squeeze=False)
    for ax, (workload_name, rows) in zip(axes[0], results.items()):
        for scheduler, row in rows.items():
            probes = sorted(row["probes"], key=lambda p: p["qps"])
            line, = ax.plot([p["qps"] for p in probes], [p["p99_tbt_ms"] for p in probes], marker="o",
                            label=f"{scheduler} (capacity {row['capacity']:.3g})")
            failed = [p for p in probes if not p["passes"]]  # hollow: the probe failed (TBT or queue)
            ax.plot([p["qps"] for p in failed], [p["p99_tbt_ms"] for p in failed], "o", markerfacecolor="white",
                    color=line.get_color())
        ax.axhline(slo_ms, color="k", linestyle="--", linewidth=1, label="P99 TBT SLO")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("Poisson rate (req/s)")
        ax.set_ylabel("P99 time between tokens (ms); hollow: failed")
        ax.set_title(workload_name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    common.savefig(fig, path)


def main(argv):
    del argv
    from cbjax.experimental import find_capacity, write_json

    start = time.perf_counter()
    if FLAGS["workload"].present:
        raise app.UsageError("capacity.py takes --workloads (a list), not --workload")
    FLAGS.workload = FLAGS.workloads[0]
    model = common.load_model(FLAGS.model, FLAGS.dtype, with_tokenizer=common.wants_tokenizer())
    slo_ms, step_ms = FLAGS.tbt_slo_ms, None
    results = {w: {} for w in FLAGS.workloads}
    for scheduler in FLAGS.schedulers:
        common.release_programs()
        llm = make_llm(model, scheduler)
        if slo_ms is None:  # on the first scheduler's engine: decodes without prefills step alike in every mode
            step_ms = decode_step_ms(model, llm)
            slo_ms = FLAGS.slo_scale * step_ms
            print(f"decode step of {FLAGS.slo_batch} x {FLAGS.slo_context} tokens: {step_ms:.1f} ms -> "
                  f"P99 TBT SLO {slo_ms:.1f} ms")
        for workload_name in FLAGS.workloads:
            probes = {}

            def passes(qps):
                probes[qps] = probe(llm, model, workload_name, scheduler, qps, slo_ms)
                return probes[qps]["passes"]

            capacity, _ = find_capacity(passes, FLAGS.qps_start, FLAGS.qps_min, FLAGS.qps_max, FLAGS.search_steps)
            results[workload_name][scheduler] = {"capacity": capacity, "at_capacity": probes.get(capacity),
                                                 "probes": list(probes.values())}
            print(f"{workload_name} {scheduler}: capacity {capacity:.3g} req/s")
    table = print_table(results, slo_ms)
    print("\n" + table)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    write_json(os.path.join(FLAGS.output_dir, "capacity.json"),
               {"flags": common.script_flags(), "tbt_slo_ms": slo_ms, "slo_decode_step_ms": step_ms,
                "results": results, "table": table, "wall_s": time.perf_counter() - start})
    plot(results, slo_ms, os.path.join(FLAGS.output_dir, "capacity.png"))
    print(f"\nwrote {FLAGS.output_dir}/capacity.json and .png in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
