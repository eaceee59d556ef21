"""Perplexity of a checkpoint on a text file, next to transformers' value for the same checkpoint.

    python -m experiments eval_perplexity                                  # SmolLM2, shipped text
    python -m experiments eval_perplexity --model=/path/hf_dir --text=my.txt --window=512
"""

from __future__ import annotations

import json
import os
import time

from experiments.lib import common  # noqa: F401  (quiets transformers and matplotlib)

from absl import app, flags
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory "
                    "(an orbax directory is compared against the checkpoint it was converted from).")
flags.DEFINE_string("text", os.path.join(common.ROOT, "experiments", "data", "public_domain.txt"),
                    "Text file to score.")
flags.DEFINE_integer("window", 256, "Tokens per independently scored window.", lower_bound=2)
EngineArgs.define_flags(["dtype", "quantization", "kv_cache_dtype"])
flags.DEFINE_integer("score_chunk", None, "Tokens per forward, each chunk reading the ones before it from the KV "
                     "cache (at kv_cache_dtype); 0 scores whole windows. Default 1 with an 8-bit kv_cache_dtype "
                     "(every key but its own read back from the cache, as in decode), else 0.", lower_bound=0)
flags.DEFINE_bool("transformers", True, "Also compute transformers' perplexity on the same windows.")
flags.DEFINE_string("output_json", "results/eval_perplexity.json", "Where the result goes.")


def transformers_nlls(peer, token_ids, window) -> list[tuple[float, int]]:
    """(summed NLL, predicted tokens) per window, as `cbjax.perplexity.window_nlls`."""
    import torch

    from cbjax.experimental import windows

    out = []
    for w in windows(token_ids, window):
        ids = torch.tensor([w])
        with torch.no_grad():
            logits = peer(ids).logits[0, :-1].float()
        out.append((float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")), len(w) - 1))
    return out


def plot(per_window: dict[str, list[tuple[float, int]]], path: str) -> None:
    """Perplexity of each window, one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / len(per_window)
    for k, (name, nlls) in enumerate(per_window.items()):
        ppl = [np.exp(n / c) for n, c in nlls]
        ax.bar(np.arange(len(ppl)) + k * width, ppl, width, label=name)
    ax.set_xlabel(f"window ({FLAGS.window} tokens each)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{FLAGS.model} on {os.path.basename(FLAGS.text)}")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    common.savefig(fig, path)


def main(argv):
    del argv
    import jax
    import numpy as np

    from cbjax.experimental import is_orbax_dir, load_model, window_nlls, write_json

    start = time.perf_counter()
    model = load_model(FLAGS.model, dtype=FLAGS.dtype, keep_gguf_blocks=FLAGS.quantization == "gguf")
    # transformers' side stays unquantized: the difference is the quantization's
    if FLAGS.quantization not in ("none", "gguf"):
        from cbjax.experimental import quantized

        model = quantized(model, FLAGS.quantization, jax.devices()[0])
    if model.tokenizer is None:
        raise app.UsageError(f"{FLAGS.model} has no tokenizer to turn the text into tokens")
    with open(FLAGS.text) as f:
        text = f.read()
    ids = [int(t) for t in model.tokenizer(text)["input_ids"]]
    from cbjax.experimental import activation_dtype, kv_storage_dtype

    chunk = FLAGS.score_chunk if FLAGS.score_chunk is not None else int(FLAGS.kv_cache_dtype != "auto")
    kv_dtype = kv_storage_dtype(FLAGS.kv_cache_dtype, activation_dtype(model.params))
    per_window = {"cbjax": window_nlls(model, ids, FLAGS.window, kv_dtype, chunk)}
    total, count = (sum(x) for x in zip(*per_window["cbjax"]))
    ours = float(np.exp(total / count))
    result = {"model": FLAGS.model, "quantization": FLAGS.quantization, "kv_cache_dtype": FLAGS.kv_cache_dtype,
              "score_chunk": chunk, "text": FLAGS.text, "tokens": len(ids), "predicted": count,
              "window": FLAGS.window, "cbjax_ppl": ours}
    print(f"cbjax        perplexity {ours:.4f} over {count} predicted tokens ({len(ids)} tokens, "
          f"window {FLAGS.window})")
    if FLAGS.transformers:
        from experiments.lib.hf_peers import load_peer

        source = FLAGS.model
        if os.path.isdir(source) and is_orbax_dir(source):
            with open(os.path.join(source, "cbjax_config.json")) as f:
                source = json.load(f).get("source", "")
        peer = load_peer(source) if source else None
        if peer is None:
            print(f"no transformers twin for {FLAGS.model}: comparison skipped")
        else:
            per_window["transformers"] = transformers_nlls(peer, ids, FLAGS.window)
            t_total, t_count = (sum(x) for x in zip(*per_window["transformers"]))
            theirs = float(np.exp(t_total / t_count))
            rel = abs(ours - theirs) / theirs
            result.update(transformers_ppl=theirs, relative_difference=rel)
            print(f"transformers perplexity {theirs:.4f}   relative difference {100 * rel:.4f}%")
    result["wall_s"] = time.perf_counter() - start
    result["per_window_nll"] = per_window
    write_json(FLAGS.output_json, result)
    png = os.path.splitext(FLAGS.output_json)[0] + ".png"
    plot(per_window, png)
    print(f"wrote {FLAGS.output_json} and {png} in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    app.run(main)
