"""`python -m cbjax.serve`: load a model, compile its programs, serve the OpenAI API.

    python -m cbjax.serve                                  # the embedded SmolLM2-135M on :8000
    python -m cbjax.serve --model=/path/to/hf_dir --kv_cache=paged --enable_prefix_caching
        --merge_mode=chunked --num_slots=32 --max_seq_len=2048 --port=8000   (one line)
"""

from __future__ import annotations

import logging
import os
import time

from absl import app, flags

from cbjax.experimental import define_engine_flags, engine_args_from_flags as engine_args, engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset name, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_string("served_model_name", None, "The name clients pass as 'model' (default: --model).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port).", lower_bound=0, upper_bound=65535)
flags.DEFINE_integer("max_pending", 1024, "Sequences held at once (waiting or running), each request counted as "
                     "its prompts x samples (best_of, else n); more get 429, a request that alone has more a 400.",
                     lower_bound=1)
flags.DEFINE_integer("max_pending_tokens", 1 << 20, "Prompt tokens held at once; more get 429, a request that alone "
                     "has more a 400.", lower_bound=1)
flags.DEFINE_integer("max_logprob_entries", 1 << 18, "Prompt logprob entries (scored prompt tokens x (1 + k)) one "
                     "request may ask for; more get a 400 (this bounds its forward's time and its response's size).",
                     lower_bound=1)
flags.DEFINE_integer("max_connections", None, "Open connections at once; past it a connection gets 503 and is closed "
                     "(default: the descriptor limit, raised to its hard limit, less 256, at most 16384).",
                     lower_bound=1)
flags.DEFINE_float("header_timeout_s", 10.0, "Seconds a new connection may take to send its request's headers.",
                   lower_bound=0.001)
flags.DEFINE_float("idle_timeout_s", 15.0, "Seconds an idle keep-alive connection stays open.", lower_bound=0.001)
define_engine_flags()
flags.adopt_module_key_flags(engine_flags)
flags.DEFINE_integer("seed", 0, "Sampling seed for requests that bring none.", lower_bound=0)
flags.DEFINE_integer("host_devices", None, "On a CPU: expose this many host devices (XLA's "
                     "--xla_force_host_platform_device_count), for --tensor_parallel, --pipeline_stages or "
                     "disaggregated instances on one machine. Set before JAX starts.", lower_bound=1)
flags.DEFINE_list("backends", [], "Serve as a router in front of these cbjax servers (URLs, one per host): each "
                  "request goes to the one with the fewest in flight; no model is loaded here (serve/router.py).")
flags.DEFINE_integer("replicas", 1, "Data-parallel replicas: this many whole engines, each on its own "
                     "--tensor_parallel devices, behind one router (cbjax/parallel/replicas.py).", lower_bound=1)
flags.DEFINE_enum("routing", "least_loaded", ["round_robin", "least_loaded", "prefix_affinity"],
                  "How --replicas route a request: in turn, to the least queued work (vLLM's score), or by a "
                  "hash of its first --affinity_tokens prompt tokens (their prefix caches then share prompts).")
flags.DEFINE_integer("affinity_tokens", 16, "Prompt tokens prefix_affinity routing hashes.", lower_bound=1)
flags.DEFINE_bool("warmup", True, "Compile every program before serving (first requests then pay no compile).")
flags.DEFINE_bool("warmup_structured", True, "With --warmup, also compile the programs structured-output requests run "
                  "(else the first such request compiles one, stalling every stream).")
flags.DEFINE_bool("structured_in_background", True, "With --warmup_structured, compile them on a background thread "
                  "while serving: start-up does not wait, and a constrained request that comes first waits for its "
                  "own program only. False: before serving.")
flags.DEFINE_string("compilation_cache", None, "JAX's persistent compilation cache: a directory, or 'off' "
                    "(default: $CBJAX_COMPILATION_CACHE, else ~/.cache/cbjax/jax).")
