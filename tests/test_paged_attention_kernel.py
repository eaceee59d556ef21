"""Our paged decode-attention Pallas kernel in interpret mode against the pure-JAX reference
(and JAX's own GPU paged-attention kernel as a second reference)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention, reference

PAGE_SIZE = 4
PAGES_PER_SEQ = 8  # 32 tokens at most


def make_inputs(q_heads, kv_heads, lengths, dtype, head_dim=32, seed=0):
    rng = np.random.default_rng(seed)
    slots = len(lengths)
    num_pages = slots * PAGES_PER_SEQ + 3  # a few pages belong to nobody
    q = jnp.asarray(rng.normal(size=(slots, q_heads, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(kv_heads, num_pages, PAGE_SIZE, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(kv_heads, num_pages, PAGE_SIZE, head_dim)), dtype)
    # Pages in shuffled order; table entries past a sequence's pages are junk (-1 or
    # other sequences' pages) and must not matter.
    order = rng.permutation(num_pages)
    table = order[:slots * PAGES_PER_SEQ].reshape(slots, PAGES_PER_SEQ).copy()
    for s, n in enumerate(lengths):
        used = -(-n // PAGE_SIZE)
        table[s, used:] = rng.choice([-1, int(order[-1])], size=PAGES_PER_SEQ - used)
    return q, k, v, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


# lengths: empty, one token, page-aligned, unaligned, full
LENGTHS = [0, 1, 8, 13, 32]


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (8, 1)])  # MHA, GQA 4, MQA
@pytest.mark.parametrize("pages_per_block,splits", [(1, 1), (2, 3), (4, 2)])
def test_kernel_matches_reference(dtype, tol, q_heads, kv_heads, pages_per_block, splits):
    q, k, v, table, lengths = make_inputs(q_heads, kv_heads, LENGTHS, dtype)
    scale = 32 ** -0.5
    ref = reference(q, k, v, table, lengths, scale)
    out = paged_attention(q, k, v, table, lengths, scale=scale, pages_per_block=pages_per_block, splits=splits,
                          interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all(), "every element of the output is written and finite"
    np.testing.assert_allclose(out32, ref32, atol=tol, rtol=tol)
    np.testing.assert_array_equal(out32[0], 0.0)  # length 0 attends to nothing


def test_reference_against_dense_attention():
    """The reference itself: pages laid out contiguously equal plain softmax attention."""
    q, k, v, _, lengths = make_inputs(8, 2, [5, 32], jnp.float32)
    table = jnp.asarray(np.arange(2 * PAGES_PER_SEQ).reshape(2, PAGES_PER_SEQ), jnp.int32)
    out = np.asarray(reference(q, k, v, table, lengths, 0.3))
    for s, n in enumerate([5, 32]):
        kk = np.asarray(k)[:, s * PAGES_PER_SEQ:(s + 1) * PAGES_PER_SEQ].reshape(2, -1, 32)[:, :n]
        vv = np.asarray(v)[:, s * PAGES_PER_SEQ:(s + 1) * PAGES_PER_SEQ].reshape(2, -1, 32)[:, :n]
        qs = np.asarray(q)[s].reshape(2, 4, 32)
        logits = np.einsum("kgd,ktd->kgt", qs, kk) * 0.3
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[s], np.einsum("kgt,ktd->kgd", p, vv).reshape(8, 32), atol=1e-5)


def test_matches_jax_shipped_gpu_kernel_in_interpret_mode():
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    lengths = [1, 8, 13, 32]
    q, k, v, table, lens = make_inputs(16, 2, lengths, jnp.float32)
    table = jnp.where(table < 0, 0, table)  # JAX's kernel wants valid page ids everywhere
    scale = 32 ** -0.5
    theirs = jax_paged.paged_attention(q * scale, k, v, table, lens, pages_per_compute_block=2, k_splits=2,
                                       interpret=True)
    ours = paged_attention(q, k, v, table, lens, scale=scale, pages_per_block=2, splits=2, interpret=True)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-5, rtol=2e-5)


def test_tpu_backend_in_tpu_interpret_mode():
    """JAX's TPU kernel behind our calling convention, under TPU interpret mode on CPU
    (it computes in bfloat16 inside, hence the tolerance)."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, table, lengths = make_inputs(8, 2, LENGTHS, jnp.float32, head_dim=128)
    scale = 128 ** -0.5
    with pltpu.force_tpu_interpret_mode():
        out = paged_attention(q, k, v, table, lengths, scale=scale, pages_per_block=2, backend="tpu")
    ref = reference(q, k, v, table, lengths, scale)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(np.asarray(out)[0], 0.0)
