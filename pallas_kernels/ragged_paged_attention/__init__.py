"""Ragged paged attention over a flat mixed batch: `ragged_paged_attention` (our Pallas
kernels: Triton on a GPU, Mosaic on a TPU), its pure-JAX `reference`, and the shape checks."""

from pallas_kernels.ragged_paged_attention.kernel import (block_sizes, check_supported, min_page_size,
                                                          ragged_paged_attention, set_cpu_interpreter,
                                                          slot_page_size)
from pallas_kernels.ragged_paged_attention.reference import reference

__all__ = ["block_sizes", "check_supported", "min_page_size", "ragged_paged_attention", "reference",
           "set_cpu_interpreter", "slot_page_size"]