flags.DEFINE_bool("access_log", False, "Log one line per HTTP request.")
flags.DEFINE_float("body_timeout_s", 30.0, "Seconds a request body may take to arrive; slower gets 408.",
                   lower_bound=0.001)
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer <key>' on every route but /health (default: "
                    "the CBJAX_API_KEY environment variable; unset: no key).")


def engine_layout(llm, args) -> str:
    """How the engine is spread over the devices, in one line."""
    import jax

    replicas = llm.data_parallel
    used = llm.engine_info.num_devices * replicas
    layout = f"tensor_parallel={args.tensor_parallel} over {used} of {jax.device_count()} devices"
    if replicas > 1:
        layout = f"{replicas} replicas ({FLAGS.routing}), " + layout
    if args.pipeline_stages > 1:
        layout += f", pipeline_stages={args.pipeline_stages}"
    if args.prefill_instances:
        layout += f", {args.prefill_instances} prefill + {args.decode_instances} decode instances"
    return layout


def main(argv):
    del argv
    from cbjax import LLM
    from cbjax.experimental import compile_cache
    from cbjax.serve import Server

    if FLAGS.host_devices:  # read when JAX's CPU backend starts, which nothing has asked for yet
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={FLAGS.host_devices}").strip()
    logging.basicConfig(level=logging.INFO if FLAGS.access_log else logging.WARNING)
    if FLAGS.backends:
        from cbjax.serve.router import Router

        Router(FLAGS.backends, host=FLAGS.host, port=FLAGS.port).run()
        return
    compile_cache.enable(FLAGS.compilation_cache)
    try:
        args = engine_args(seed=FLAGS.seed)
        if FLAGS.replicas > 1:
            from cbjax import Replicas

            llm = Replicas(FLAGS.model, data_parallel=FLAGS.replicas, tensor_parallel=args.tensor_parallel,
                           dtype=args.dtype, routing=FLAGS.routing, affinity_tokens=FLAGS.affinity_tokens, args=args)
        else:
            llm = LLM(FLAGS.model, args)
    except ValueError as e:
        raise app.UsageError(str(e))
    print(f"engine: {engine_layout(llm, args)}", flush=True)
    if FLAGS.warmup:
        t0 = time.perf_counter()
        print(f"compiling {FLAGS.model}'s programs ({FLAGS.num_slots} slots, {FLAGS.max_seq_len} tokens)...",
              flush=True)
        print(f"compiled {llm.warmup()} programs in {time.perf_counter() - t0:.1f}s", flush=True)
        if llm.tokenizer is not None:  # llguidance's view of it (holds the GIL a while): now, not mid-stream
            try:
                llm.grammars.tokenizer()
                t0 = time.perf_counter()
                count = llm.warm_structured_output(FLAGS.structured_in_background) if FLAGS.warmup_structured else 0
                if count:
                    if FLAGS.structured_in_background:
                        print(f"compiling {count} structured-output programs in the background", flush=True)
                    else:
                        print(f"compiled {count} structured-output programs in {time.perf_counter() - t0:.1f}s",
                              flush=True)
            except ValueError as e:
                print(f"structured output unavailable: {e}", flush=True)
    server = Server(llm, FLAGS.served_model_name or FLAGS.model, host=FLAGS.host, port=FLAGS.port,
                    max_pending=FLAGS.max_pending, access_log=FLAGS.access_log,
                    api_key=FLAGS.api_key or os.environ.get("CBJAX_API_KEY") or None,
                    body_timeout_s=FLAGS.body_timeout_s, max_pending_tokens=FLAGS.max_pending_tokens,
                    max_logprob_entries=FLAGS.max_logprob_entries, max_connections=FLAGS.max_connections,
                    header_timeout_s=FLAGS.header_timeout_s, idle_timeout_s=FLAGS.idle_timeout_s)
    server.run()


if __name__ == "__main__":
    app.run(main)
