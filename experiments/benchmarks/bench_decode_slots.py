"""Decode step time against the slot count: does an idle slot cost anything?

For each slot count, `--active` sequences decode and the rest of the slots are idle.
The prefill_first decode program computes every slot; the mixed step (merge_mode
chunked) computes only the active sequences' tokens. Prints the time per decode
step and the ratio of the largest slot count to the smallest, for both, measured
side by side in one run; writes JSON.

    python -m experiments bench_decode_slots                       # 2 vs 64 slots, 2 active
    python -m experiments bench_decode_slots --slots=2,16,64,256 --active=2
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments.lib import common
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-random", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_list("slots", ["2", "64"], "Slot counts to compare.")
flags.DEFINE_integer("active", 2, "Sequences decoding.", lower_bound=1)
flags.DEFINE_integer("prompt_len", 32, "Prompt length of the active sequences.", lower_bound=1)
flags.DEFINE_integer("steps", 64, "Timed decode steps per measurement.", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "Measurements per cell; the best is kept.", lower_bound=1)
EngineArgs.define_flags(["max_seq_len", "kv_cache"], max_seq_len=256)
flags.DEFINE_string("output_json", "results/bench_decode_slots.json", "Where the results go.")
common.validate_list("slots", int, 1, "positive integers")


def time_decode(model, num_slots: int, merge_mode: str) -> float:
    """Seconds per decode step with `--active` sequences running in `num_slots` slots."""
    import numpy as np

    from cbjax import LLM

    budget = {"max_num_batched_tokens": max(2 * num_slots + 8, FLAGS.prompt_len * FLAGS.active + num_slots)} \
        if merge_mode != "prefill_first" else {}
    llm = LLM(model, num_slots=num_slots, max_seq_len=FLAGS.max_seq_len, kv_cache=FLAGS.kv_cache,
              merge_mode=merge_mode, **budget)
    return common.seconds_per_decode_step(llm, model.config.vocab_size, FLAGS.active, FLAGS.prompt_len, FLAGS.steps,
                                          FLAGS.repeats, np.random.default_rng(0))


def main(argv):
    del argv
    from cbjax.experimental import load_model, write_json

    model = load_model(FLAGS.model, with_tokenizer=False)
    slot_counts = [int(s) for s in FLAGS.slots]
    if min(slot_counts) < FLAGS.active:
        raise app.UsageError(f"every slot count must hold --active={FLAGS.active} sequences")
    rows = {}
    for mode in ("prefill_first", "chunked"):
        rows[mode] = {n: time_decode(model, n, mode) for n in slot_counts}
    lo, hi = min(slot_counts), max(slot_counts)
    lines = [f"{'decode step (ms)':<18}" + "".join(f"{f'{n} slots':>12}" for n in slot_counts)
             + f"{f'{hi}/{lo} slots':>14}"]
    for mode, times in rows.items():
        lines.append(f"{mode:<18}" + "".join(f"{1000 * times[n]:>12.2f}" for n in slot_counts)
                     + f"{times[hi] / times[lo]:>13.2f}x")
    table = "\n".join(lines)
    print(f"\n{FLAGS.model}, {FLAGS.active} active sequences, {FLAGS.kv_cache} cache\n{table}")
    os.makedirs(os.path.dirname(FLAGS.output_json) or ".", exist_ok=True)
    write_json(FLAGS.output_json, {"flags": common.script_flags(), "seconds_per_step": rows, "table": table})
    print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
    app.run(main)
