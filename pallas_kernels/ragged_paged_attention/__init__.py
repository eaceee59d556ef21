"""Ragged paged attention over a flat mixed batch: `ragged_paged_attention` (our Pallas
kernels: Triton on a GPU, Mosaic on a TPU), its pure-JAX `reference`, and the shape checks."""

from pallas_kernels.ragged_paged_attention.kernel import (HEAD_DIMS, block_sizes, check_supported,
                                                          ragged_paged_attention, set_cpu_interpreter)
from pallas_kernels.ragged_paged_attention.reference import reference

__all__ = ["HEAD_DIMS", "block_sizes", "check_supported", "ragged_paged_attention", "reference",
           "set_cpu_interpreter"]
