"""The ragged paged-attention kernels (Triton's and Mosaic TPU's, each in its interpret mode)
against their pure-JAX reference, and the reference against a plain per-token loop: MHA/GQA/MQA
(odd groups), empty rows, lengths 0/1/page boundaries, decodes beside prefill chunks, shuffled
pages, f32 and bf16; and the shapes the kernels refuse."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference
from tests.tiers import sweep

PAGE = 8


def make_batch(rng, seqs, q_heads, kv_heads, head_dim, dtype, pages_per_seq=8, extra_rows=5, page=PAGE):
    """`seqs`: (q_len, kv_len) per sequence. Pages are shuffled across sequences; table
    entries past a sequence's pages are junk."""
    num_pages = len(seqs) * pages_per_seq + 3
    k = rng.normal(size=(kv_heads, num_pages, page, head_dim)).astype(np.float32)
    v = rng.normal(size=(kv_heads, num_pages, page, head_dim)).astype(np.float32)
    order = rng.permutation(num_pages)
    table = np.full((len(seqs), pages_per_seq), 10 ** 6, np.int32)  # junk beyond each sequence
    for s, (_, kv_len) in enumerate(seqs):
        used = -(-kv_len // page)
        table[s, :used] = order[s * pages_per_seq:s * pages_per_seq + used]
    q_lens = np.array([q for q, _ in seqs], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.normal(size=(int(cu[-1]) + extra_rows, q_heads, head_dim)).astype(np.float32)
    kv_lens = np.array([kv for _, kv in seqs], np.int32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(kv_lens), jnp.asarray(table), jnp.asarray(cu)


def loop_attention(q, k, v, kv_lens, table, cu, scale, window=0):
    """The contract, token by token in numpy."""
    page = k.shape[2]
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    out = np.zeros_like(q)
    kv_heads, group = k.shape[0], q.shape[1] // k.shape[0]
    for s in range(len(kv_lens)):
        q_len = int(cu[s + 1] - cu[s])
        keys = k[:, np.asarray(table[s])[: -(-int(kv_lens[s]) // page)]].reshape(kv_heads, -1, k.shape[-1])
        vals = v[:, np.asarray(table[s])[: -(-int(kv_lens[s]) // page)]].reshape(kv_heads, -1, k.shape[-1])
        for i in range(q_len):
            position = int(kv_lens[s]) - q_len + i
            lo = max(position - window + 1, 0) if window else 0
            for h in range(q.shape[1]):
                logits = keys[h // group, lo:position + 1] @ q[cu[s] + i, h] * scale
                p = np.exp(logits - logits.max())
                out[cu[s] + i, h] = p @ vals[h // group, lo:position + 1] / p.sum()
    return out


MIXES = {
    "decodes": [(1, 1), (1, 8), (1, 9), (1, 37)],
    "prefills": [(8, 8), (13, 13), (1, 1), (16, 16)],
    "mixed": [(1, 30), (7, 7), (0, 0), (5, 21), (1, 16), (17, 40), (0, 12)],
    "chunk_at_page_boundary": [(8, 16), (9, 24), (1, 64)],
}


KERNELS = {"triton": True, "tpu": "tpu"}  # the `interpret` argument that runs each one on the CPU


HEADS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (6, 1), "gqa3": (6, 2)}
F32_CASES = [(head_dim, name, mix) for head_dim in (16, 32) for name in HEADS for mix in sorted(MIXES)]


# Every grouping at head_dim 32, and multi-head at 16, in the quick run.
@pytest.mark.parametrize("head_dim,heads,mix", sweep(
    [(d, HEADS[name], mix) for d, name, mix in F32_CASES], ids=["-".join(map(str, c)) for c in F32_CASES],
    quick=[(d, HEADS[name], mix) for d, name, mix in F32_CASES if d == 32 or name == "mha"]))
def test_kernels_match_reference_f32(mix, heads, head_dim):
    rng = np.random.default_rng(hash((mix, heads, head_dim)) % 2 ** 32)
    q, k, v, kv_lens, table, cu = make_batch(rng, MIXES[mix], *heads, head_dim, jnp.float32)
    scale = head_dim ** -0.5
    valid = int(cu[-1])
    ref = reference(q, k, v, kv_lens, table, cu, scale)
    np.testing.assert_allclose(np.asarray(ref)[:valid], loop_attention(q, k, v, kv_lens, table, cu, scale)[:valid],
                               rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(ref)[valid:] == 0), "padding rows are zeros in the reference"
    # The TPU interpreter is slow: one block shape per case, alternating between one page per
    # DMA step (many steps: the double buffering) and the shape's own choice.
    blocks = {"triton": ((None, None), (16, 1), (32, 8)), "tpu": ((16, 1),) if head_dim == 16 else ((None, None),)}
    for kernel, interpret in KERNELS.items():
        for block_q, pages_per_block in blocks[kernel]:
            out = ragged_paged_attention(q, k, v, kv_lens, table, cu, scale=scale, block_q=block_q,
                                         pages_per_block=pages_per_block, interpret=interpret)
            assert out.shape == q.shape and out.dtype == q.dtype
            np.testing.assert_allclose(np.asarray(out)[:valid], np.asarray(ref)[:valid], rtol=2e-5, atol=2e-5,
                                       err_msg=f"{kernel} block_q={block_q} pages_per_block={pages_per_block}")


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("mix", ["mixed", "chunk_at_page_boundary"])
def test_kernels_match_reference_bf16(mix, kernel):
    rng = np.random.default_rng(7)
    q, k, v, kv_lens, table, cu = make_batch(rng, MIXES[mix], 8, 2, 64, jnp.bfloat16, page=16)
    valid = int(cu[-1])
    ref = reference(q, k, v, kv_lens, table, cu, 0.125)
    out = ragged_paged_attention(q, k, v, kv_lens, table, cu, scale=0.125, interpret=KERNELS[kernel])
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32)[:valid], np.asarray(ref, np.float32)[:valid],
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("window", [5, 16])
@pytest.mark.parametrize("head_dim", [32, 80, 96])
def test_kernels_match_reference_with_windows_and_any_head_dim(head_dim, window, kernel):
    """Sliding windows and head sizes that are not powers of two (Triton pads them): against
    the reference and the loop. The pages wholly before a sequence's first query's window
    hold NaN: a kernel that read them would return NaN, so this also proves they are skipped
    (one page per step, so skipping is possible at all)."""
    rng = np.random.default_rng(head_dim + window)
    seqs = MIXES["mixed"] + [(3, 61), (1, 64)]
    q, k, v, kv_lens, table, cu = make_batch(rng, seqs, 6, 2, head_dim, jnp.float32)
    valid, scale = int(cu[-1]), head_dim ** -0.5
    want = loop_attention(q, k, v, kv_lens, table, cu, scale, window)
    ref = reference(q, k, v, kv_lens, table, cu, scale, window=window)
    np.testing.assert_allclose(np.asarray(ref)[:valid], want[:valid], rtol=2e-5, atol=2e-5)
    k, v = np.array(k), np.array(v)
    poisoned = 0
    for s, (q_len, kv_len) in enumerate(seqs):
        first_key = max(kv_len - q_len - window + 1, 0)
        for p in range(first_key // PAGE):
            k[:, table[s, p]] = v[:, table[s, p]] = np.nan
            poisoned += 1
    assert poisoned > 0
    out = ragged_paged_attention(q, jnp.asarray(k), jnp.asarray(v), kv_lens, table, cu, scale=scale, block_q=16,
                                 pages_per_block=1, interpret=KERNELS[kernel], window=window)
    np.testing.assert_allclose(np.asarray(out)[:valid], want[:valid], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_take_query_tiles_of_one_group_of_heads(kernel):
    """A tile as small as its dots allow (block_q x group = 16 query rows: a decode batch
    wastes no rows of other tokens) gives the reference's result on a mixed batch."""
    rng = np.random.default_rng(11)
    q, k, v, kv_lens, table, cu = make_batch(rng, MIXES["mixed"], 16, 4, 32, jnp.float32)
    valid = int(cu[-1])
    ref = reference(q, k, v, kv_lens, table, cu, 0.2)
    out = ragged_paged_attention(q, k, v, kv_lens, table, cu, scale=0.2, block_q=4, pages_per_block=2,
                                 interpret=KERNELS[kernel])
    np.testing.assert_allclose(np.asarray(out)[:valid], np.asarray(ref)[:valid], rtol=2e-5, atol=2e-5)


def test_kernel_rejects_mismatched_metadata():
    rng = np.random.default_rng(8)
    q, k, v, kv_lens, table, cu = make_batch(rng, MIXES["decodes"], 4, 2, 32, jnp.float32)
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention(q, k, v, kv_lens, table, cu[:-1], scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="multiple"):
        ragged_paged_attention(q[:, :3], k, v, kv_lens, table, cu, scale=1.0, interpret=True)


@pytest.mark.parametrize("change, knob", [
    (dict(head_dim=12), "head_dim"), (dict(head_dim=84), "head_dim"), (dict(head_dim=264), "head_dim"),
    (dict(page=24), "page_size"),
    (dict(page=8, dtype=jnp.bfloat16), "page_size"), (dict(block_q=24), "block_q"), (dict(block_q=4), "block_q"),
    (dict(pages_per_block=3), "pages_per_block")])
def test_kernel_refuses_shapes_it_cannot_compile_for(change, knob):
    shape = dict(head_dim=32, page=8, dtype=jnp.float32)
    blocks = {k: change.pop(k) for k in ("block_q", "pages_per_block") if k in change}
    shape.update(change)
    q, k, v, kv_lens, table, cu = make_batch(np.random.default_rng(9), MIXES["decodes"], 4, 2, shape["head_dim"],
                                             shape["dtype"], page=shape["page"])
    with pytest.raises(ValueError, match=knob):
        ragged_paged_attention(q, k, v, kv_lens, table, cu, scale=1.0, **blocks)


def _quantized(pages, dtype):
    from cbjax.models.kv_cache import QuantizedKV, encode

    return encode(pages, QuantizedKV(jnp.zeros((1,), dtype), jnp.zeros((1,), jnp.float32)))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("head_dim,window", [(32, 0), (80, 9)])
def test_kernels_read_8bit_kv_with_scales(kernel, kv_dtype, head_dim, window):
    """8-bit pages with a scale per key: the kernel equals its reference on the same 8-bit
    pages (the reference dequantizes, the kernel scales logits and probabilities), and the
    quantization error against f32 pages stays small. A TPU runs the reference for them."""
    from cbjax.models.kv_cache import decode

    rng = np.random.default_rng(11)
    q, k, v, kv_lens, table, cu = make_batch(rng, MIXES["mixed"], 8, 2, head_dim, jnp.float32, page=16)
    k8, v8 = _quantized(k, kv_dtype), _quantized(v, kv_dtype)
    assert k8.values.dtype == kv_dtype and k8.scale.shape == k.shape[:3] + (1,)
    valid = int(cu[-1])
    ref = reference(q, k8, v8, kv_lens, table, cu, head_dim ** -0.5, window=window)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(reference(q, decode(k8), decode(v8), kv_lens, table, cu,
                                                                        head_dim ** -0.5, window=window)))
    out = ragged_paged_attention(q, k8, v8, kv_lens, table, cu, scale=head_dim ** -0.5, window=window,
                                 interpret=KERNELS[kernel])
    np.testing.assert_allclose(np.asarray(out)[:valid], np.asarray(ref)[:valid], rtol=2e-5, atol=2e-5)
    exact = reference(q, k, v, kv_lens, table, cu, head_dim ** -0.5, window=window)
    error = np.abs(np.asarray(ref)[:valid] - np.asarray(exact)[:valid]).max()
    assert 0 < error < (0.05 if kv_dtype == jnp.int8 else 0.25), error


def test_kernel_refuses_8bit_pages_below_16_keys():
    q, k, v, kv_lens, table, cu = make_batch(np.random.default_rng(3), MIXES["decodes"], 4, 2, 32, jnp.float32,
                                             page=8)
    with pytest.raises(ValueError, match="page_size a power of two >= 16 for int8 KV"):
        ragged_paged_attention(q, _quantized(k, jnp.int8), _quantized(v, jnp.int8), kv_lens, table, cu, scale=1.0)


# Split-KV: GQA groups 1 to 8 (and an odd one), head sizes that are not powers of two, windows,
# 8-bit and bf16 KV; a long decode row beside the mixes so that every split has keys to walk.
SPLIT_CASES = [((8, 8), 32, 0, jnp.float32), ((8, 4), 32, 0, jnp.float32), ((8, 2), 80, 9, jnp.float32),
               ((8, 1), 96, 0, jnp.float32), ((6, 2), 64, 16, jnp.float32), ((8, 1), 128, 0, jnp.bfloat16),
               ((8, 2), 32, 0, jnp.int8), ((8, 2), 80, 9, jnp.float8_e4m3fn)]


@pytest.mark.parametrize("heads,head_dim,window,dtype", SPLIT_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("kv_splits", sweep([2, 3, 8], quick={2, 8}))
def test_split_kv_matches_reference(heads, head_dim, window, dtype, kv_splits):
    rng = np.random.default_rng(head_dim * 10 + kv_splits)
    eight_bit = np.dtype(dtype).itemsize == 1
    page = 16 if eight_bit or dtype == jnp.bfloat16 else PAGE
    seqs = MIXES["mixed"] + [(1, 120), (3, 97)]
    q, k, v, kv_lens, table, cu = make_batch(rng, seqs, *heads, head_dim,
                                             jnp.float32 if eight_bit else dtype, pages_per_seq=16, page=page)
    if eight_bit:
        k, v = _quantized(k, dtype), _quantized(v, dtype)
    valid, scale = int(cu[-1]), head_dim ** -0.5
    ref = np.asarray(reference(q, k, v, kv_lens, table, cu, scale, window=window), np.float32)
    out = ragged_paged_attention(q, k, v, kv_lens, table, cu, scale=scale, window=window, kv_splits=kv_splits,
                                 pages_per_block=1, interpret=True)
    assert out.dtype == q.dtype
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(out, np.float32)[:valid], ref[:valid], rtol=tolerance, atol=tolerance)


def test_split_kv_splits_the_keys(monkeypatch):
    """Each split walks its own span: for one decode row over 8 blocks in 4 splits, every split's
    sum of exponentials is a part of the whole (none sees all keys, none is empty), and the
    combine of those parts is the reference."""
    from pallas_kernels.ragged_paged_attention import triton_kernel

    seen = {}
    original = triton_kernel.combine_splits
    monkeypatch.setattr(triton_kernel, "combine_splits", lambda o, m, l: seen.update(m=m, l=l) or original(o, m, l))
    q, k, v, kv_lens, table, cu = make_batch(np.random.default_rng(5), [(1, 64)], 4, 4, 32, jnp.float32,
                                             extra_rows=0)
    out = triton_kernel.attention(q, k, v, kv_lens, table, cu, scale=0.2, block_q=16, pages_per_block=2,
                                  interpret=True, kv_splits=4)  # not under jit: the partials are seen as values
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference(q, k, v, kv_lens, table, cu, 0.2)), rtol=2e-5,
                               atol=2e-5)
    m, l = np.asarray(seen["m"])[:, 0], np.asarray(seen["l"])[:, 0]  # [splits, kv_heads, group] of the row
    whole = (l * np.exp(m - m.max(axis=0))).sum(axis=0)
    parts = l * np.exp(m - m.max(axis=0))
    assert np.all(parts > 0) and np.all(parts < whole * 0.99)


def test_tuned_launch_is_what_a_call_without_settings_runs(monkeypatch):
    """A launch this process's tuning chose for a shape is the one a call with no settings runs;
    a call naming any setting, or another shape, keeps the defaults."""
    from pallas_kernels import tuning
    from pallas_kernels.ragged_paged_attention import KERNEL, Launch, candidates, shape_of, triton_kernel

    seen = []
    original = triton_kernel.attention
    monkeypatch.setattr(triton_kernel, "attention", lambda *a, **kw: seen.append(kw) or original(*a, **kw))
    q, k, v, kv_lens, table, cu = make_batch(np.random.default_rng(6), MIXES["decodes"], 8, 2, 32, jnp.float32)
    launches = candidates(32, PAGE, table.shape[1])
    assert len(launches) >= 8 and {launch.kv_splits for launch in launches} == {1, 2, 4, 8}
    assert all(Launch.parse(launch.name) == launch for launch in launches)
    tuning.forget()
    try:
        tuning.use(KERNEL, shape_of(q, k, table, 0), Launch(kv_splits=4, pages_per_block=2).name)
        ragged_paged_attention(q, k, v, kv_lens, table, cu, scale=0.2, interpret=True)
        assert (seen[-1]["kv_splits"], seen[-1]["pages_per_block"]) == (4, 2)
        ragged_paged_attention(q, k, v, kv_lens, table, cu, scale=0.2, interpret=True, num_warps=4)
        assert seen[-1]["kv_splits"] == 1
        ragged_paged_attention(q[:4], k, v, kv_lens, table, cu, scale=0.2, interpret=True)
        assert seen[-1]["kv_splits"] == 1
    finally:
        tuning.forget()


def test_split_kv_refuses_nonsense():
    q, k, v, kv_lens, table, cu = make_batch(np.random.default_rng(4), MIXES["decodes"], 4, 2, 32, jnp.float32)
    with pytest.raises(ValueError, match="kv_splits"):
        ragged_paged_attention(q, k, v, kv_lens, table, cu, scale=1.0, kv_splits=0, interpret=True)
