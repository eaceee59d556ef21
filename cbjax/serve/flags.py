"""The engine's absl flags, shared by `python -m cbjax.serve` and experiments/serve_bench.py
(which starts the server with the same options it replays in process)."""

from __future__ import annotations

from absl import flags

FLAGS = flags.FLAGS

ENGINE_FLAGS = ("policy", "num_slots", "max_seq_len", "window_ms", "refill_interval", "kv_cache", "page_size",
                "num_pages", "enable_prefix_caching", "merge_mode", "max_num_batched_tokens", "attention", "dtype")


def define_engine_flags(num_slots: int = 8, max_seq_len: int = 512) -> None:
    flags.DEFINE_enum("policy", "continuous", ["static", "dynamic", "continuous"],
                      "Batching policy (static: a batch forms from whatever waits when the last one ends).")
    flags.DEFINE_integer("num_slots", num_slots, "KV-cache slots: sequences decoded together.", lower_bound=1)
    flags.DEFINE_integer("max_seq_len", max_seq_len, "Prompt plus output tokens per request.", lower_bound=2)
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


def engine_options() -> dict:
    """`LLM(...)` keyword arguments from the engine flags."""
    return {name: FLAGS[name].value for name in ENGINE_FLAGS}


def engine_argv() -> list[str]:
    """The engine flags as command-line arguments (to start a server with them)."""
    return [f"--{name}={FLAGS[name].value}" if not isinstance(FLAGS[name].value, bool)
            else f"--{'' if FLAGS[name].value else 'no'}{name}"
            for name in ENGINE_FLAGS if FLAGS[name].value is not None]
