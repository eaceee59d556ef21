"""Shared helpers of the experiment scripts: flag capture, workload flags, replay runs, plots."""

from __future__ import annotations

import sys
import time

from absl import flags

FLAGS = flags.FLAGS


def define_workload_flags(prompt_low=16, prompt_high=64, output_mean=64.0, output_cap=128, num_requests=40):
    flags.DEFINE_integer("num_requests", num_requests, "Requests per run.")
    flags.DEFINE_integer("prompt_low", prompt_low, "Shortest prompt (uniform lengths).")
    flags.DEFINE_integer("prompt_high", prompt_high, "Longest prompt (uniform lengths).")
    flags.DEFINE_float("output_mean", output_mean, "Mean of the capped-exponential output budget.")
    flags.DEFINE_integer("output_cap", output_cap, "Cap of the output budget (the max generation length).")
    flags.DEFINE_float("burstiness", 1.0, "Gamma shape of the arrival gaps; 1 is Poisson.")
    flags.DEFINE_enum("workload", "synthetic", ["synthetic", "chat"],
                      "'synthetic': random-token prompts, EOS ignored; 'chat': real opening turns from the "
                      "chitchat-dataset package (pip install 'cbjax[chat]'), chat-templated, generating until "
                      "EOS or --output_cap.")
    flags.DEFINE_integer("seed", 0, "Workload seed.")


def make_workload(model, arrival: str, qps: float = 1.0):
    from cbjax.workload import LengthDist, chat, synthetic

    kind = arrival
    if arrival != "all_at_once":
        kind = "poisson" if FLAGS.burstiness == 1.0 else "gamma"
    if FLAGS.workload == "chat":
        if model.tokenizer is None:
            raise ValueError("the chat workload needs a model with a tokenizer")
        return chat(FLAGS.num_requests, model.tokenizer, max_tokens=FLAGS.output_cap, seed=FLAGS.seed,
                    arrival=kind, qps=qps, burstiness=FLAGS.burstiness)
    vocab_size = model.config.vocab_size
    return synthetic(FLAGS.num_requests, prompt_len=LengthDist("uniform", low=FLAGS.prompt_low, high=FLAGS.prompt_high),
                     output_len=LengthDist("capped_exponential", mean=FLAGS.output_mean, cap=FLAGS.output_cap),
                     vocab_size=vocab_size, seed=FLAGS.seed, arrival=kind, qps=qps, burstiness=FLAGS.burstiness)


def script_flags() -> dict:
    """The values of the flags the running script defined (for the JSON record)."""
    names = {f.name for f in FLAGS.get_key_flags_for_module(sys.argv[0])}
    names |= {f.name for f in FLAGS.get_key_flags_for_module(__name__)}
    return {n: FLAGS[n].value for n in sorted(names)}


def run_replay(llm, workload, slo=None) -> dict:
    """Replay a workload on the wall clock through a warmed-up engine; serving metrics."""
    from cbjax.metrics import summarize_outputs

    llm.engine.warmup(max_prompt_len=max(len(w.prompt) for w in workload))
    t0 = time.perf_counter()
    outs = llm.replay([w.as_tuple() for w in workload], use_tqdm=True)
    wall = time.perf_counter() - t0
    metrics = summarize_outputs(outs, slo=slo)
    metrics["wall_s"] = wall
    metrics["mean_running"] = llm.stats.mean_running
    metrics["e2el_s"] = sorted(o.metrics.e2e_latency for o in outs if o.metrics.e2e_latency is not None)
    return metrics


def savefig(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
