"""Greedy chat generation with a loaded model (default: the embedded SmolLM2-135M).

    python experiments/generate.py
    python experiments/generate.py --model=/path/to/hf_dir --prompt="Hello" --max_tokens=64
"""

from __future__ import annotations

import json
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset name, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_multi_string("prompt", ["What is the capital of France?", "Name three colors.",
                                     "Write a haiku about the sea."],
                          "User message(s), chat-templated when the tokenizer has a template. Repeat the flag "
                          "for several prompts; they are decoded together, one cache slot each.")
flags.DEFINE_integer("max_tokens", 64, "Maximum new tokens per prompt.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and KV-cache dtype.")
flags.DEFINE_string("output_json", None, "Optional path for the outputs as JSON.")


def main(argv):
    del argv
    from cbjax.checkpoint import load_model
    from cbjax.generate import greedy_generate, next_power_of_two
    from cbjax.tokenization import chat_prompt_ids

    t0 = time.perf_counter()
    model = load_model(FLAGS.model, dtype=FLAGS.dtype)
    print(f"loaded {FLAGS.model} ({model.config.model_type}, {model.config.num_layers} layers) "
          f"in {time.perf_counter() - t0:.1f}s")
    if model.tokenizer is None:
        raise app.UsageError(f"{FLAGS.model} has no tokenizer; this script needs text prompts")
    prompts = [chat_prompt_ids(model.tokenizer, p) for p in FLAGS.prompt]

    max_len = next_power_of_two(max(len(p) for p in prompts) + FLAGS.max_tokens)
    greedy_generate(model, prompts, max_new_tokens=2, max_len=max_len)  # compile outside the timed run
    t0 = time.perf_counter()
    outputs = greedy_generate(model, prompts, max_new_tokens=FLAGS.max_tokens, max_len=max_len)
    elapsed = time.perf_counter() - t0
    results = []
    for prompt, out in zip(FLAGS.prompt, outputs):
        text = model.tokenizer.decode(out, skip_special_tokens=True)
        results.append({"prompt": prompt, "output": text, "num_tokens": len(out)})
        print(f"\n>>> {prompt}\n{text}")
    total = sum(len(o) for o in outputs)
    print(f"\n{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tokens/s, {len(prompts)} sequences)")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump({"model": FLAGS.model, "results": results, "seconds": elapsed}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
