"""What the device benchmarks share (experiments/benchmarks/bench_device.py and the sections it imports):
their shape flags, the model shapes, timing, engines and the memory roofline. `--tiny` runs
everything at tiny shapes on any machine (on a CPU the kernels in interpret mode)."""

from __future__ import annotations

import contextlib
import time

from experiments.lib import common
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_bool("tiny", False, "Tiny shapes everywhere (a smoke test on any machine; times mean nothing).")
flags.DEFINE_list("batches", ["1", "16", "64"], "Sequences decoding together in decode_8b (and the peer).")
flags.DEFINE_integer("prompt_len", 128, "decode_8b's prompt tokens per sequence.", lower_bound=1)
flags.DEFINE_integer("timed_steps", 48, "Decode steps timed per measurement.", lower_bound=2)
flags.DEFINE_enum("kernel_tuning", "auto", ["auto", "off"], "The engines' kernel_tuning: auto (the Pallas kernels' "
                  "launches timed at warm-up on their shapes, cached on disk) or off (the kernels' defaults).")
flags.DEFINE_enum("fuse_projections", "auto", ["auto", "on", "off"], "The engines' fuse_projections: auto (q/k/v "
                  "and gate/up as one matmul each on a GPU), on or off (step_135m times both whatever this says).")
common.validate_list("batches", int, 1, "positive integers")


LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position_embeddings=8192,
                 norm_eps=1e-5, rope_theta=500000.0, eos_token_ids=(128001,), bos_token_id=128000)
TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, intermediate_size=128, max_position_embeddings=2048, norm_eps=1e-5, eos_token_ids=(2,),
            bos_token_id=1)


def batches() -> list[int]:
    return [int(b) for b in FLAGS.batches] if not FLAGS.tiny else [1, 4]


def timed_ms(fn, *args, reps: int = 10) -> float:
    """Median milliseconds of `fn(*args)` after a warm-up, each call waited for."""
    import jax
    import numpy as np

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))




def device_model(shape: dict, seed: int = 0):
    import jax.numpy as jnp

    from cbjax.experimental import init_params_on_device, Model, ModelConfig

    config = ModelConfig(**shape)
    dtype = jnp.bfloat16 if not FLAGS.tiny or _accelerator() else jnp.float32
    return Model(config, init_params_on_device(config, seed, dtype), None, source="random on device")


def _accelerator() -> bool:
    import jax

    return jax.default_backend() != "cpu"


def decode_ms(llm, batch: int, prompt_len: int, warm: int, timed: int, around=contextlib.nullcontext,
              loras: list | None = None) -> float:
    """Milliseconds per decode step of `batch` sequences past `prompt_len` prompt tokens: the
    wall time of `timed` rounds over the tokens they returned per sequence (with the host's
    run-ahead, a round may return the previous one's tokens). The timed rounds run inside
    the context `around()` (a profiler's, say); `loras`: the LoRA adapters the sequences run, in turn."""
    import numpy as np

    from cbjax import SamplingParams

    rng = np.random.default_rng(batch)
    vocab = llm.model.config.vocab_size
    sampling = SamplingParams(max_tokens=budget(prompt_len, warm, timed, llm.args.decode_steps) - prompt_len,
                              ignore_eos=True)
    ids = [llm.add_request(rng.integers(10, vocab - 10, prompt_len).tolist(), sampling,
                           lora=None if loras is None else loras[i % len(loras)]) for i in range(batch)]
    counts = dict.fromkeys(ids, 0)
    while min(counts.values()) < warm:
        for out in llm.step():
            counts[out.request_id] += len(out.new_token_ids)
    with around():
        tokens, t0 = 0, time.perf_counter()
        for _ in range(timed):
            tokens += sum(len(out.new_token_ids) for out in llm.step())
        seconds = time.perf_counter() - t0
    for request_id in ids:
        if llm.has_request(request_id):
            llm.abort(request_id)
    llm.run_until_done()
    return 1e3 * seconds / (tokens / batch)


def budget(prompt_len: int, warm: int, timed: int, decode_steps: int) -> int:
    """Positions a measured sequence may reach: its prompt, the warm-up and twice the timed
    rounds' tokens, in whole 64-token blocks (the slot cache's kernel pages)."""
    return -(-(prompt_len + warm + 2 * timed * decode_steps + 8) // 64) * 64


def build_engine(model, kv_cache: str, attention: str, num_slots: int, max_seq_len: int, **options):
    """An `LLM` warmed up, and the seconds that took."""
    if FLAGS.tiny:  # fewer programs to compile
        options.setdefault("max_step_tokens", 32)
    options.setdefault("kernel_tuning", FLAGS.kernel_tuning)
    options.setdefault("fuse_projections", FLAGS.fuse_projections)
    t0 = time.perf_counter()
    from cbjax import LLM

    llm = LLM(model, num_slots=num_slots, max_seq_len=max_seq_len, kv_cache=kv_cache, attention=attention, **options)
    llm.warmup()
    llm.wait_for_compiles()  # the timed steps run the programs they will run for good
    return llm, time.perf_counter() - t0


def roofline_ms(model, batch: int, context: int, copy_GBps: float) -> float:
    """(every weight byte + the live K/V bytes of `batch` sequences of `context` tokens) over the copy bandwidth."""
    import jax

    c = model.config
    weights = sum(a.nbytes for a in jax.tree.leaves(model.params))
    from cbjax.experimental import activation_dtype

    itemsize = activation_dtype(model.params).itemsize
    kv = batch * context * 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize
    return (weights + kv) / copy_GBps / 1e6


def decode_shape() -> tuple[int, int, int]:
    """The 8B decode measurements' (prompt tokens, warm-up rounds, timed rounds)."""
    return (FLAGS.prompt_len, 8, FLAGS.timed_steps) if not FLAGS.tiny else (16, 2, 4)


def decode_steps(llm, model, copy_GBps: float) -> dict:
    """Per batch of `batches()`: `llm`'s ms per decode step past `decode_shape()`'s prompt, and
    the roofline of `model`'s weights (as the engine holds them) and live KV."""
    prompt_len, warm, timed = decode_shape()
    steps = {}
    for batch in batches():
        ms = decode_ms(llm, batch, prompt_len, warm, timed)
        floor = roofline_ms(model, batch, prompt_len + warm + timed // 2, copy_GBps)
        steps[batch] = {"ms": ms, "roofline_ms": floor, "of_roofline": floor / ms}
    return steps


def tuned_launches(llm) -> list[dict]:
    """What the engine's warm-up tuned: per kernel call, the launch chosen and the sweep behind it
    (seconds by candidate, or the error it raised), read from the tuning cache."""
    import jax

    from cbjax.experimental import default_cache

    cache, kind = default_cache(), jax.devices()[0].device_kind
    return [{"kernel": kernel, "shape": list(shape), "choice": choice,
             "sweep": (cache.get(kernel, kind, shape) or {}).get("sweep")}
            for kernel, shape, choice in llm.engine_info.kernel_launches]

