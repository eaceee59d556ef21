"""What a preemption costs, swap against recompute (the shape of the vLLM paper's figure 19): for
each page size and sequence length, the time to swap a sequence's KV out to host memory and back
(`preemption_mode="swap"`) against the time to prefill it again (`recompute`). Measured on this
machine's engine, and simulated for an accelerator (default: Llama-3-8B bf16 on an H100, the
KV over its host link, the prefill on its roofline).

    python -m experiments swap_vs_recompute
    python -m experiments swap_vs_recompute --page_sizes=16 --seq_lens=256,1024 --accelerator=a100-80gb

A swap here is one gather program and one host copy each way whatever the page size (vLLM
copied block by block), so the page size only moves the padding: a sequence is moved padded to
a power of two of at least one page.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_list("page_sizes", ["8", "16", "32", "64"], "Page sizes (tokens).")
flags.DEFINE_list("seq_lens", ["64", "256", "1024"], "Sequence lengths (cached tokens at the preemption).")
flags.DEFINE_list("sim_seq_lens", ["256", "1024", "4096"], "Sequence lengths of the simulated rows.")
flags.DEFINE_integer("repeats", 3, "Timed repeats per cell (the best is kept).", lower_bound=1)
flags.DEFINE_string("dtype", "float32", "The measured engine's dtype.")
flags.DEFINE_string("accelerator", "h100", "The simulated accelerator (an accelerator preset).")
flags.DEFINE_string("sim_model", "llama3-8b", "The simulated model (a shape from the simulator's presets).")
flags.DEFINE_string("sim_dtype", "bfloat16", "The simulated model's dtype.")
flags.DEFINE_bool("measure", True, "Measure this machine's engine (else simulated rows only).")
flags.DEFINE_string("output_dir", "results/swap_vs_recompute", "Where the JSON and the plot go.")
common.validate_list("page_sizes", int, 1, "positive page sizes")
common.validate_list("seq_lens", int, 2, "sequence lengths >= 2")
common.validate_list("sim_seq_lens", int, 2, "sequence lengths >= 2")


def measure(page_size: int, lengths: list[int]) -> dict[int, dict]:
    """This machine: per length, the best time of a swap out, a swap in, and a recompute
    (the same number of tokens prefilled, prefix caching off)."""
    import numpy as np

    from cbjax import LLM, SamplingParams
    from cbjax.experimental import profile

    max_len = -(-(max(lengths) + 16) // page_size) * page_size
    llm = LLM(FLAGS.model, num_slots=2, max_seq_len=max_len, dtype=FLAGS.dtype, kv_cache="paged", page_size=page_size,
              preemption_mode="swap", host_kv_cache_bytes=1 << 34)
    llm.warmup()
    rng, out = np.random.default_rng(page_size), {}
    vocab = llm.model.config.vocab_size
    for length in lengths:
        swap_out, swap_in, recompute = [], [], []
        for repeat in range(FLAGS.repeats + 1):  # the first of each also compiles what is left
            prompt = rng.integers(3, vocab, length).tolist()
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            recompute.append(time.perf_counter() - t0)
            rid = llm.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
            llm.step()  # prefilled, its first token sampled: `length` positions cached
            seconds_out, seconds_in = profile.timed_swap(llm, rid)
            swap_out.append(seconds_out)
            swap_in.append(seconds_in)
            llm.abort(rid)
            llm.step()
        out[length] = {"swap_out_s": min(swap_out[1:]), "swap_in_s": min(swap_in[1:]),
                       "recompute_s": min(recompute[1:])}
    del llm
    common.release_programs()
    return out


def simulate(page_size: int, lengths: list[int], per_page: bool = False) -> dict[int, dict]:
    """The accelerator: a swap moves the padded sequence's KV over the host link each way (as
    the real engine pads it), a recompute prefills its tokens on the roofline (the ragged
    kernels: causal pairs, live pages), in steps of at most 2,048 tokens. `per_page`: the swap
    copies page by page, a copy per page, layer, keys and values each paying the link's latency
    (vLLM v0's block-by-block swap, whose cost the paper's figure shows falling with block size)."""
    from cbjax.experimental import ACCELERATORS, Call, MODEL_SHAPES, padded_length, RooflineCost
    from cbjax.experimental import causal_pairs, DTYPE_BYTES, kv_bytes_per_token

    config = MODEL_SHAPES[FLAGS.sim_model]
    cost = RooflineCost(ACCELERATORS[FLAGS.accelerator], config, DTYPE_BYTES[FLAGS.sim_dtype])
    per_token = kv_bytes_per_token(config, DTYPE_BYTES[cost.kv_dtype])
    out = {}
    for length in lengths:
        moved = per_token * padded_length(length, 1 << 20, page_size)
        one_way = cost.host_link.transfer_seconds(moved)
        if per_page:
            moved = per_token * -(-length // page_size) * page_size
            copies = -(-length // page_size) * config.num_layers * 2
            one_way = copies * cost.host_link.latency_s + moved / cost.host_link.bytes_per_s
        recompute, start = 0.0, 0
        while start < length:
            n = min(2048, length - start)
            recompute += cost.seconds(Call("prefill", tokens=n, attended=causal_pairs(start, n), kv_read=start + n,
                                           rows=1, steps=1))
            start += n
        out[length] = {"swap_out_s": one_way, "swap_in_s": one_way, "recompute_s": recompute, "bytes": moved}
    return out


def main(argv):
    del argv
    pages = [int(p) for p in FLAGS.page_sizes]
    lengths = [int(n) for n in FLAGS.seq_lens]
    results = {}
    if FLAGS.measure:
        for p in pages:
            results[f"measured, page {p}"] = measure(p, lengths)
    sim_lengths = [int(n) for n in FLAGS.sim_seq_lens]
    for p in pages:
        results[f"{FLAGS.accelerator} {FLAGS.sim_model} simulated, page {p}"] = simulate(p, sim_lengths)
    for p in pages:
        results[f"{FLAGS.accelerator} per-page copies, page {p}"] = simulate(p, sim_lengths, per_page=True)
    print(f"{'where':<44}{'tokens':>8}{'swap out ms':>13}{'swap in ms':>12}{'recompute ms':>14}{'recompute/swap':>16}")
    for where, cells in results.items():
        for n, c in cells.items():
            swap = c["swap_out_s"] + c["swap_in_s"]
            c["recompute_over_swap"] = c["recompute_s"] / swap
            print(f"{where:<44}{n:>8}{1e3 * c['swap_out_s']:>13.3f}{1e3 * c['swap_in_s']:>12.3f}"
                  f"{1e3 * c['recompute_s']:>14.3f}{c['recompute_over_swap']:>15.1f}x")
    common.write_json({"flags": common.script_flags(), "results": results},
                      os.path.join(FLAGS.output_dir, "swap_vs_recompute.json"))
    plot(results, os.path.join(FLAGS.output_dir, "swap_vs_recompute.png"))


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({k.split(", page")[0] for k in results})
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, group in zip(axes[0], groups):
        for where, cells in results.items():
            if not where.startswith(group):
                continue
            n = list(cells)
            ax.plot(n, [1e3 * (cells[k]["swap_out_s"] + cells[k]["swap_in_s"]) for k in n], "o-",
                    label=f"swap out+in, {where.split(', ')[-1]}")
        first = next(c for w, c in results.items() if w.startswith(group))
        ax.plot(list(first), [1e3 * c["recompute_s"] for c in first.values()], "k--", label="recompute")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("time of one preemption (ms)")
        ax.set_title(group)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    common.savefig(fig, path)


if __name__ == "__main__":
    common.quiet_libraries()
    app.run(main)
