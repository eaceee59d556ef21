"""`x @ w.T` for 8-bit weights with grouped float32 scales, decode-sized (a few rows): our
Pallas kernel (Triton, GPU), its pure-JAX `reference`, and the shapes and settings it takes."""

from pallas_kernels.quantized_matmul.kernel import (MAX_ROWS, Launch, quantized_matmul, resolve, set_default_launch,
                                                    unsupported)
from pallas_kernels.quantized_matmul.reference import reference

__all__ = ["MAX_ROWS", "Launch", "quantized_matmul", "reference", "resolve", "set_default_launch", "unsupported"]
