"""Ragged paged attention over a flat mixed batch: `ragged_paged_attention` (our Pallas
kernel) and its pure-JAX `reference`."""

from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import reference

__all__ = ["ragged_paged_attention", "reference"]
