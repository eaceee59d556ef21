"""Chat generation with a loaded model through the engine (default: the embedded SmolLM2-135M).

    python -m experiments generate
    python -m experiments generate --model=/path/to/hf_dir --prompt="Hello" --max_tokens=64 --temperature=0.7
"""

from __future__ import annotations

import json
import time

from experiments.lib import common  # noqa: F401  (quiets transformers and matplotlib)

from absl import app, flags
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset name, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_multi_string("prompt", ["What is the capital of France?", "Name three colors.",
                                     "Write a haiku about the sea."],
                          "User message(s), chat-templated when the tokenizer has a template. Repeat the flag "
                          "for several prompts.")
flags.DEFINE_integer("max_tokens", 64, "Maximum new tokens per prompt.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.", lower_bound=0.0)
flags.DEFINE_integer("top_k", 0, "Top-k cut (0: off).", lower_bound=0)
flags.DEFINE_float("top_p", 1.0, "Top-p (nucleus) mass (1: off).", lower_bound=1e-9, upper_bound=1.0)
flags.DEFINE_integer("seed", 0, "Sampling seed.", lower_bound=0)
EngineArgs.define_flags(["policy", "num_slots", "max_seq_len", "dtype", "tensor_parallel", "kv_cache"],
                        num_slots=4, max_seq_len=256)
flags.DEFINE_multi_string("prompt_ids", None, "Prompt(s) as comma-separated token ids instead of --prompt "
                          "(for models without a tokenizer); repeat the flag for several.")
flags.DEFINE_string("output_json", None, "Optional path for the outputs as JSON ('{process}' in it becomes the "
                    "process index, so every process of a multi-host run can write its own).")
flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0; joins the job through "
                    "jax.distributed.initialize (on GPU clusters --num_processes/--process_id may come from "
                    "SLURM/MPI instead).")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.", lower_bound=1)
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.", lower_bound=0)
flags.DEFINE_bool("warmup", True, "Compile every program before generating (so the timing excludes compilation).")
flags.DEFINE_integer("local_device_count", None, "CPU only: host devices this process exposes.", lower_bound=1)


def main(argv):
    del argv
    from cbjax import LLM, SamplingParams
    from cbjax.experimental import chat_prompt_ids, distributed

    if FLAGS.coordinator_address or FLAGS.num_processes:
        distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                               FLAGS.local_device_count)
    t0 = time.perf_counter()
    llm = LLM(FLAGS.model, policy=FLAGS.policy, num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len,
              dtype=FLAGS.dtype, seed=FLAGS.seed, tensor_parallel=FLAGS.tensor_parallel, kv_cache=FLAGS.kv_cache)
    print(f"loaded {FLAGS.model} ({llm.model.config.model_type}, {llm.model.config.num_layers} layers) "
          f"in {time.perf_counter() - t0:.1f}s")
    if FLAGS.prompt_ids:
        try:
            prompts = [[int(t) for t in p.split(",")] for p in FLAGS.prompt_ids]
        except ValueError:
            raise app.UsageError("--prompt_ids takes comma-separated integers") from None
        labels = FLAGS.prompt_ids
    else:
        if llm.tokenizer is None:
            raise app.UsageError(f"{FLAGS.model} has no tokenizer: pass --prompt_ids")
        prompts = [chat_prompt_ids(llm.tokenizer, p) for p in FLAGS.prompt]
        labels = FLAGS.prompt
    params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                            top_p=FLAGS.top_p, seed=FLAGS.seed)
    if FLAGS.warmup:
        t0 = time.perf_counter()
        print(f"compiling the engine's programs for {FLAGS.num_slots} slots up to {FLAGS.max_seq_len} tokens "
              "(once per process; a minute or so on a CPU)...", flush=True)
        num_programs = llm.warmup()
        print(f"compiled {num_programs} programs in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(labels, outputs):
        print(f"\n>>> {prompt}\n{out.text if out.text is not None else out.token_ids}   "
              f"[{out.finish_reason}, {len(out.token_ids)} tokens, "
              f"TTFT {1000 * out.metrics.ttft:.0f} ms]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tokens/s, {len(prompts)} sequences)")
    if FLAGS.output_json:
        import jax

        with open(FLAGS.output_json.replace("{process}", str(jax.process_index())), "w") as f:
            json.dump({"model": FLAGS.model, "seconds": elapsed, "process": jax.process_index(),
                       "num_processes": jax.process_count(), "devices": llm.engine_info.num_devices,
                       "results": [{"prompt": p, "output": o.text, "token_ids": o.token_ids,
                                    "finish_reason": o.finish_reason} for p, o in zip(labels, outputs)]},
                      f, indent=1)


if __name__ == "__main__":
    app.run(main)
