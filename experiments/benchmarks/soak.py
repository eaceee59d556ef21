"""Soak: many requests through one online instance; memory must stay flat and nothing may
compile after warm-up.

Requests arrive in waves through `add_request` / `step` with random prompt lengths
(half of them behind a shared system prompt, for the prefix cache), random sampling,
some aborted mid-flight and some malformed (refused at the door). Every
`--report_every` requests it records the process's resident memory; at the end it
prints the RSS growth after the first report, the compilations after warm-up, and
writes JSON and a plot of RSS against requests served. Not part of the test suite.

    python -m experiments soak                               # 10,000 requests, paged + prefix cache
    python -m experiments soak --kv_cache=slots --max_prefill_tokens=32
    python -m experiments soak --merge_mode=chunked --max_num_batched_tokens=64
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import common
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny-llama", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_integer("num_requests", 10_000, "Requests to serve.", lower_bound=1)
EngineArgs.define_flags(["num_slots", "max_seq_len", "kv_cache", "num_pages", "max_prefill_tokens",
                         "decode_steps", "merge_mode", "max_num_batched_tokens"],
                        num_slots=16, max_seq_len=128, kv_cache="paged", num_pages=96, decode_steps=2)
flags.DEFINE_bool("prefix_caching", True, "Paged cache: share prefix pages.")
flags.DEFINE_integer("max_tokens", 24, "Largest output budget (budgets are uniform in [1, this]).", lower_bound=1)
flags.DEFINE_integer("report_every", 1000, "Requests between memory readings.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Workload seed.", lower_bound=0)
flags.DEFINE_string("output_dir", "results/soak", "Where the JSON and the plot go.")


def rss_mb() -> float:
    """Resident memory of this process now (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def plot(readings: list[tuple[int, float]], title: str, path: str) -> None:
    """RSS against requests served, from zero so that flat looks flat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot([r for r, _ in readings], [m for _, m in readings], marker="o")
    ax.set_ylim(0, 1.2 * max(m for _, m in readings))
    ax.set_xlabel("requests served")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title(f"RSS over a soak: {title}")
    ax.grid(alpha=0.3)
    common.savefig(fig, path)


def main(argv):
    del argv
    import gc

    import numpy as np
    from tqdm.auto import tqdm

    from cbjax import LLM, SamplingParams
    from cbjax.experimental import Engine, write_json

    start = time.perf_counter()
    llm = LLM(FLAGS.model, num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len, kv_cache=FLAGS.kv_cache,
              page_size=16, num_pages=FLAGS.num_pages if FLAGS.kv_cache == "paged" else None,
              enable_prefix_caching=FLAGS.prefix_caching and FLAGS.kv_cache == "paged",
              max_prefill_tokens=FLAGS.max_prefill_tokens, seed=FLAGS.seed, merge_mode=FLAGS.merge_mode,
              decode_steps=FLAGS.decode_steps if FLAGS.merge_mode == "prefill_first" else 1,
              max_num_batched_tokens=FLAGS.max_num_batched_tokens)
    print(f"warming up ({llm.warmup()} programs)")
    compiled = Engine.num_backend_compilations()
    rng = np.random.default_rng(FLAGS.seed)
    vocab = llm.model.config.vocab_size
    system = rng.integers(3, vocab, size=40).tolist()
    longest_prompt = FLAGS.max_seq_len - FLAGS.max_tokens - 1

    def request():
        n = int(rng.integers(1, longest_prompt - len(system)))
        prompt = (system if rng.random() < 0.5 else []) + rng.integers(3, vocab, size=n).tolist()
        sp = SamplingParams(max_tokens=int(rng.integers(1, FLAGS.max_tokens + 1)),
                            temperature=float(rng.choice([0.0, 0.8])), top_p=float(rng.choice([1.0, 0.9])),
                            seed=int(rng.integers(0, 2 ** 31 - 1)))
        return prompt, sp

    served = submitted = refused = aborted = 0
    readings: list[tuple[int, float]] = []
    next_report = FLAGS.report_every
    with tqdm(total=FLAGS.num_requests, desc=f"soak {FLAGS.kv_cache}", unit="req") as bar:
        while served < FLAGS.num_requests:
            while submitted < FLAGS.num_requests and len(llm.requests) < 2 * FLAGS.num_slots:
                submitted += 1
                if rng.random() < 0.01:  # a malformed request: refused, nobody else harmed
                    try:
                        llm.add_request([vocab + 5], SamplingParams(max_tokens=3))
                    except ValueError:
                        refused += 1
                        served += 1
                    continue
                rid = llm.add_request(*request())
                if rng.random() < 0.02:
                    served += sum(1 for out in llm.step() if out.finished)
                    if rid in llm.requests and not llm.requests[rid].finished:
                        llm.abort(rid)
                        aborted += 1
                        served += 1
            served += sum(1 for out in llm.step() if out.finished)
            if submitted == FLAGS.num_requests and not llm.has_unfinished_requests() and served < FLAGS.num_requests:
                raise RuntimeError(f"lost requests: {served} of {FLAGS.num_requests} accounted for")
            bar.update(served - bar.n)
            if served >= next_report:
                gc.collect()
                readings.append((served, rss_mb()))
                next_report += FLAGS.report_every
    recompiled = Engine.num_backend_compilations() - compiled
    base = readings[0][1]
    growth = readings[-1][1] - base
    per_1000 = growth / max((readings[-1][0] - readings[0][0]) / 1000, 1e-9)
    print(f"\nserved {served} requests ({refused} refused, {aborted} aborted) in {time.perf_counter() - start:.0f}s; "
          f"live requests held: {len(llm.requests)}")
    print(f"RSS {base:.1f} MB after {readings[0][0]} requests, {readings[-1][1]:.1f} MB after {readings[-1][0]}: "
          f"{growth:+.1f} MB ({per_1000:+.3f} MB per 1,000 requests)")
    print(f"compilations after warm-up: {recompiled}")
    load = llm.load()
    if load.num_pages:
        print(f"prefix hit rate {load.prefix_hit_rate:.2f}, preemptions {load.num_preemptions}")

    os.makedirs(FLAGS.output_dir, exist_ok=True)
    plot(readings, f"{FLAGS.model}, {FLAGS.kv_cache} cache, {FLAGS.merge_mode}",
         os.path.join(FLAGS.output_dir, "soak_rss.png"))
    write_json(os.path.join(FLAGS.output_dir, "soak.json"),
               {"flags": common.script_flags(), "rss_mb": readings, "rss_growth_mb": growth,
                "rss_mb_per_1000_requests": per_1000, "compilations_after_warmup": recompiled,
                "refused": refused, "aborted": aborted, "wall_s": time.perf_counter() - start})
    print(f"wrote {FLAGS.output_dir}/soak.json and soak_rss.png")


if __name__ == "__main__":
    app.run(main)
