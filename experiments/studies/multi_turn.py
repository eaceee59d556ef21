"""Multi-turn replay with host memory behind the prefix cache: conversations whose turns re-send
their history, at a device KV budget that holds a fraction of the working set, with device-only
prefix caching against the same device budget plus a host tier (and, for scale, no prefix cache).
Each row is measured on the wall clock here and predicted by the simulator (--calibration) for
the same requests, so the table shows how far the predicted TTFT change is from the measured one.

    python -m experiments multi_turn                                   # Mooncake conversations
    python -m experiments multi_turn --workload=sharegpt_multi_turn    # ShareGPT, turn after turn

The working set is the distinct full pages of all prompts (their hash chains); "reusable" is what
an unbounded prefix cache could skip (leading pages an earlier prompt already had).
"""

from __future__ import annotations

import math
import os

from absl import app, flags

from experiments.lib import common
from cbjax import LLM
from cbjax.experimental import engine_args
from cbjax import EngineArgs
from cbjax.experimental import CalibratedCost

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_enum("workload", "mooncake", ["mooncake", "mooncake_synthetic", "sharegpt_multi_turn"],
                  "Mooncake's conversation trace (hash ids: shared ids are shared blocks), its synthetic trace, "
                  "or ShareGPT conversations replayed turn after turn with their history.")
flags.DEFINE_integer("num_requests", 400, "Requests (turns) replayed.", lower_bound=1)
flags.DEFINE_float("length_scale", 1 / 32, "Multiply prompt and output lengths (and Mooncake's 512-token blocks) by "
                   "this: 1/32 makes a block 16 tokens, a page.", lower_bound=1e-4)
flags.DEFINE_float("rate", 1.0, "Mooncake: requests per second (the trace's burstiness kept); ShareGPT: "
                   "conversations started per second.", lower_bound=1e-3)
flags.DEFINE_float("think_s", 8.0, "ShareGPT: mean seconds between a conversation's turns.", lower_bound=0.0)
flags.DEFINE_integer("output_cap", 16, "Most tokens a request generates.", lower_bound=1)
flags.DEFINE_float("device_fraction", 0.1, "Device KV pages as a fraction of the working set's pages.",
                   lower_bound=1e-4)
flags.DEFINE_float("host_fraction", 1.25, "Host tier bytes as a fraction of the working set's.", lower_bound=1e-4)
flags.DEFINE_list("rows", ["none", "device", "device+host"], "Rows: no prefix cache, device-only prefix caching, "
                  "and prefix caching with the host tier.")
flags.DEFINE_string("calibration", "replay", "The simulator's cost model for the predicted rows: replay (fit on the "
                    "rounds of the first measured row's own replay, with this engine's measured host-copy bandwidth: "
                    "the other rows are then predicted from it), profile (fit on a synthetic workload without shared "
                    "prefixes through the same engine), a calibration .json file, or an accelerator; empty: measure "
                    "only.")
