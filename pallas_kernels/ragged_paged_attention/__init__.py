"""Ragged paged attention over a flat mixed batch: `ragged_paged_attention` (our Pallas
kernels: Triton on a GPU, Mosaic on a TPU), its pure-JAX `reference`, and the shape checks."""

from pallas_kernels.ragged_paged_attention.kernel import (KERNEL, Launch, block_sizes, candidates, candidates_of,
                                                          check_supported, min_page_size, ragged_paged_attention,
                                                          set_cpu_interpreter, shape_of, slot_page_size)
from pallas_kernels.ragged_paged_attention.reference import reference

__all__ = ["KERNEL", "Launch", "block_sizes", "candidates", "candidates_of", "check_supported", "min_page_size",
           "ragged_paged_attention", "reference", "set_cpu_interpreter", "shape_of", "slot_page_size"]
