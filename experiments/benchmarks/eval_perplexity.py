"""Perplexity of a checkpoint on a text file through lm-eval's `loglikelihood_rolling` on the
engine (cbjax/eval), next to lm-eval's `hf` model on the same checkpoint.

    python -m experiments eval_perplexity                                  # SmolLM2, shipped text
    python -m experiments eval_perplexity --model=/path/hf_dir --text=my.txt --window=512

Each paragraph of the text (blank-line separated) is a document; lm-eval cuts it into rolling
windows (every token predicted once, with up to `--window` tokens of context, the first one
conditioned on BOS), which the engine scores batched: one request a window, prompt logprobs
computed in its step.
"""

from __future__ import annotations

import json
import os
import time

from experiments.lib import common  # noqa: F401  (quiets transformers and matplotlib)

from absl import app, flags
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file, orbax directory or training "
                    "checkpoint (an orbax directory is compared against the checkpoint it was converted from).")
flags.DEFINE_string("text", os.path.join(common.ROOT, "experiments", "data", "public_domain.txt"),
                    "Text file to score: each paragraph a document.")
flags.DEFINE_integer("window", 256, "Most tokens of context a predicted token sees (lm-eval's max_length).",
                     lower_bound=2)
EngineArgs.define_flags(["dtype", "quantization", "kv_cache_dtype"])
flags.DEFINE_bool("transformers", True, "Also score the documents with lm-eval's hf model on the same checkpoint.")
flags.DEFINE_string("output_json", "results/eval_perplexity.json", "Where the result goes.")


def rolling(lm, documents: list[str]) -> list[float]:
    """Each document's log-likelihood by `lm`'s `loglikelihood_rolling`."""
    from lm_eval.api.instance import Instance

    return lm.loglikelihood_rolling([Instance(request_type="loglikelihood_rolling", doc={}, arguments=(d,), idx=i)
                                     for i, d in enumerate(documents)], disable_tqdm=True)


def plot(per_document: dict[str, list[float]], counts: list[int], path: str) -> None:
    """Perplexity of each document, one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / len(per_document)
    for k, (name, lls) in enumerate(per_document.items()):
        ppl = [np.exp(-ll / n) for ll, n in zip(lls, counts)]
        ax.bar(np.arange(len(ppl)) + k * width, ppl, width, label=name)
    ax.set_xlabel(f"document (paragraph; windows of {FLAGS.window} tokens of context)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{FLAGS.model} on {os.path.basename(FLAGS.text)}")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    common.savefig(fig, path)


def main(argv):
    del argv
    import numpy as np

    from cbjax.eval import CbjaxLM
    from cbjax.experimental import is_orbax_dir, write_json

    start = time.perf_counter()
    with open(FLAGS.text) as f:
        documents = [" ".join(p.split()) for p in f.read().split("\n\n") if p.strip()]
    lm = CbjaxLM(FLAGS.model, max_length=FLAGS.window, dtype=FLAGS.dtype, quantization=FLAGS.quantization,
                 kv_cache_dtype=FLAGS.kv_cache_dtype)
    counts = [len(lm.tok_encode(d)) for d in documents]  # every token is predicted once
    per_document = {"cbjax": rolling(lm, documents)}
    ours = float(np.exp(-sum(per_document["cbjax"]) / sum(counts)))
    result = {"model": FLAGS.model, "quantization": FLAGS.quantization, "kv_cache_dtype": FLAGS.kv_cache_dtype,
              "text": FLAGS.text, "documents": len(documents), "predicted": sum(counts), "window": FLAGS.window,
              "cbjax_ppl": ours}
    print(f"cbjax        perplexity {ours:.4f} over {sum(counts)} predicted tokens ({len(documents)} documents, "
          f"up to {FLAGS.window} tokens of context)")
    if FLAGS.transformers:
        from lm_eval.models.huggingface import HFLM

        from experiments.lib.hf_peers import load_peer

        source = FLAGS.model
        if os.path.isdir(source) and is_orbax_dir(source):
            with open(os.path.join(source, "cbjax_config.json")) as f:
                source = json.load(f).get("source", "")
        peer = load_peer(source) if source else None
        if peer is None:
            print(f"no transformers twin for {FLAGS.model}: comparison skipped")
        else:
            hf = HFLM(pretrained=peer, tokenizer=lm.tokenizer, max_length=FLAGS.window, device="cpu",
                      dtype="float32", batch_size=8)
            per_document["transformers"] = rolling(hf, documents)
            theirs = float(np.exp(-sum(per_document["transformers"]) / sum(counts)))
            rel = abs(ours - theirs) / theirs
            result.update(transformers_ppl=theirs, relative_difference=rel)
            print(f"transformers perplexity {theirs:.4f}   relative difference {100 * rel:.4f}%")
    result["wall_s"] = time.perf_counter() - start
    result["per_document_loglikelihood"] = per_document
    result["per_document_tokens"] = counts
    write_json(FLAGS.output_json, result)
    png = os.path.splitext(FLAGS.output_json)[0] + ".png"
    plot(per_document, counts, png)
    print(f"wrote {FLAGS.output_json} and {png} in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    app.run(main)
