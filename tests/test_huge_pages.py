"""Weights on the CPU in one arena of 2 MB pages (cbjax/loading/huge_pages.py)."""

from __future__ import annotations

import gc
import mmap
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cbjax.core.builder import quantized
from cbjax.loading import huge_pages, load_model
from cbjax.loading.orbax_io import save_orbax
from tests.hf_models import make_hf_model, save_hf_model

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's smaps")


def _mapping(address: int) -> tuple[int, int, set[str]]:
    """The memory mapping holding `address`: its start, end and VmFlags."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                start, end = int(m.group(1), 16), int(m.group(2), 16)
                found = (start, end) if start <= address < end else None
            elif found and line.startswith("VmFlags:"):
                return (*found, set(line.split()[1:]))
    raise AssertionError(f"no mapping holds {address:#x}")


def _check_one_arena(leaves: list) -> None:
    """Every array of `leaves` read from one mapping, at 64-byte starts, advised huge where Linux can."""
    addresses = [x.unsafe_buffer_pointer() for x in leaves]
    start, end, flags = _mapping(min(addresses))
    assert min(addresses) % huge_pages.HUGE_PAGE == 0
    assert all(start <= a and a + x.nbytes <= end and a % huge_pages.ALIGN == 0 for a, x in zip(addresses, leaves))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in flags  # the kernel's mark of MADV_HUGEPAGE


def test_arrays_move_into_one_arena_and_stay_valid(monkeypatch):
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1 << 19)
    rng = np.random.default_rng(0)
    host = {"w": rng.standard_normal((300, 700)).astype(np.float32),
            "blocks": rng.integers(0, 256, (129, 34 * 5), dtype=np.uint8),
            "q": {"values": rng.integers(-127, 128, (77, 64), dtype=np.int8), "scale": rng.random((77, 2), np.float32)},
            "bf16": rng.standard_normal((33, 17)).astype(ml_dtypes.bfloat16)}
    tree = jax.tree.map(jnp.asarray, host)
    moved = huge_pages.on_huge_pages(tree)
    _check_one_arena(jax.tree.leaves(moved))
    del tree
    gc.collect()  # the arena lives as long as the arrays that read it
    for want, got in zip(jax.tree.leaves(host), jax.tree.leaves(moved)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
    assert float(jnp.sum(moved["w"])) == pytest.approx(float(host["w"].sum(dtype=np.float64)), rel=1e-4)


def test_small_trees_and_trees_across_devices_stay_as_they_are(monkeypatch):
    small = {"w": jnp.ones((8, 8))}
    assert huge_pages.on_huge_pages(small) is small  # under MIN_BYTES
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    cpus = jax.devices("cpu")
    if len(cpus) > 1:
        spread = {"a": jax.device_put(jnp.ones(4), cpus[0]), "b": jax.device_put(jnp.ones(4), cpus[1])}
        assert huge_pages.on_huge_pages(spread) is spread
    assert huge_pages.arena_for(1 << 30, jax.devices("cpu")[0]) is not None
    with pytest.raises(ValueError, match="arena holds"):
        huge_pages.Arena(16, cpus[0]).place(np.zeros(huge_pages.HUGE_PAGE + 1, np.uint8))


def test_loaded_and_int8_quantized_weights_sit_in_one_arena(tmp_path, monkeypatch):
    path = save_hf_model(make_hf_model("llama", seed=1), str(tmp_path / "llama"))
    plain = load_model(path)  # under MIN_BYTES: put on the device as before
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    model = load_model(path)
    _check_one_arena(jax.tree.leaves(model.params))
    for want, got in zip(jax.tree.leaves(plain.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    int8 = quantized(model, "int8", jax.devices()[0])
    leaves = jax.tree.leaves(int8.params)
    assert any(x.dtype == jnp.int8 for x in leaves)
    _check_one_arena(leaves)
    bf16 = load_model(path, dtype="bfloat16")  # cast on the way into the arena
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.params))
    np.testing.assert_array_equal(np.asarray(bf16.params["embed"]),
                                  np.asarray(plain.params["embed"]).astype(ml_dtypes.bfloat16))
    save_orbax(int8, str(tmp_path / "int8-orbax"))  # an orbax round trip lands in an arena too
    restored = load_model(str(tmp_path / "int8-orbax"))
    _check_one_arena(jax.tree.leaves(restored.params))
    for want, got in zip(leaves, jax.tree.leaves(restored.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
