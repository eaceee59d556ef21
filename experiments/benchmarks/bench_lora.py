"""A decode step's cost with LoRA adapters in the batch, against the same rows without.

`--rows` sequences decode; each cell runs them on its own engine, every engine built and
warmed before any is timed, then timed in turn over `--rounds` rounds (the median kept), so
the ratios compare runs side by side on the same machine state:

- base: an engine without LoRA (enable_lora off);
- pool, no adapter: enable_lora, every row on the base model (what the pool's gather costs alone);
- 1 adapter: every row on one adapter;
- N distinct: each row its own adapter (`--rows` adapters, one device slot each);
- N distinct, all seven: the same on q/k/v/o and gate/up/down (adapters' bytes past the base's).

Random rank-`--rank` adapters in PEFT's format are written at the start (no download). Prints
ms per step, tokens/s, the adapters' bytes each step reads and the ratio to the base; writes JSON.

    python -m experiments bench_lora                      # SmolLM2-135M f32, 32 rows, rank 16, q_proj,v_proj
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from absl import flags
from tqdm import tqdm

from experiments.lib import common
from cbjax import LLM, SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_integer("rows", 32, "Sequences decoding (and distinct adapters in the N-distinct cells).", lower_bound=1)
flags.DEFINE_integer("rank", 16, "The adapters' rank (the pool's max_lora_rank).", lower_bound=1)
flags.DEFINE_list("targets", ["q_proj", "v_proj"], "The adapters' target modules (PEFT names).")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per sequence.", lower_bound=1)
flags.DEFINE_integer("steps", 32, "Timed decode steps per measurement.", lower_bound=1)
flags.DEFINE_integer("rounds", 5, "Measurements per cell, the cells in turn; the median is kept.", lower_bound=1)
flags.DEFINE_integer("max_seq_len", 256, "Tokens per sequence the cache holds.", lower_bound=2)
flags.DEFINE_string("output_json", "results/bench_lora.json", "Where the results go.")

ALL_SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cells(model_config, root: str) -> dict:
    """name -> (LLM options, the rows' adapter names, modules); the adapters written under `root`."""
    from cbjax.experimental import write_random_adapter

    rows, rank = FLAGS.rows, FLAGS.rank
    narrow = [write_random_adapter(os.path.join(root, f"n{i}"), model_config, rank, FLAGS.targets, seed=i)
              for i in range(rows)]
    wide = [write_random_adapter(os.path.join(root, f"w{i}"), model_config, rank, ALL_SEVEN, seed=100 + i)
            for i in range(rows)]
    lora = dict(enable_lora=True, max_loras=rows, max_lora_rank=rank, max_cpu_loras=rows)
    return {
        "base": (dict(), [None] * rows, (), []),
        "pool, no adapter": (dict(lora, lora_target_modules=",".join(FLAGS.targets)), [None] * rows,
                             FLAGS.targets, []),
        "1 adapter": (dict(lora, lora_target_modules=",".join(FLAGS.targets)), ["n0"] * rows, FLAGS.targets,
                      narrow[:1]),
        f"{rows} distinct": (dict(lora, lora_target_modules=",".join(FLAGS.targets)),
                             [f"n{i}" for i in range(rows)], FLAGS.targets, narrow),
        f"{rows} distinct, all seven": (dict(lora, lora_target_modules=",".join(ALL_SEVEN)),
                                        [f"w{i}" for i in range(rows)], ALL_SEVEN, wide),
    }


def time_steps(llm, names, rng, vocab: int) -> float:
    """Seconds per decode step of `--steps` steps with one sequence per name decoding."""
    for name in names:
        llm.add_request(rng.integers(3, vocab, size=FLAGS.prompt_len).tolist(),
                        SamplingParams(max_tokens=FLAGS.steps + 8, ignore_eos=True), lora=name)
    for _ in range(4):  # the prefills, then decodes until every row decodes
        llm.step()
    t0 = time.perf_counter()
    for _ in range(FLAGS.steps):
        llm.step()
    seconds = (time.perf_counter() - t0) / FLAGS.steps
    llm.run_until_done()
    return seconds


def main(argv):
    del argv
    import numpy as np

    from cbjax.experimental import adapter_bytes, load_model, write_json

    model = load_model(FLAGS.model, with_tokenizer=False)
    config = model.config
    root = tempfile.mkdtemp(prefix="cbjax-bench-lora-")
    plan = cells(config, root)
    engines = {}
    for name, (options, names, _, paths) in tqdm(list(plan.items()), desc="build + warm up"):
        llm = LLM(model, num_slots=FLAGS.rows, max_seq_len=FLAGS.max_seq_len, decode_steps=1, overlap=False,
                  **options)
        for path in paths:
            llm.load_lora(os.path.basename(path), path)
        llm.warmup()
        engines[name] = llm
    rng = np.random.default_rng(0)
    times = {name: [] for name in plan}
    for _ in tqdm(range(FLAGS.rounds), desc="rounds"):
        for name, llm in engines.items():
            times[name].append(time_steps(llm, plan[name][1], rng, config.vocab_size))
    base = statistics.median(times["base"])
    lines = [f"{'cell':<28}{'ms/step':>9}{'tok/s':>9}{'adapter MB':>12}{'vs base':>9}"]
    results = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        _, names, modules, _ = plan[name]
        distinct = len({n for n in names if n is not None})
        mb = distinct * adapter_bytes(config, FLAGS.rank, modules) / 1e6  # float32
        results[name] = dict(ms=1000 * median, samples_ms=[1000 * s for s in samples], adapter_mb=mb,
                             ratio=median / base, tok_s=FLAGS.rows / median)
        lines.append(f"{name:<28}{1000 * median:>9.2f}{FLAGS.rows / median:>9.0f}{mb:>12.1f}{median / base:>8.2f}x")
    table = "\n".join(lines)
    print(f"\n{FLAGS.model}, {FLAGS.rows} decode rows, rank {FLAGS.rank} on {','.join(FLAGS.targets)} "
          f"(median of {FLAGS.rounds})\n{table}")
    os.makedirs(os.path.dirname(FLAGS.output_json) or ".", exist_ok=True)
    write_json(FLAGS.output_json, {"flags": common.script_flags(), "cells": results, "table": table})
    print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
    from absl import app

    app.run(main)
