"""Train the output-length predictor of `ordering="sjf"` / `"score"` for one model.

1. Data (once; reused while the file exists): the model answers `--num_prompts` opening
   turns of the `chitchat-dataset` package, chat-templated, greedily, until EOS or
   `--max_tokens`; each (prompt token ids, output length) pair is written to `--data`.
2. A flax MLP (cbjax/models/length_predictor.py) is trained with optax on all but a
   held-out fraction; Kendall's tau between predicted and true lengths on the held-out
   prompts is printed and recorded; the predictor is saved with orbax to `--output_dir`.

    python -m experiments train_length_predictor            # SmolLM2: cbjax/data/length_predictors/smollm2-135m
    python -m cbjax.serve --ordering=sjf --length_predictor=smollm2-135m
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from experiments.lib import common
from experiments.lib.common import HELD_OUT_FILE

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory "
                    "(with a chat template).")
flags.DEFINE_integer("num_prompts", 1500, "Prompts to generate answers for.", lower_bound=20)
flags.DEFINE_integer("max_tokens", 256, "Output cap while generating the data.", lower_bound=1)
flags.DEFINE_integer("num_slots", 32, "Sequences generated together.", lower_bound=1)
flags.DEFINE_string("data", "cbjax/data/length_predictors/smollm2-135m/data.json", "The (prompt, output length) pairs: "
                    "made here when missing (or with --regenerate), else read.")
flags.DEFINE_bool("regenerate", False, "Generate the data again even if --data exists.")
flags.DEFINE_string("output_dir", "cbjax/data/length_predictors/smollm2-135m", "Where the predictor checkpoint "
                    "and its held-out prompts go.")
flags.DEFINE_string("report", "docs/length_predictor_smollm2.json", "Where the report goes (JSON).")
flags.DEFINE_string("plot", "docs/length_predictor_held_out.png", "Where the held-out plot goes.")
flags.DEFINE_float("holdout", 0.2, "Fraction of the prompts held out for Kendall's tau.", lower_bound=0.05,
                   upper_bound=0.5)
flags.DEFINE_list("epochs", ["25", "50", "100", "200", "300"], "Training epochs to choose among on the validation "
                  "split (one value: no choice).")
flags.DEFINE_list("weight_decay", ["0.001", "0.01", "0.1"], "AdamW weight decays to choose among.")
flags.DEFINE_float("validation", 0.2, "Fraction of the training prompts set aside to choose epochs and weight decay "
                   "(the held-out prompts are never used to choose).", lower_bound=0.05, upper_bound=0.5)
flags.DEFINE_integer("hidden", 64, "MLP width.", lower_bound=4)
flags.DEFINE_float("rank_weight", 1.0, "Weight of the pairwise ranking loss beside the squared error.",
                   lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "Seed of the prompt choice, the split and the initialization.")
common.validate_list("epochs", int, 1, "positive integers")
common.validate_list("weight_decay", float, 0.0, "non-negative weight decays")


def generate_data(model) -> dict:
    from cbjax import LLM, SamplingParams
    from cbjax.experimental import chat_messages, chat_prompt_ids

    messages = chat_messages(FLAGS.num_prompts, seed=FLAGS.seed)
    prompts = [chat_prompt_ids(model.tokenizer, m) for m in messages]
    max_seq_len = max(len(p) for p in prompts) + FLAGS.max_tokens
    llm = LLM(model, num_slots=FLAGS.num_slots, max_seq_len=max_seq_len)
    outs = llm.generate(prompts, SamplingParams(max_tokens=FLAGS.max_tokens, temperature=0.0), use_tqdm=True)
    return {"model": FLAGS.model, "max_tokens": FLAGS.max_tokens, "sampling": "greedy",
            "source": "chitchat-dataset opening turns, chat-templated",
            "pairs": [{"prompt_token_ids": p, "output_len": len(o.token_ids), "finish_reason": o.finish_reason}
                      for p, o in zip(prompts, outs)]}


def main(argv):
    del argv
    import numpy as np
    from tqdm import tqdm

    from cbjax.experimental import length_predictor as lp

    start = time.perf_counter()
    model = common.load_model(FLAGS.model, "float32", with_tokenizer=True)
    if FLAGS.regenerate or not os.path.isfile(FLAGS.data):
        data = generate_data(model)
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.data)), exist_ok=True)
        with open(FLAGS.data, "w") as f:
            json.dump(data, f)
        print(f"wrote {len(data['pairs'])} pairs to {FLAGS.data}")
    with open(FLAGS.data) as f:
        data = json.load(f)
    pairs = data["pairs"]
    embed = lp.embedding_table(model)
    features = lp.prompt_features(embed, [p["prompt_token_ids"] for p in pairs])
    lengths = np.asarray([p["output_len"] for p in pairs], np.float64)
    order = np.random.default_rng(FLAGS.seed).permutation(len(pairs))
    num_test = int(round(FLAGS.holdout * len(pairs)))
    test, train = order[:num_test], order[num_test:]

    meta = {"model": lp.model_identity(FLAGS.model, embed)}
    num_val = int(round(FLAGS.validation * len(train)))
    val, fit_part = train[:num_val], train[num_val:]
    choices = [(int(e), float(wd)) for e in FLAGS.epochs for wd in FLAGS.weight_decay]
    selection = []
    for epochs, weight_decay in tqdm(choices, desc="choosing epochs and weight decay"):
        candidate = lp.LengthPredictor.train(features[fit_part], lengths[fit_part], meta=meta, epochs=epochs,
                                             weight_decay=weight_decay, hidden=FLAGS.hidden,
                                             rank_weight=FLAGS.rank_weight, seed=FLAGS.seed)
        selection.append({"epochs": epochs, "weight_decay": weight_decay, "validation_kendall_tau": lp.kendall_tau(
            candidate.predict_features(features[val]), lengths[val])})
    best = max(selection, key=lambda r: r["validation_kendall_tau"])
    print(f"chose {best['epochs']} epochs, weight decay {best['weight_decay']:g} (validation tau "
          f"{best['validation_kendall_tau']:.3f} on {num_val} training prompts)")
    bar = tqdm(total=best["epochs"], desc="train")
    predictor = lp.LengthPredictor.train(
        features[train], lengths[train], meta=meta, epochs=best["epochs"], weight_decay=best["weight_decay"],
        hidden=FLAGS.hidden, rank_weight=FLAGS.rank_weight, seed=FLAGS.seed,
        progress=lambda epoch, loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}")))
    bar.close()
    predicted = predictor.predict_features(features[test])
    tau = lp.kendall_tau(predicted, lengths[test])
    tau_train = lp.kendall_tau(predictor.predict_features(features[train]), lengths[train])
    # A baseline any scheduler has for free: longer prompts get longer answers?
    tau_prompt_len = lp.kendall_tau(features[test, -1], lengths[test])
    report = {"held_out_kendall_tau": tau, "train_kendall_tau": tau_train,
              "held_out_kendall_tau_of_prompt_length": tau_prompt_len,
              "held_out_median_abs_error_tokens": float(np.median(np.abs(predicted - lengths[test]))),
              "num_train": len(train), "num_test": num_test, "capped_fraction": float(np.mean(
                  lengths == data["max_tokens"])), "mean_output_len": float(lengths.mean()),
              "chosen": {k: best[k] for k in ("epochs", "weight_decay")}, "selection": selection}
    predictor.meta.update(report)
    predictor.save(FLAGS.output_dir)
    # The held-out prompts and what the predictor says of them: latency_sweep's `held_out`
    # workload replays them (predictions reused where no model runs: --simulate).
    with open(os.path.join(FLAGS.output_dir, HELD_OUT_FILE), "w") as f:
        json.dump({"data": os.path.relpath(os.path.abspath(FLAGS.data), os.path.abspath(FLAGS.output_dir)),
                   "indices": test.tolist(), "predicted": [float(v) for v in predicted]}, f)
    common.write_json({"flags": common.script_flags(), **report, "wall_s": time.perf_counter() - start},
               FLAGS.report)
    plot(predicted, lengths[test], tau, FLAGS.plot)
    print(f"held-out Kendall's tau {tau:.3f} (train {tau_train:.3f}; prompt length alone {tau_prompt_len:.3f}); "
          f"median |error| {report['held_out_median_abs_error_tokens']:.0f} tokens on {num_test} prompts")
    print(f"saved the predictor to {FLAGS.output_dir} in {time.perf_counter() - start:.0f}s")


def plot(predicted, true, tau: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.scatter(true, predicted, s=8, alpha=0.6)
    top = max(float(true.max()), float(predicted.max()))
    ax.plot([1, top], [1, top], "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="true output tokens", ylabel="predicted output tokens",
           title=f"held-out prompts: Kendall's tau {tau:.2f}")
    common.savefig(fig, path)


if __name__ == "__main__":
    common.quiet_libraries()
    app.run(main)
