"""A mixture of experts' decode step against dense models, over the batch size.

Three random-init models of one shape but their MLPs, each decoded by the engine at batch sizes
1..64 (one engine per model, merge_mode chunked so a step computes only its active rows):

- `moe`: `--experts` experts of width `--expert_width`, top `--top_k` (Mixtral's proportions by
  default: the experts hold most of the weights);
- `dense_active`: one MLP as wide as the experts a token uses (`top_k x width`): the same active
  parameters;
- `dense_all`: one MLP as wide as every expert together (`experts x width`): what computing every
  expert costs.

A MoE step reads only the experts its tokens route to, so its cost starts near `dense_active` at
one sequence and climbs towards `dense_all` as the batch touches more experts (about
E (1 - (1 - k/E)^B) of them under uniform routing). Prints ms per step, tokens per second and the
ratios measured side by side in one run; writes JSON and a plot.

    python -m experiments bench_moe
    python -m experiments bench_moe --batches=1,8,64 --hidden=256 --layers=2
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments.lib import common, moe_models

FLAGS = flags.FLAGS
flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32", "64"], "Sequences decoding together.")
moe_models.define_flags(flags)
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens of each sequence.", lower_bound=1)
flags.DEFINE_integer("steps", 16, "Timed decode steps per measurement.", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "Measurements per cell; the best is kept.", lower_bound=1)
flags.DEFINE_string("output_json", "results/bench_moe.json", "Where the results go (a PNG beside it).")
common.validate_list("batches", int, 1, "positive integers")


def plot(rows: dict, batches: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, times in rows.items():
        left.plot(batches, [1000 * times[b] for b in batches], marker="o", label=name)
        right.plot(batches, [b / times[b] for b in batches], marker="o", label=name)
    for ax, label in ((left, "ms per decode step"), (right, "tokens per second")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences decoding")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle(f"MoE ({FLAGS.experts} experts, top {FLAGS.top_k}) against dense models, "
                 f"{FLAGS.layers} layers of {FLAGS.hidden}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    from tqdm import tqdm

    from cbjax.experimental import weight_bytes, write_json

    batches = sorted(int(b) for b in FLAGS.batches)
    rows, sizes = {}, {}
    with tqdm(total=3 * len(batches), desc="bench_moe", unit="cell") as progress:
        for name, config in moe_models.configs(FLAGS):
            sizes[name] = weight_bytes(config, 4)
            rows[name] = moe_models.seconds_per_step(config, batches, FLAGS.prompt_len, FLAGS.steps, FLAGS.repeats,
                                                     progress)
    lines = [f"{'batch':>6}{'experts read':>14}" + "".join(f"{f'{n} ms':>16}" for n in rows)
             + "".join(f"{f'{n} tok/s':>20}" for n in rows) + f"{'moe/active':>12}{'all/moe':>10}"]
    for b in batches:
        t = {n: rows[n][b] for n in rows}
        lines.append(f"{b:>6}{moe_models.expected_experts(FLAGS.experts, FLAGS.top_k, b):>14.1f}" + "".join(f"{1000 * t[n]:>16.2f}" for n in rows)
                     + "".join(f"{b / t[n]:>20.0f}" for n in rows)
                     + f"{t['moe'] / t['dense_active']:>11.2f}x{t['dense_all'] / t['moe']:>9.2f}x")
    table = "\n".join(lines)
    mb = ", ".join(f"{n} {sizes[n] / 1e6:.0f} MB" for n in sizes)
    print(f"\nweights: {mb}\n{table}")
    first = batches[0]
    print(f"\nat {first} sequence(s): moe / dense_active {rows['moe'][first] / rows['dense_active'][first]:.2f}x, "
          f"dense_all / moe {rows['dense_all'][first] / rows['moe'][first]:.2f}x")
    os.makedirs(os.path.dirname(FLAGS.output_json) or ".", exist_ok=True)
    write_json(FLAGS.output_json, {"flags": common.script_flags(), "weight_bytes": sizes,
                                   "seconds_per_step": rows, "table": table})
    png = os.path.splitext(FLAGS.output_json)[0] + ".png"
    plot(rows, batches, png)
    print(f"wrote {FLAGS.output_json} and {png}")


if __name__ == "__main__":
    app.run(main)
