"""What an engine's knobs resolve to for its model and platform: the dtypes it computes and
stores in, which attention it runs (the Pallas kernels, or the reference path), and whether
its projections are fused (cbjax/models/fusion.py)."""

from __future__ import annotations

import jax

from cbjax.models import quant
from cbjax.models.kv_cache import is_quantized_kv, kv_storage_dtype
from cbjax.runtime.engine_config import EngineConfig
from pallas_kernels.ragged_paged_attention import check_supported, min_page_size, slot_page_size

ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


def activation_dtype(model):
    """The dtype the model computes in (a simulated model, without params: 16 bits)."""
    return jax.numpy.dtype(quant.activation_dtype(model.params) if model.params else jax.numpy.bfloat16)


def kv_dtype(model, config: EngineConfig):
    """The dtype the engine's KV cache stores."""
    return kv_storage_dtype(config.kv_cache_dtype, activation_dtype(model))


def kernel_refusal(model, config: EngineConfig) -> str | None:
    """Why the Pallas kernels cannot compile for this model and engine (naming the knob), or
    None: checked when the engine is built rather than when a program lowers on the device."""
    mc = model.config
    dtype = kv_dtype(model, config)
    activations = activation_dtype(model)
    if not is_quantized_kv(dtype) and dtype != activations:  # the kernels' dots take q and k alike
        return (f"kv_cache_dtype={config.kv_cache_dtype!r} stores {dtype.name} under {activations.name} "
                "activations: the kernels read the model's own dtype or 8 bits (int8, fp8)")
    if config.kv_cache == "slots" and slot_page_size(config.max_seq_len, mc.head_dim, dtype) is None:
        return (f"the slot cache is read in pages of at least {min_page_size(dtype)} tokens: max_seq_len "
                f"({config.max_seq_len}) must be a multiple of {min_page_size(dtype)}")
    try:
        check_supported(head_dim=mc.head_dim, page_size=config.page_size if config.kv_cache == "paged" else 64,
                        dtype=dtype, q_heads=mc.num_heads, kv_heads=mc.num_kv_heads)
    except ValueError as e:
        return str(e)
    return None


def choose_attention(model, config: EngineConfig, platform: str, tensor_parallel: int = 1) -> str:
    """The attention an engine runs: `config.attention` when it names one ("pallas" refused,
    naming the knob, where the kernels cannot run), and for "auto" the kernels on a GPU or
    TPU wherever they take the model, the reference path elsewhere (on a CPU the C++
    kernels, cbjax/runtime/cpu/kernels.py, are the fast path; the Pallas body only runs
    interpreted there)."""
    if config.attention == "reference":
        return "reference"
    why_not = kernel_refusal(model, config)
    if why_not is None and tensor_parallel > 1:
        why_not = "the kernels do not run tensor-parallel yet"
    if config.attention == "pallas":
        if why_not is not None:
            raise ValueError(f"attention='pallas': {why_not}: use attention='reference'")
        return "pallas"
    return "pallas" if platform in ACCELERATORS and why_not is None else "reference"


def fusion_refusal(quantization: str, tensor_parallel: int) -> str | None:
    """Why this engine's weights cannot be fused, or None."""
    if tensor_parallel > 1:
        return "tensor parallelism splits q, k, v, gate and up by heads, each matrix on its own"
    if quantization == "gguf":
        return "GGUF blocks run through the CPU kernels, which read each matrix on its own"
    return None


def wants_fusion(choice: str, platform: str, quantization: str, tensor_parallel: int = 1) -> bool:
    """`fuse_projections`: "auto" fuses on a GPU or TPU wherever the weights allow (on a CPU the
    C++ layer kernel reads each matrix by address); "on" fuses anywhere, refused (naming the
    knob) where it cannot; "off" never (`EngineArgs` checks the choice)."""
    why_not = fusion_refusal(quantization, tensor_parallel)
    if choice == "on" and why_not is not None:
        raise ValueError(f"fuse_projections='on': {why_not}; use fuse_projections='off'")
    if choice == "auto":
        return why_not is None and platform in ACCELERATORS
    return choice == "on"
