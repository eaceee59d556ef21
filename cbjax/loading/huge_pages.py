"""Weights on the CPU in one mapping of 2 MB pages.

A decode step on the CPU reads every weight once, a stream as long as the model (SmolLM2
Q8_0: 143 MB). In 4 KB pages that is 35,000 TLB entries a step against Zen 4's 3,072 of second
level; in 2 MB pages, 72. Linux gives an anonymous mapping 2 MB pages where
`transparent_hugepage` is `always`, or `madvise` and the mapping asks (MADV_HUGEPAGE), which is
what this does; elsewhere the arena is one plain mapping. A plain read gains; the block
matmuls, whose loop with its software prefetch stays short of a plain read either way, do
not; the decode step gains a little (docs/code_measurements.md).

JAX's CPU client keeps a numpy array it is given with `device_put` without a copy when the
array is aligned, so the jax.Array reads the arena itself and holds it alive.
"""

from __future__ import annotations

import mmap

import jax
import numpy as np

HUGE_PAGE = 2 << 20
ALIGN = 64  # each array's start: the CPU client's zero-copy alignment and a cache line
# Smaller weights (test models) go to the device as they are: a 2 MB page each would be most of
# their memory, and they are read from the caches anyway.
MIN_BYTES = 16 << 20


def _cpu_device(leaves: list) -> jax.Device | None:
    """The one CPU device every array leaf is on, or None."""
    devices = {d for x in leaves if isinstance(x, jax.Array) for d in x.devices()}
    if len(devices) != 1:
        return None
    device = devices.pop()
    return device if device.platform == "cpu" else None


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """One private anonymous mapping of `nbytes` (rounded up to whole 2 MB pages), starting on a
    2 MB boundary, asking the kernel for huge pages, for arrays on the CPU `device`: `place`
    copies them in, in turn."""

    def __init__(self, nbytes: int, device: jax.Device):
        size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
        self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(self._map, np.uint8)
        start = -whole.ctypes.data % HUGE_PAGE
        self.bytes = whole[start:start + size]
        if hasattr(mmap, "MADV_HUGEPAGE"):  # advice only: where it is refused the pages stay 4 KB
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, start, size)
            except OSError:
                pass
        self.device, self.used, self.zero_copy = device, 0, True

    def place(self, a: np.ndarray, dtype=None) -> jax.Array:
        """`a` (cast to `dtype`, if given) copied into the arena, as a jax.Array reading it there;
        after a JAX copied one, every array is simply put on the device."""
        dtype = np.dtype(a.dtype if dtype is None else dtype)
        if not self.zero_copy:
            return jax.device_put(np.asarray(a, dtype), self.device)
        end = self.used + a.size * dtype.itemsize
        if end > self.bytes.size:
            raise ValueError(f"the arena holds {self.bytes.size} bytes; {end} asked")
        dst = self.bytes[self.used:end].view(dtype).reshape(a.shape)
        dst[...] = a
        self.used = padded(end)
        placed = jax.device_put(dst, self.device)
        self.zero_copy = placed.unsafe_buffer_pointer() == dst.ctypes.data
        return placed


def arena_for(nbytes: int, device: jax.Device) -> Arena | None:
    """An arena for `nbytes` of arrays on `device`, or None where that is no CPU or they are few."""
    return Arena(nbytes, device) if device.platform == "cpu" and nbytes >= MIN_BYTES else None


def on_huge_pages(tree):
    """`tree` (a pytree of jax.Arrays, e.g. a model's params) with every array copied into one
    `Arena`, when they all sit on one CPU device (and hold `MIN_BYTES`); any other tree comes
    back as it is."""
    leaves, treedef = jax.tree.flatten(tree)
    device = _cpu_device(leaves)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    arena = device and arena_for(sum(padded(leaves[i].nbytes) for i in arrays), device)
    if arena is None:
        return tree
    placed = list(leaves)
    for i in arrays:
        placed[i] = arena.place(np.asarray(leaves[i]))
        if not arena.zero_copy:  # this JAX copied: the tree as it was
            return tree
    return jax.tree.unflatten(treedef, placed)
