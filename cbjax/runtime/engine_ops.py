"""Which operations an engine traces its programs with (cbjax/models/ops.py): the C++ CPU
kernels, the Pallas decode matmul, or XLA's own."""

from __future__ import annotations

import threading

import jax
import numpy as np
from typing_extensions import override

from cbjax.models import quant
from cbjax.models.ops import XLA, Ops
from cbjax.runtime.scale import sharding
from cbjax.runtime.cpu import kernels as cpu_kernels
from cbjax.runtime.scale.expert_parallel import expert_parallel_ops
from pallas_kernels.decode_matmul import decode_matmul, note, tuned, unsupported


class DecodeMatmulOps(Ops):
    """XLA's operations, but decode-sized products through the Pallas kernel
    (pallas_kernels/decode_matmul) where it is the faster way: int8/fp8 weights by default (XLA's
    fused widen-in-dot, autotuned, took 2.7x the bf16 dot's time for Llama-3-8B's int8 matrices
    at one row on an H200; docs/quantization.md), float weights only where the device's tuning
    chose the kernel (runtime/compiled/kernel_tuning.py); a tuned "xla" sends an 8-bit product back to
    XLA. `everywhere`: the kernel for every product it takes, tuned or not (quantized_matmul=
    'pallas'). `interpret`: the kernel's body in Pallas interpret mode (a CPU checking it)."""

    def __init__(self, interpret: bool, everywhere: bool = False):
        self.interpret, self.everywhere = interpret, everywhere

    @override
    def dense(self, x, w):
        quantized = isinstance(w, quant.QuantizedWeight)
        values = w.values if quantized else w
        if quantized or isinstance(w, jax.Array):
            groups = w.scale.shape[-1] if quantized else 0
            shape = (int(np.prod(x.shape[:-1])), *values.shape, groups, values.dtype)
            if not unsupported(*shape):
                choice = tuned(*shape)
                scale = w.scale if quantized else None
                if choice != "xla" and (quantized or self.everywhere or choice is not None):
                    return decode_matmul(x, values, scale, interpret=self.interpret)
                note(x, values, scale)  # XLA's dot while untuned: a tuner still learns the shape
        return super().dense(x, w)

    @override
    def __repr__(self) -> str:
        on = "" if self.platform is None else f", platform={self.platform!r}"
        return f"DecodeMatmulOps(interpret={self.interpret}, everywhere={self.everywhere}{on})"


PALLAS_MATMUL, PALLAS_MATMUL_EVERYWHERE = DecodeMatmulOps(False), DecodeMatmulOps(False, everywhere=True)
PALLAS_MATMUL_INTERPRETED = DecodeMatmulOps(True)


_KERNEL_BUILDS: list[threading.Thread] = []


def start_cpu_kernel_build(choice: str) -> None:
    """Build (or load) the CPU kernels on a thread, so that a cold start's compiler run (seconds)
    overlaps the loading of the weights; `use_cpu_kernels` waits for it."""
    if choice != "off" and not _KERNEL_BUILDS and jax.devices()[0].platform == "cpu":
        _KERNEL_BUILDS.append(threading.Thread(target=cpu_kernels.build_error, name="cbjax-kernel-build", daemon=True))
        _KERNEL_BUILDS[0].start()


def use_cpu_kernels(choice: str, params, devices: list) -> bool:
    """Whether an engine on `devices` runs the CPU kernels: they need f32 weights on one CPU device."""
    if choice == "off":
        return False
    for build in _KERNEL_BUILDS:  # build_error's cache must not be filled twice at once
        build.join()
    dtype, quantization = quant.activation_dtype(params), quant.quantization_of(params)
    why_not = ("the engine is not on one CPU device" if len(devices) != 1 or devices[0].platform != "cpu"
               else f"the weights are {dtype}, the kernel is f32" if dtype != np.float32
               else f"the weights are {quantization}-quantized, the kernels take f32, GGUF blocks or int8"
               if quantization not in ("none", "gguf", "int8")
               else cpu_kernels.build_error())
    if why_not is None:
        return True
    if choice == "on":
        raise ValueError(f"cpu_kernels='on' is unavailable: {why_not}")
    return False


def quantized_matmul_ops(choice: str, params, devices: list) -> Ops | None:
    """The Pallas decode matmul's ops on one device, or None (XLA's dot): on one GPU "auto" takes
    it for 8-bit weights and where tuning chose it, "pallas" for every product it takes; on
    another platform "pallas" runs it interpreted for 8-bit weights; "xla" never."""
    eight_bit = quant.quantization_of(params) in ("int8", "fp8")
    if choice == "xla":
        return None
    if len(devices) != 1:
        if choice == "pallas" and eight_bit:
            raise ValueError("quantized_matmul='pallas' runs on one device; with tensor parallelism use "
                             "quantized_matmul='xla'")
        return None
    if devices[0].platform in ("gpu", "cuda"):
        return PALLAS_MATMUL_EVERYWHERE if choice == "pallas" else PALLAS_MATMUL
    return PALLAS_MATMUL_INTERPRETED if choice == "pallas" and eight_bit else None


def engine_ops(config, params, mesh) -> Ops:
    """The engine's operations for its config's `cpu_kernels` and `quantized_matmul` choices, on
    `mesh`'s devices (None: the default device)."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    if sharding.ep_size(mesh) > 1:
        return expert_parallel_ops(mesh)
    if quant.quantization_of(params) in ("int8", "fp8") and config.quantized_matmul != "auto":
        # How the 8-bit weights multiply, asked for by name, wins over the CPU kernels' "auto".
        if config.cpu_kernels == "on":
            raise ValueError(f"cpu_kernels='on' and quantized_matmul={config.quantized_matmul!r} name two ways "
                             "to multiply the 8-bit weights: leave one of them 'auto'")
        return quantized_matmul_ops(config.quantized_matmul, params, devices) or XLA
    if use_cpu_kernels(config.cpu_kernels, params, devices):
        return cpu_kernels.CPU_KERNELS
    return quantized_matmul_ops(config.quantized_matmul, params, devices) or XLA
