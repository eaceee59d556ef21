"""Train a tiny Llama with flax NNX and optax on the shipped text, save it as a training run
does (orbax params, config.json, tokenizer), then load that directory into the engine and check
it against the training model's own forward: the same greedy tokens, the same perplexity.

    python -m experiments train_tiny                                   # 300 steps, NNX layout
    python -m experiments train_tiny --layout=stacked --steps=1000 --output_dir=/tmp/tiny
    python -m cbjax.eval --model_args pretrained=results/train_tiny --tasks cbjax_prose
"""

from __future__ import annotations

import os
import time

from experiments.lib import common

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("text", os.path.join(common.ROOT, "experiments", "data", "public_domain.txt"),
                    "Text to train on (and to score).")
flags.DEFINE_string("output_dir", "results/train_tiny", "The checkpoint directory written.")
flags.DEFINE_enum("layout", "nnx", ["nnx", "linen", "stacked"], "How the params are saved (cbjax reads each).")
flags.DEFINE_integer("steps", 300, "Optimizer steps.", lower_bound=1)
flags.DEFINE_integer("seq_len", 64, "Tokens per training window.", lower_bound=2)
flags.DEFINE_integer("batch_size", 8, "Windows per step.", lower_bound=1)
flags.DEFINE_float("learning_rate", 3e-3, "AdamW's peak learning rate (warm-up, then cosine decay).")
flags.DEFINE_integer("vocab_size", 512, "The byte-level BPE tokenizer's vocabulary, trained on the text.",
                     lower_bound=260)
flags.DEFINE_integer("hidden_size", 64, "The model's width.", lower_bound=8)
flags.DEFINE_integer("num_layers", 2, "Transformer layers.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Initialization and data seed.")
flags.DEFINE_integer("check_tokens", 24, "Greedy tokens compared between the engine and the training model.",
                     lower_bound=1)


def plot(losses: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.set_title(f"train_tiny: {FLAGS.num_layers} layers, width {FLAGS.hidden_size}")
    common.savefig(fig, path)


def main(argv):
    del argv
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every read and write at INFO
    import numpy as np
    from flax import nnx
    from tqdm.auto import tqdm

    from cbjax import LLM, SamplingParams
    from cbjax.experimental import write_json
    from experiments.lib import flax_llama

    with open(FLAGS.text) as f:
        text = f.read()
    tokenizer = flax_llama.train_tokenizer(text, FLAGS.vocab_size)
    ids = tokenizer.encode(text)
    heads = max(FLAGS.hidden_size // 16, 1)
    config = flax_llama.TinyConfig(vocab_size=len(tokenizer), hidden_size=FLAGS.hidden_size,
                                   intermediate_size=2 * FLAGS.hidden_size, num_layers=FLAGS.num_layers,
                                   num_heads=heads, num_kv_heads=max(heads // 2, 1), max_len=max(4 * FLAGS.seq_len, 256))
    model = flax_llama.TinyLlama(config, nnx.Rngs(FLAGS.seed))
    bar = tqdm(total=FLAGS.steps, desc="train_tiny", unit="step")

    def progress(loss):
        bar.update()
        bar.set_postfix(loss=f"{loss:.3f}")

    start = time.perf_counter()
    losses = flax_llama.train(model, ids, FLAGS.steps, FLAGS.seq_len, FLAGS.batch_size, FLAGS.learning_rate,
                              FLAGS.seed, progress)
    bar.close()
    train_s = time.perf_counter() - start
    path = flax_llama.save_checkpoint(FLAGS.output_dir, model, config, tokenizer, FLAGS.layout)
    print(f"trained {FLAGS.steps} steps in {train_s:.1f}s, loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"saved {path} ({FLAGS.layout} layout)")

    # The engine on the saved directory against the training model's own forward.
    scored = ids[:config.max_len - 2]
    llm = LLM(path, max_seq_len=config.max_len, num_slots=2)
    prompt = ids[:8]
    ours = llm.generate([prompt], SamplingParams(max_tokens=FLAGS.check_tokens, ignore_eos=True),
                        use_tqdm=False)[0].token_ids
    theirs = flax_llama.greedy(model, prompt, FLAGS.check_tokens)
    out = llm.generate([scored], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    engine_logprobs = np.array([e.logprob for e in out.prompt_logprobs[1:]])
    model_logprobs = flax_llama.token_logprobs(model, scored)
    result = {"layout": FLAGS.layout, "steps": FLAGS.steps, "train_s": train_s, "first_loss": losses[0],
              "final_loss": losses[-1], "tokens": len(ids), "vocab_size": len(tokenizer),
              "greedy_equal": ours == theirs, "engine_perplexity": float(np.exp(-engine_logprobs.mean())),
              "model_perplexity": float(np.exp(-model_logprobs.mean())),
              "max_abs_logprob_diff": float(np.abs(engine_logprobs - model_logprobs).max()), "losses": losses}
    print(f"engine vs training model: greedy tokens {'equal' if ours == theirs else 'DIFFER'}, perplexity "
          f"{result['engine_perplexity']:.4f} vs {result['model_perplexity']:.4f} over {len(scored) - 1} tokens "
          f"(largest logprob difference {result['max_abs_logprob_diff']:.1e})")
    write_json(os.path.join(path, "train_tiny.json"), result)
    plot(losses, os.path.join(path, "loss.png"))


if __name__ == "__main__":
    app.run(main)
