"""Pipeline bubbles: how much of the time each stage's device sits idle, against the
number of decode micro-batches, the round length (decode steps per host sync) and the
batch policy (source note 004: keep the pipeline full with a dynamic batch).

Each configuration runs the real engine with its layers split over `--stages` host
devices (cbjax/pipeline.py) through the real scheduler; the engine logs every stage
call in dispatch order. The log is then replayed against a roofline cost per call for
`--cost_shape` on `--accelerator` (each stage holding its share of the layers) to get
each device's busy time and the bubble fraction, 1 - busy / (stages x makespan). On a
CPU the host devices share the cores, so the wall clock cannot show the overlap; the
replay shows what the schedule would do on the accelerator. Writes JSON and a PNG.

    python -m experiments pipeline_bubbles                      # tiny-llama, 2 stages, H100 pricing
    python -m experiments pipeline_bubbles --stages=4 --model=smollm2-135m-random --micro_batches=1,2,4,8
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from experiments.lib import common
from cbjax.experimental import ACCELERATORS, MODEL_SHAPES
from cbjax import EngineArgs

FLAGS = flags.FLAGS
common.define_workload_flags(prompt_low=16, prompt_high=64, output_mean=48.0, output_cap=96, num_requests=32)
flags.DEFINE_string("model", "tiny-llama", "Model to run (preset, Hugging Face directory, .gguf or orbax).")
flags.DEFINE_integer("stages", 2, "Pipeline stages (devices); at most the model's layer count.", lower_bound=2)
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8"], "Decode micro-batch counts (each must divide --num_slots).")
flags.DEFINE_list("decode_steps", ["1", "4"], "Decode steps per round (per host sync).")
flags.DEFINE_list("policies", ["static", "continuous"], "Batching policies.")
EngineArgs.define_flags(["num_slots", "max_seq_len"], max_seq_len=256)
flags.DEFINE_integer("slots_per_micro_batch", None, "Instead of a fixed --num_slots, give every micro-batch this "
                     "many slots (num_slots = micro_batches x this, as vLLM's pipeline keeps one full batch per "
                     "stage in flight): decode is weight-bound, so splitting a fixed batch re-reads the weights "
                     "per micro-batch.", lower_bound=1)
flags.DEFINE_string("accelerator", "h100", "Accelerator whose roofline prices each stage call "
                    "(h100, h200, a100-40gb, a100-80gb, tpu-v5e).")
flags.DEFINE_string("cost_shape", "llama3-8b", "Model shape the calls are priced for (opt-13b, llama2-13b, "
                    "llama3-8b, llama3.2-1b), split over --stages like the run.")
flags.DEFINE_integer("host_devices", 8, "CPU only: host devices to expose (XLA_FLAGS), at least --stages.",
                     lower_bound=1)
flags.DEFINE_string("output_dir", "results/pipeline_bubbles", "Where the JSON and the plot go.")
common.validate_list("micro_batches", int, 1, "positive integers")
common.validate_list("decode_steps", int, 1, "positive integers")
common.validate_list("policies", lambda p: 0 if p in ("static", "dynamic", "continuous") else -1, 0,
                     "policies among static, dynamic, continuous")
flags.register_validator("accelerator", lambda a: a.lower() in ACCELERATORS,
                         message="--accelerator must be one of " + ", ".join(ACCELERATORS))
flags.register_validator("cost_shape", lambda s: s in MODEL_SHAPES,
                         message="--cost_shape must be one of " + ", ".join(MODEL_SHAPES))
flags.register_multi_flags_validator(["micro_batches", "num_slots", "slots_per_micro_batch"],
                                     lambda v: v["slots_per_micro_batch"] is not None
                                     or all(v["num_slots"] % int(m) == 0 for m in v["micro_batches"]),
                                     message="every --micro_batches value must divide --num_slots")


def stage_pricer(stages: int):
    """Seconds of one stage call on the accelerator, for the cost shape's share of layers."""
    import dataclasses

    from cbjax.experimental import Call, RooflineCost

    shape = MODEL_SHAPES[FLAGS.cost_shape]
    stage_shape = dataclasses.replace(shape, num_layers=-(-shape.num_layers // stages))
    cost = RooflineCost(ACCELERATORS[FLAGS.accelerator.lower()], stage_shape, dtype_bytes=2)

    def seconds(c) -> float:
        return cost.seconds(Call(c.kind, tokens=c.rows * c.tokens, attended=c.rows * c.tokens * c.kv_len,
                                 kv_read=c.rows * c.kv_len, rows=c.rows))

    return seconds


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (policy, steps) in sorted({(r["policy"], r["decode_steps"]) for r in runs}):
        mine = sorted((r for r in runs if (r["policy"], r["decode_steps"]) == (policy, steps)),
                      key=lambda r: r["micro_batches"])
        ax.plot([r["micro_batches"] for r in mine], [100 * r["bubble_fraction"] for r in mine], marker="o",
                label=f"{policy}, {steps} decode step(s)/round")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode micro-batches")
    ax.set_ylabel("bubble (% of stage-time idle)")
    ax.set_title(f"{FLAGS.stages} pipeline stages, {FLAGS.cost_shape} on {FLAGS.accelerator} (replayed schedule)")
    ax.grid(alpha=0.3)
    ax.legend()
    common.savefig(fig, path)


def main(argv):
    del argv
    from cbjax.experimental import expose_host_devices

    expose_host_devices(FLAGS.host_devices)

    from cbjax import LLM
    from cbjax.experimental import bubble_fraction, load_model

    model = load_model(FLAGS.model)
    if model.config.num_layers < FLAGS.stages:
        raise app.UsageError(f"{FLAGS.model} has {model.config.num_layers} layers, fewer than --stages")
    work = [w.as_tuple() for w in common.make_workload(model, "all_at_once")]
    prompts, params = [p for _, p, _ in work], [s for _, _, s in work]
    price = stage_pricer(FLAGS.stages)
    runs = []
    for policy in FLAGS.policies:
        for steps in map(int, FLAGS.decode_steps):
            for micro in map(int, FLAGS.micro_batches):
                slots = FLAGS.num_slots if FLAGS.slots_per_micro_batch is None else micro * FLAGS.slots_per_micro_batch
                llm = LLM(model, pipeline_stages=FLAGS.stages, micro_batches=micro, decode_steps=steps,
                          policy=policy, num_slots=slots, max_seq_len=FLAGS.max_seq_len)
                llm.generate(prompts, params, use_tqdm=False)  # compiles
                compiled = len(llm.snapshot().call_log)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, desc=f"{policy} steps={steps} micro={micro}")
                wall = time.perf_counter() - t0
                call_log = llm.snapshot().call_log[compiled:]  # the timed run's rounds
                replay = bubble_fraction(call_log, price, FLAGS.stages)
                tokens = sum(len(o.token_ids) for o in outs)
                decode_calls = sum(c.kind == "decode" for r in call_log for c in r)
                runs.append({"policy": policy, "decode_steps": steps, "micro_batches": micro, "num_slots": slots,
                             "rounds": len(call_log), "stage_calls": decode_calls,
                             "bubble_fraction": replay["bubble_fraction"], "replayed_s": replay["makespan_s"],
                             "replayed_tok_s": tokens / replay["makespan_s"], "cpu_wall_s": wall,
                             "output_tokens": tokens})
    head = (f"{'policy':<11} {'steps':>5} {'micro':>5} {'slots':>5} {'rounds':>6} {'bubble %':>8} "
            f"{'replayed tok/s':>14} {'cpu wall s':>10}")
    print(f"\n{FLAGS.stages} stages of {FLAGS.model}; calls priced for {FLAGS.cost_shape} on {FLAGS.accelerator}")
    print(head)
    for r in runs:
        print(f"{r['policy']:<11} {r['decode_steps']:>5} {r['micro_batches']:>5} {r['num_slots']:>5} {r['rounds']:>6} "
              f"{100 * r['bubble_fraction']:>8.1f} {r['replayed_tok_s']:>14.0f} {r['cpu_wall_s']:>10.2f}")
    for policy in FLAGS.policies:
        for steps in map(int, FLAGS.decode_steps):
            mine = {r["micro_batches"]: r for r in runs if (r["policy"], r["decode_steps"]) == (policy, steps)}
            lo, hi = min(mine), max(mine)
            print(f"{policy}, {steps} step(s)/round: {hi} micro-batches vs {lo}: replayed throughput "
                  f"{mine[hi]['replayed_tok_s'] / mine[lo]['replayed_tok_s']:.2f}x, bubble "
                  f"{100 * mine[lo]['bubble_fraction']:.0f}% -> {100 * mine[hi]['bubble_fraction']:.0f}%")
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    with open(os.path.join(FLAGS.output_dir, "pipeline_bubbles.json"), "w") as f:
        json.dump({"flags": common.script_flags(), "runs": runs}, f, indent=1)
    plot(runs, os.path.join(FLAGS.output_dir, "pipeline_bubbles.png"))


if __name__ == "__main__":
    app.run(main)
