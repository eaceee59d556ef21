"""Scale-out configurations side by side: one engine, tensor parallel, and data-parallel
replicas under each routing policy, replaying one Poisson workload of requests that
share a few system prompts (where prefix-affinity routing should keep each prompt's
cached pages on one replica).

Per configuration: throughput, median/p99 TTFT and E2E, the prefix-cache hit rate
(summed over replicas) and how many requests each replica got. Writes JSON and a PNG.
On a CPU the host devices share its cores, so the timings say little about scaling;
the routing columns (hits, balance) hold anywhere.

    python -m experiments scale_out                                  # tiny-llama on 8 host devices
    python -m experiments scale_out --model=smollm2-135m --configs=1x1,2x1:least_loaded,2x1:prefix_affinity
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import common
from cbjax import EngineArgs

FLAGS = flags.FLAGS
ROUTINGS = ("round_robin", "least_loaded", "prefix_affinity")
flags.DEFINE_string("model", "tiny-llama", "Model (preset, Hugging Face directory, .gguf or orbax).")
flags.DEFINE_list("configs", ["1x1", "1x2", "2x1:round_robin", "2x1:least_loaded", "2x1:prefix_affinity",
                              "4x1:round_robin", "4x1:prefix_affinity"],
                  "Configurations DPxTP[:routing]: data-parallel replicas x tensor-parallel devices each.")
flags.DEFINE_integer("num_requests", 64, "Requests.", lower_bound=1)
flags.DEFINE_float("qps", 20.0, "Poisson arrival rate.", lower_bound=1e-6)
flags.DEFINE_integer("num_prefixes", 4, "Distinct shared system prompts.", lower_bound=1)
flags.DEFINE_integer("prefix_len", 48, "Tokens of each shared system prompt.", lower_bound=1)
flags.DEFINE_integer("suffix_low", 8, "Shortest per-request suffix.", lower_bound=1)
flags.DEFINE_integer("suffix_high", 24, "Longest per-request suffix.", lower_bound=1)
flags.DEFINE_integer("output_len", 32, "Output tokens per request (EOS ignored).", lower_bound=1)
EngineArgs.define_flags(["num_slots", "max_seq_len", "page_size"], num_slots=4, max_seq_len=128)
flags.DEFINE_integer("host_devices", 8, "CPU only: host devices to expose (XLA_FLAGS).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("output_dir", "results/scale_out", "Where the JSON and the plot go.")


def _parse(config: str) -> tuple[int, int, str]:
    shape, _, routing = config.partition(":")
    dp, tp = (int(x) for x in shape.lower().split("x"))
    routing = routing or "round_robin"
    if dp < 1 or tp < 1 or routing not in ROUTINGS:
        raise ValueError(config)
    return dp, tp, routing


def _configs_ok(values) -> bool:
    try:
        return len(values) > 0 and all(_parse(v) for v in values)
    except ValueError:
        return False


flags.register_validator("configs", _configs_ok, message="--configs takes DPxTP[:routing] items, routing among "
                         + ", ".join(ROUTINGS))
flags.register_multi_flags_validator(
    ["prefix_len", "suffix_high", "output_len", "max_seq_len", "suffix_low"],
    lambda v: v["suffix_high"] >= v["suffix_low"] and v["prefix_len"] + v["suffix_high"] + v["output_len"]
    <= v["max_seq_len"], message="prefix + longest suffix + output must fit --max_seq_len (and high >= low)")


def workload(vocab: int):
    import numpy as np

    from cbjax import SamplingParams
    from cbjax.experimental import arrival_times

    rng = np.random.default_rng(FLAGS.seed)
    prefixes = [rng.integers(3, vocab, size=FLAGS.prefix_len).tolist() for _ in range(FLAGS.num_prefixes)]
    arrivals = arrival_times("poisson", FLAGS.num_requests, rng, qps=FLAGS.qps)
    sampling = SamplingParams(max_tokens=FLAGS.output_len, ignore_eos=True)
    return [(float(t), prefixes[rng.integers(FLAGS.num_prefixes)]
             + rng.integers(3, vocab, size=int(rng.integers(FLAGS.suffix_low, FLAGS.suffix_high + 1))).tolist(),
             sampling) for t in arrivals]


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["config"] for r in rows]
    ax1.bar(names, [r["median_ttft_ms"] for r in rows])
    ax1.set_ylabel("median TTFT (ms)")
    ax2.bar(names, [100 * r["prefix_hit_rate"] for r in rows])
    ax2.set_ylabel("prefix-cache hit rate (% of full prompt pages)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{FLAGS.model}: {FLAGS.num_requests} requests at {FLAGS.qps:g} req/s, "
                 f"{FLAGS.num_prefixes} shared prompts")
    common.savefig(fig, path)


def main(argv):
    del argv
    from cbjax.experimental import expose_host_devices

    expose_host_devices(FLAGS.host_devices)
    import jax

    from cbjax import LLM
    from cbjax.experimental import load_model, summarize_outputs, write_json
    from cbjax import Replicas

    model = load_model(FLAGS.model)
    work = workload(model.config.vocab_size)
    options = dict(num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len, kv_cache="paged",
                   page_size=FLAGS.page_size, enable_prefix_caching=True)
    rows = []
    for config in FLAGS.configs:
        dp, tp, routing = _parse(config)
        if dp * tp > len(jax.devices()):
            print(f"skipping {config}: {dp * tp} devices needed, {len(jax.devices())} available")
            continue
        label = f"1x{tp}" if dp == 1 else f"{dp}x{tp} {routing}"
        if dp == 1:
            front = LLM(model, tensor_parallel=tp, devices=jax.devices()[:tp], **options)
            replicas = [front]
        else:
            front = Replicas(model, data_parallel=dp, tensor_parallel=tp, routing=routing, **options)
            replicas = front.replicas
        # Every replica compiles its own programs (they run on other devices); configurations on
        # the same devices share them.
        front.warmup()
        t0 = time.perf_counter()
        outs = front.replay(work, desc=label)
        wall = time.perf_counter() - t0
        metrics = summarize_outputs(outs)
        queries = sum(r.load().prefix_queries for r in replicas)
        row = {"config": label, "data_parallel": dp, "tensor_parallel": tp, "routing": routing if dp > 1 else None,
               "wall_s": wall, "prefix_hit_rate": sum(r.load().prefix_hits for r in replicas) / max(queries, 1),
               "routed": list(front.routed) if dp > 1 else [len(work)],
               **{k: metrics[k] for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_e2el_ms",
                                          "p99_e2el_ms") if k in metrics}}
        rows.append(row)
        if dp > 1:
            front.close()
    print(f"\n{FLAGS.model}, {FLAGS.num_requests} requests at {FLAGS.qps:g} req/s, {FLAGS.num_prefixes} shared "
          f"prompts of {FLAGS.prefix_len} tokens, {FLAGS.num_slots} slots per replica, {jax.default_backend()}")
    print(f"{'config':<24} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>9} {'E2E p99':>9} "
          f"{'hits %':>7}  routed")
    for r in rows:
        print(f"{r['config']:<24} {r['output_throughput']:>8.1f} {r['median_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>9.1f} "
              f"{r['median_e2el_ms']:>9.1f} {r['p99_e2el_ms']:>9.1f} {100 * r['prefix_hit_rate']:>7.1f}  {r['routed']}")
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['config']} vs {base['config']}: throughput {r['output_throughput'] / base['output_throughput']:.2f}x, "
              f"median TTFT {r['median_ttft_ms'] / base['median_ttft_ms']:.2f}x")
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    write_json(os.path.join(FLAGS.output_dir, "scale_out.json"), {"flags": common.script_flags(), "runs": rows})
    plot(rows, os.path.join(FLAGS.output_dir, "scale_out.png"))


if __name__ == "__main__":
    app.run(main)
