"""Paged decode attention: `paged_attention` (our Pallas kernel) and its pure-JAX `reference`."""

from pallas_kernels.paged_attention.kernel import combine, paged_attention
from pallas_kernels.paged_attention.reference import reference

__all__ = ["paged_attention", "reference", "combine"]
