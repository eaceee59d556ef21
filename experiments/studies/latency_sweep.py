"""Latency under Poisson arrivals: each policy replayed on the wall clock at several QPS.

Prints TTFT / TPOT / E2E percentiles and goodput per (policy, QPS), writes JSON and
a plot of the end-to-end latency CDF per policy for each QPS.

    python -m experiments latency_sweep
    python -m experiments latency_sweep --qps=2,8 --ttft_ms=500 --tpot_ms=100
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import common
from cbjax.experimental import engine_args
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_list("qps", ["2", "6"], "Request rates (requests per second).")
flags.DEFINE_list("concurrency", [], "Closed-loop clients: also run each policy with this many requests in flight, "
                  "the next sent as one finishes (AIPerf, vllm bench serve --max-concurrency); rows policy@cN.")
flags.DEFINE_list("policies", ["static", "dynamic", "continuous"], "Policies to compare.")
EngineArgs.define_flags(["num_slots", "max_seq_len", "window_ms", "dtype", "kv_cache_bytes", "page_size",
                         "enable_prefix_caching"],
                        max_seq_len=256, window_ms=100.0)
flags.DEFINE_float("ttft_ms", None, "SLO on time to first token, for goodput.", lower_bound=0.0)
flags.DEFINE_float("tpot_ms", None, "SLO on time per output token, for goodput.", lower_bound=0.0)
flags.DEFINE_float("e2e_ms", None, "SLO on end-to-end latency, for goodput.", lower_bound=0.0)
flags.DEFINE_string("output_dir", "results/latency_sweep", "Where the JSON and the plot go.")
common.define_simulate_flag()
common.define_workload_flags(num_requests=32, output_mean=32.0, output_cap=96)
flags.adopt_module_key_flags(common)
common.validate_list("qps", float, 1e-6, "positive request rates")
common.validate_list("concurrency", int, 1, "positive numbers of requests in flight", allow_empty=True)
# continuous-sjf: shortest max_tokens first, the true length where each request generates
# exactly its budget (oracle SJF); continuous-sjf-predicted: shortest predicted length first
# (--length_predictor; under --simulate, its recorded predictions of the --trace prompts).
POLICIES = ("static", "dynamic", "continuous", "continuous-paged", "continuous-sjf", "continuous-sjf-predicted")
common.validate_list("policies", lambda p: 0 if p in POLICIES else -1, 0, "policies among " + ", ".join(POLICIES))
EngineArgs.define_flags(["length_predictor"])
flags.adopt_module_key_flags(engine_args)  # the EngineArgs knobs, in --help
flags.register_multi_flags_validator(
    ["policies", "length_predictor", "simulate"],
    lambda v: "continuous-sjf-predicted" not in v["policies"] or v["length_predictor"] or v["simulate"],
    message="continuous-sjf-predicted needs --length_predictor (or --simulate, which replays the --trace's "
            "recorded predictions)")
flags.DEFINE_enum("paged_attention", "reference", ["reference", "pallas"],
                  "Attention of the paged row (pallas: the Pallas kernels, GPU; under --simulate, reads live "
                  "pages only).")

KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "median_e2el_ms",
        "p99_e2el_ms", "output_throughput")


def layout_options(model, policy: str, mean_len: float) -> dict:
    """The slot cache sized by --num_slots or --kv_cache_bytes; the paged row gets the same
    memory, with as many sequences as fit at the workload's mean length (prompt + output),
    and prefix caching if asked."""
    from cbjax.experimental import SlotCache

    per_token = SlotCache.bytes_per_slot(model.config, 1, FLAGS.dtype)
    budget = FLAGS.kv_cache_bytes or FLAGS.num_slots * FLAGS.max_seq_len * per_token
    if policy.startswith("continuous-sjf"):
        predicted = policy == "continuous-sjf-predicted" and not FLAGS.simulate
        return dict(policy="continuous", ordering="sjf", num_slots=max(1, budget // (FLAGS.max_seq_len * per_token)),
                    **({"length_predictor": FLAGS.length_predictor} if predicted else {}))
    if policy != "continuous-paged":
        return dict(policy=policy, num_slots=max(1, budget // (FLAGS.max_seq_len * per_token)))
    return dict(policy="continuous", kv_cache="paged", kv_cache_bytes=int(budget), page_size=FLAGS.page_size,
                num_slots=max(1, int(budget // per_token // mean_len)), attention=FLAGS.paged_attention,
                enable_prefix_caching=FLAGS.enable_prefix_caching)


def main(argv):
    del argv
    from cbjax import LLM
    from cbjax.experimental import SLO, write_json

    start = time.perf_counter()
    model = common.load_model(FLAGS.model, FLAGS.dtype, with_tokenizer=common.wants_tokenizer())
    slo = SLO(ttft_ms=FLAGS.ttft_ms, tpot_ms=FLAGS.tpot_ms, e2el_ms=FLAGS.e2e_ms)
    results = {}
    qps_list = [float(q) for q in FLAGS.qps]
    loads = [(f"{q:g}", dict(qps=q), None) for q in qps_list]
    loads += [(f"c{c}", dict(concurrency=int(c)), int(c)) for c in FLAGS.concurrency]
    for label, load, concurrency in loads:
        workload = common.make_workload(model, "poisson", load.get("qps", 1.0))
        if FLAGS.workload == "synthetic":
            mean_len = (FLAGS.prompt_low + FLAGS.prompt_high) / 2 + FLAGS.output_mean
        else:
            mean_len = common.mean_sequence_len(workload)
        for policy in FLAGS.policies:
            llm = LLM(model, max_seq_len=FLAGS.max_seq_len, window_ms=FLAGS.window_ms, dtype=FLAGS.dtype,
                      **layout_options(model, policy, mean_len), **common.llm_options())
            if policy == "continuous-sjf-predicted" and FLAGS.simulate:
                llm.use_length_predictor(common.predicted_lengths(FLAGS.trace))
            results[f"{policy}@{label}"] = {"policy": policy, **load, **common.run_replay(
                llm, workload, slo, desc=f"{policy}@{label}", concurrency=concurrency)}

    width = max(18, max(len(name) for name in results) + 2)
    header = f"{'policy @ qps':<{width}}" + "".join(f"{k:>16}" for k in KEYS) + f"{'goodput req/s':>15}"
    lines = [header, "-" * len(header)]
    for name, m in results.items():
        lines.append(f"{name:<{width}}" + "".join(f"{m[k]:>16.1f}" for k in KEYS) + f"{m['request_goodput']:>15.2f}"
                     + (f"   prefix hits {m['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in m else ""))
    table = "\n".join(lines)
    print("\n" + table)

    os.makedirs(FLAGS.output_dir, exist_ok=True)
    common.plot_e2e_cdfs(results, qps_list, FLAGS.policies, FLAGS.model,
                         os.path.join(FLAGS.output_dir, "latency_cdf.png"))
    write_json(os.path.join(FLAGS.output_dir, "latency_sweep.json"),
               {"flags": common.script_flags(), "results": results, "table": table,
                "wall_s": time.perf_counter() - start})
    print(f"\nwrote {FLAGS.output_dir}/latency_sweep.json and latency_cdf.png "
          f"in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
