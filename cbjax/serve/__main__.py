"""`python -m cbjax.serve`: load a model, compile its programs, serve the OpenAI API.

    python -m cbjax.serve                                  # the embedded SmolLM2-135M on :8000
    python -m cbjax.serve --model=/path/to/hf_dir --kv_cache=paged --enable_prefix_caching \
        --merge_mode=chunked --num_slots=32 --max_seq_len=2048 --port=8000
"""

from __future__ import annotations

import logging
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset name, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_string("served_model_name", None, "The name clients pass as 'model' (default: --model).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port).", lower_bound=0, upper_bound=65535)
flags.DEFINE_integer("max_pending", 1024, "Requests held at once (waiting or running); more get 429.",
                     lower_bound=1)
flags.DEFINE_enum("policy", "continuous", ["static", "dynamic", "continuous"],
                  "Batching policy (static: a batch forms from whatever waits when the last one ends).")
flags.DEFINE_integer("num_slots", 8, "KV-cache slots: sequences decoded together.", lower_bound=1)
flags.DEFINE_integer("max_seq_len", 512, "Prompt plus output tokens per request.", lower_bound=2)
flags.DEFINE_float("window_ms", 50.0, "Dynamic batching window.", lower_bound=0.0)
flags.DEFINE_integer("refill_interval", 1, "Continuous: decode steps between admissions.", lower_bound=1)
flags.DEFINE_enum("kv_cache", "slots", ["slots", "paged"], "KV-cache layout.")
flags.DEFINE_integer("page_size", 16, "Tokens per page (paged cache).", lower_bound=1)
flags.DEFINE_integer("num_pages", None, "Pages in the paged cache (default: slots x max_seq_len worth).",
                     lower_bound=1)
flags.DEFINE_bool("enable_prefix_caching", False, "Share cached prompt pages between requests (paged cache).")
flags.DEFINE_enum("merge_mode", "prefill_first", ["prefill_first", "fused", "chunked"],
                  "How prefills meet running decodes (see README: merge modes).")
flags.DEFINE_integer("max_num_batched_tokens", None, "Token budget of a mixed step (fused/chunked).",
                     lower_bound=1)
flags.DEFINE_enum("attention", "reference", ["reference", "pallas"], "Attention implementation.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and KV-cache dtype.")
flags.DEFINE_integer("seed", 0, "Sampling seed for requests that bring none.", lower_bound=0)
flags.DEFINE_bool("warmup", True, "Compile every program before serving (first requests then pay no compile).")
flags.DEFINE_bool("access_log", False, "Log one line per HTTP request.")


def engine_options() -> dict:
    return dict(policy=FLAGS.policy, num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len,
                window_ms=FLAGS.window_ms, refill_interval=FLAGS.refill_interval, kv_cache=FLAGS.kv_cache,
                page_size=FLAGS.page_size, num_pages=FLAGS.num_pages,
                enable_prefix_caching=FLAGS.enable_prefix_caching, merge_mode=FLAGS.merge_mode,
                max_num_batched_tokens=FLAGS.max_num_batched_tokens, attention=FLAGS.attention,
                dtype=FLAGS.dtype, seed=FLAGS.seed)


def main(argv):
    del argv
    from cbjax import LLM
    from cbjax.serve import Server

    logging.basicConfig(level=logging.INFO if FLAGS.access_log else logging.WARNING)
    try:
        llm = LLM(FLAGS.model, **engine_options())
    except ValueError as e:
        raise app.UsageError(str(e))
    if FLAGS.warmup:
        t0 = time.perf_counter()
        print(f"compiling {FLAGS.model}'s programs ({FLAGS.num_slots} slots, {FLAGS.max_seq_len} tokens)...",
              flush=True)
        print(f"compiled {llm.warmup()} programs in {time.perf_counter() - t0:.1f}s", flush=True)
    server = Server(llm, FLAGS.served_model_name or FLAGS.model, host=FLAGS.host, port=FLAGS.port,
                    max_pending=FLAGS.max_pending, access_log=FLAGS.access_log)
    server.run()


if __name__ == "__main__":
    app.run(main)