flags.DEFINE_integer("calibration_requests", 48, "--calibration=profile: requests profiled.", lower_bound=1)
flags.DEFINE_bool("measure", True, "Run the rows on this machine (else predicted only).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("output_dir", "results/multi_turn", "Where the JSON and the plot go.")
EngineArgs.define_flags(["num_slots", "max_seq_len", "dtype", "page_size", "merge_mode", "max_num_batched_tokens"],
                        num_slots=8, max_seq_len=1024, merge_mode="chunked", max_num_batched_tokens=128)
flags.adopt_module_key_flags(engine_args)
common.validate_list("rows", lambda r: 0 if r in ("none", "device", "device+host") else -1, 0,
                     "rows among none, device, device+host")


def make_workload(model):
    from cbjax.experimental import traces

    vocab = model.config.vocab_size
    if FLAGS.workload == "sharegpt_multi_turn":
        return traces.sharegpt_multi_turn_workload(
            FLAGS.num_requests, vocab_size=vocab, tokenizer=model.tokenizer, qps=FLAGS.rate, think_s=FLAGS.think_s,
            length_scale=FLAGS.length_scale, max_len=FLAGS.max_seq_len, max_output_len=FLAGS.output_cap,
            seed=FLAGS.seed)
    return traces.trace_workload(FLAGS.workload, vocab_size=vocab, num_requests=FLAGS.num_requests, rate=FLAGS.rate,
                                 length_scale=FLAGS.length_scale, max_len=FLAGS.max_seq_len,
                                 max_output_len=FLAGS.output_cap, seed=FLAGS.seed)


def page_reuse(workload, page_size: int) -> dict:
    """The prompts' distinct full pages (the working set), their total, and the pages an
    unbounded prefix cache could skip (leading pages an earlier prompt had; never a page holding
    a prompt's last token, which is always computed)."""
    from cbjax.experimental import PrefixIndex

    keys = PrefixIndex(page_size).keys
    seen, total, reusable = set(), 0, 0
    for w in workload:
        chain = keys(w.prompt[:len(w.prompt) - 1])
        lead = 0
        while lead < len(chain) and chain[lead] in seen:
            lead += 1
        total += len(chain)
        reusable += lead
        seen.update(chain)
    return {"working_set_pages": len(seen), "prompt_pages": total, "reusable_pages": reusable}


def row_args(row: str, num_pages: int, host_bytes: int) -> EngineArgs:
    return EngineArgs(num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len, dtype=FLAGS.dtype,
                      merge_mode=FLAGS.merge_mode, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                      kv_cache="paged", page_size=FLAGS.page_size, num_pages=num_pages,
                      enable_prefix_caching=row != "none", host_kv_cache_bytes=host_bytes if row == "device+host" else 0)


def profiled_cost(model, args: EngineArgs):
    """A cost model of this machine for this configuration: the rounds of a synthetic workload
    (no shared prefixes: nothing of the replay's) through the same engine, fitted, and the
    bandwidth of its host-tier copies."""
    import dataclasses

    from cbjax.experimental import LengthDist, profile, synthetic

    llm = LLM(model, **dataclasses.asdict(args))
    llm.warmup()
    work = synthetic(FLAGS.calibration_requests, prompt_len=LengthDist("uniform", low=16, high=FLAGS.max_seq_len // 2),
                     output_len=LengthDist("uniform", low=1, high=FLAGS.output_cap), vocab_size=model.config.vocab_size,
                     seed=FLAGS.seed + 1)
    rounds = profile.profile_rounds(llm, [(w.prompt, w.sampling) for w in work])
    info = {"host_copy_bytes_per_s": profile.measure_host_copy(llm), "rounds": len(rounds)}
    cost = profile.calibrate(rounds, info)
    print(f"calibrated on {len(rounds)} rounds (median error {cost.info['fit']['median_abs_rel_error']:.1%}); "
          f"host copies {info['host_copy_bytes_per_s'] / 1e9:.2f} GB/s")
    del llm
    common.release_programs()
    return cost, cost.describe()


def run_row(model, workload, args: EngineArgs, simulate: str | None, label: str) -> dict:
    import dataclasses

    from cbjax.experimental import profile

    llm = LLM(model, simulate=simulate, **dataclasses.asdict(args))
    llm.warmup()
    rounds = []
    if simulate:
        result = common.measure_replay(llm, workload, desc=label)
    else:  # shadowed (no decode call runs ahead), its rounds recorded for a calibration
        with profile.recorded_rounds(llm) as rounds:
            result = common.measure_replay(llm, workload, desc=label)
        result["host_copy"] = profile.measure_host_copy(llm)
    stats, load = llm.stats, llm.load()
    result.update(prefill_tokens=stats.prefill_tokens, prompt_tokens=sum(len(w.prompt) for w in workload),
                  device_hit_rate=load.prefix_hit_rate, host_hit_rate=load.prefix_host_hit_rate,
                  device_hits=load.prefix_hits, host_hits=load.prefix_host_hits, num_preemptions=load.num_preemptions)
    snapshot = llm.snapshot()
    if snapshot.host is not None:
        result["host"] = dataclasses.asdict(snapshot.host)
    if simulate:
        result["host_link_s"] = snapshot.host_link_s
    for key in ("e2el_s", "scheduling_delay_s"):
        result.pop(key, None)
    del llm
    common.release_programs()
    return result, rounds


def main(argv):
    del argv
    from cbjax.experimental import PagedCache

    model = common.load_model(FLAGS.model, FLAGS.dtype, with_tokenizer=FLAGS.workload == "sharegpt_multi_turn")
    workload = make_workload(model)
    reuse = page_reuse(workload, FLAGS.page_size)
    page_bytes = PagedCache.bytes_per_page(model.config, FLAGS.page_size, FLAGS.dtype)
    longest = max(len(w.prompt) + w.sampling.max_tokens for w in workload)
    floor = -(-longest // FLAGS.page_size) + FLAGS.num_slots  # the longest request and a page per other slot
    num_pages = max(math.ceil(FLAGS.device_fraction * reuse["working_set_pages"]), floor)
    host_bytes = max(int(FLAGS.host_fraction * reuse["working_set_pages"] * page_bytes), page_bytes)
    setup = {**reuse, "device_pages": num_pages, "device_fraction": num_pages / reuse["working_set_pages"],
             "page_bytes": page_bytes, "host_bytes": host_bytes, "requests": len(workload),
             "prompt_tokens": sum(len(w.prompt) for w in workload)}
    print(f"{len(workload)} requests, {setup['prompt_tokens']} prompt tokens; working set {reuse['working_set_pages']} "
          f"pages of {FLAGS.page_size}; an unbounded prefix cache skips {reuse['reusable_pages']} of "
          f"{reuse['prompt_pages']} full prompt pages ({reuse['reusable_pages'] / max(reuse['prompt_pages'], 1):.0%}); "
          f"device {num_pages} pages ({setup['device_fraction']:.2f} of the working set), host "
          f"{host_bytes / 2**20:.0f} MiB")
    cost = FLAGS.calibration
    if cost == "profile":
        cost, setup["calibration"] = profiled_cost(model, row_args("device", num_pages, host_bytes))
    results = {}
    for row in FLAGS.rows:
        if FLAGS.measure:
            results[f"{row}, measured"], rounds = run_row(model, workload, row_args(row, num_pages, host_bytes), None,
                                                          f"{row} (measured)")
            if cost == "replay":
                cost = CalibratedCost.fit(rounds, {"calibrated_on": f"{row}, measured", "rounds": len(rounds),
                                                   "host_copy_bytes_per_s": results[f"{row}, measured"]["host_copy"]})
                setup["calibration"] = cost.describe()
                print(f"calibrated on the {len(rounds)} rounds of {row} (median error "
                      f"{cost.info['fit']['median_abs_rel_error']:.1%}); host copies "
                      f"{cost.info['host_copy_bytes_per_s'] / 1e9:.2f} GB/s")
    if cost == "replay":
        raise app.UsageError("--calibration=replay needs --measure")
    for row in FLAGS.rows if cost else ():
        results[f"{row}, simulated"], _ = run_row(model, workload, row_args(row, num_pages, host_bytes), cost,
                                                  f"{row} (simulated)")
    table = summarize(results, setup)
    common.write_json({"flags": common.script_flags(), "setup": setup, "results": results, "table": table},
                      os.path.join(FLAGS.output_dir, f"multi_turn_{FLAGS.workload}.json"))
    plot(results, os.path.join(FLAGS.output_dir, f"multi_turn_{FLAGS.workload}.png"))


def summarize(results: dict, setup: dict) -> list[dict]:
    """Print the table: per row TTFT median / p99, prefill tokens, hit rates per tier, and the
    TTFT and prefill changes of each row against device-only prefix caching, measured and
    simulated side by side."""
    header = (f"{'row':<26}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'prefill tok':>12}{'vs device':>10}"
              f"{'device hit':>11}{'host hit':>9}{'p50 vs dev':>11}{'re-prefill':>11}")
    print(header)
    reusable_tokens = setup["reusable_pages"] * FLAGS.page_size
    rows = []
    for label, r in results.items():
        base = results.get(label.replace(label.split(",")[0], "device"))
        vs = r["prefill_tokens"] / base["prefill_tokens"] if base else float("nan")
        ttft = r["median_ttft_ms"] / base["median_ttft_ms"] if base else float("nan")
        hit_tokens = (r["device_hits"] + r["host_hits"]) * FLAGS.page_size
        again = max(reusable_tokens - hit_tokens, 0.0)  # prefixes computed before and prefilled again
        rows.append({"row": label, "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
                     "prefill_tokens": r["prefill_tokens"], "prefill_vs_device": vs, "ttft_vs_device": ttft,
                     "device_hit_rate": r["device_hit_rate"], "host_hit_rate": r["host_hit_rate"],
                     "re_prefilled_tokens": again})
        print(f"{label:<26}{r['median_ttft_ms']:>12.1f}{r['p99_ttft_ms']:>12.1f}{r['prefill_tokens']:>12d}"
              f"{vs:>9.2f}x{r['device_hit_rate']:>11.1%}{r['host_hit_rate']:>9.1%}{ttft:>10.2f}x{again:>11.0f}")
    for row in ("device+host", "none"):
        measured, simulated = results.get(f"{row}, measured"), results.get(f"{row}, simulated")
        base_m, base_s = results.get("device, measured"), results.get("device, simulated")
        if measured and simulated and base_m and base_s:
            m = measured["median_ttft_ms"] / base_m["median_ttft_ms"]
            s = simulated["median_ttft_ms"] / base_s["median_ttft_ms"]
            print(f"{row}: median TTFT vs device-only measured {m:.3f}x, simulated {s:.3f}x "
                  f"(predicted / measured {s / m:.3f})")
    return rows


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = list(results)
    axes[0].bar(labels, [results[k]["prefill_tokens"] for k in labels])
    axes[0].set_ylabel("prompt tokens prefilled")
    axes[1].bar(labels, [results[k]["median_ttft_ms"] for k in labels], label="median")
    axes[1].plot(labels, [results[k]["p99_ttft_ms"] for k in labels], "o", color="k", label="p99")
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{FLAGS.workload}: device KV at {FLAGS.device_fraction:g} of the working set")
    common.savefig(fig, path)


if __name__ == "__main__":
    common.quiet_libraries()
    app.run(main)
