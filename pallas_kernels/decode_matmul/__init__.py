"""`x @ w.T` for decode-sized products (a few rows) over 8-bit weights with grouped float32
scales or plain float weights: our Pallas kernels (Triton; Mosaic GPU), its pure-JAX `reference`, the
shapes and settings it takes, and the space of settings a device tunes (pallas_kernels/tuning.py)."""

from pallas_kernels.decode_matmul.kernel import (KERNEL, MAX_ROWS, Launch, candidates, decode_matmul, note, resolve,
                                                 set_default_launch, shape_of, tuned, unsupported)
from pallas_kernels.decode_matmul.reference import reference

__all__ = ["KERNEL", "MAX_ROWS", "Launch", "candidates", "decode_matmul", "note", "reference", "resolve",
           "set_default_launch", "shape_of", "tuned", "unsupported"]
