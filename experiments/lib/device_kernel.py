"""bench_device.py's attention kernel sections, each against a figure of the same run:
- kernel: the ragged attention kernel against its pure-JAX reference on the real platform
  (head sizes 64/80/96/128, f32 and bf16, decodes beside prefill chunks, sliding windows);
- kernel_bw: the kernel's KV bandwidth (live K/V bytes over its time) on a mixed batch (32
  decodes at 1,000-4,000 tokens beside two 256-token prefill chunks), on 64 decodes at 2,048
  and 4,096 tokens and on one 4,096-token decode, for two page sizes, several keys per step and
  split-KV at 2-16 splits, against the copy; on a GPU also every Mosaic GPU launch the engine's
  tuning would time for the batch (decode batches as decode calls: one row a sequence).
"""

from __future__ import annotations

import functools

from experiments.lib.device_common import FLAGS, timed_ms
from experiments.lib.device_copy import suspect


def kernel_cases() -> list[dict]:
    if FLAGS.tiny:
        return [dict(head_dim=16, dtype="float32", page=8, mix="mixed", window=0),
                dict(head_dim=24, dtype="float32", page=8, mix="mixed", window=20)]
    cases = []
    for head_dim in (64, 80, 96, 128):
        for dtype, page in (("float32", 8), ("bfloat16", 16)):
            cases.append(dict(head_dim=head_dim, dtype=dtype, page=page, mix="decodes", window=0))
            cases.append(dict(head_dim=head_dim, dtype=dtype, page=page, mix="mixed", window=48))
    return cases


def kernel_batch(rng, seqs, q_heads, kv_heads, head_dim, dtype, page):
    """A ragged batch for `seqs` [(q_len, kv_len)]: shuffled pages, random q/k/v on the device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    pages_per_seq = max(-(-kv // page) for _, kv in seqs)
    num_pages = len(seqs) * pages_per_seq
    table = rng.permutation(num_pages).reshape(len(seqs), pages_per_seq).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    q = jax.random.normal(keys[0], (int(cu[-1]), q_heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (kv_heads, num_pages, page, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (kv_heads, num_pages, page, head_dim), jnp.float32).astype(dtype)
    lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    return q, k, v, lens, jnp.asarray(table), jnp.asarray(cu)


def kernel_check() -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference

    interpret = jax.default_backend() == "cpu"
    rng = np.random.default_rng(0)
    rows = []
    for case in kernel_cases():
        seqs = ([(1, int(n)) for n in rng.integers(1, 300 if not FLAGS.tiny else 40, 12)] if case["mix"] == "decodes"
                else [(1, 200), (37, 37), (16, 120), (1, 1), (60, 300), (1, 64)] if not FLAGS.tiny
                else [(1, 30), (7, 7), (5, 21)])
        args = kernel_batch(rng, seqs, 32 if not FLAGS.tiny else 4, 8 if not FLAGS.tiny else 2, case["head_dim"],
                            jnp.dtype(case["dtype"]), case["page"])
        scale = case["head_dim"] ** -0.5
        out = ragged_paged_attention(*args, scale=scale, window=case["window"], interpret=interpret)
        ref = reference(*(a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in args), scale,
                        window=case["window"])
        rows.append(_checked(case, out, ref))
        if not interpret and case["dtype"] == "bfloat16" and case["head_dim"] % 64 == 0:  # its Mosaic GPU form
            call = (*args[:5], None if case["mix"] == "decodes" else args[5])
            out = ragged_paged_attention(*call, scale=scale, window=case["window"], form="mosaic")
            rows.append(_checked({**case, "form": "mosaic"}, out, ref))
    return rows


def _checked(case: dict, out, ref) -> dict:
    """`case`'s row: the kernel's largest error against the reference, relative to the output."""
    import numpy as np

    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    error = float(np.abs(out - ref).max() / np.abs(ref).max())
    tolerance = 5e-3 if case["dtype"] == "float32" else 3e-2  # tf32 / bf16 operands
    return {**case, "rel_error": error, "ok": bool(np.isfinite(error) and error < tolerance)}


def _timed(variant: dict, fn, args, live: int, copy_GBps: float) -> dict:
    """`variant`'s row: `fn(*args)` timed, the live KV bytes over that time (or the error)."""
    try:
        ms = timed_ms(fn, *args)
    except Exception as e:  # a tile too large for this device's shared memory, a ptxas refusal
        return {**variant, "error": str(e)[:200]}
    return {**variant, "ms": ms, "GBps": live / ms / 1e6, "of_copy": live / ms / 1e6 / copy_GBps}


def kernel_variants(group: int) -> list[tuple]:
    """(keys per step, block_q, num_stages, kv_splits) to time, None for the kernel's own choice:
    the default first, then wider steps, the smallest query tile (block_q x group = 16 rows: a
    decode wastes no rows), deeper pipelining, and split-KV (2 to 16 programs a tile's keys)."""
    if FLAGS.tiny:
        return [(None, None, None, None), (16, max(16 // group, 1), None, None), (None, None, None, 2)]
    least = max(16 // group, 1)
    return [(None, None, None, None), (128, None, 2, None), (256, None, 2, None), (None, least, 2, None),
            (None, least, 3, None), (128, least, 3, None), (None, None, None, 2), (None, None, None, 4),
            (None, None, None, 8), (None, None, None, 16), (128, None, 2, 4), (128, None, 2, 8), (None, least, 2, 8)]


def kernel_bandwidth(copy_GBps: float) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    interpret = jax.default_backend() == "cpu"
    rng = np.random.default_rng(1)
    heads = (32, 8, 128) if not FLAGS.tiny else (4, 2, 16)
    big = not FLAGS.tiny
    batches_ = {
        "mixed": [(1, int(n)) for n in rng.integers(1000, 4001, 32)] + [(256, 2048), (256, 1280)] if big
        else [(1, 40), (1, 64), (16, 48)],
        "decode-2048": [(1, 2048)] * 64 if big else [(1, 64)] * 4,
        "decode-4096": [(1, 4096)] * 64 if big else [(1, 128)] * 4,
        "single-4096": [(1, 4096)] if big else [(1, 128)],  # one sequence: what split-KV is for
    }
    rows = []
    for name, seqs in batches_.items():
        for page in ((16, 64) if big else (8,)):
            args = kernel_batch(rng, seqs, *heads, jnp.bfloat16 if big else jnp.float32, page)
            live = sum(kv for _, kv in seqs) * heads[1] * heads[2] * args[1].dtype.itemsize * 2
            for keys, block_q, stages, splits in kernel_variants(heads[0] // heads[1]):
                per_block = max(keys // page, 1) if keys else None
                fn = jax.jit(functools.partial(ragged_paged_attention, scale=0.1, pages_per_block=per_block,
                                               block_q=block_q, num_stages=stages, kv_splits=splits or 1,
                                               interpret=interpret))
                variant = {"batch": name, "page": page, "keys_per_step": keys or "auto", "block_q": block_q or "auto",
                           "num_stages": stages or "auto", "kv_splits": splits or 1}
                rows.append(_timed(variant, fn, args, live, copy_GBps))
            if not interpret:  # Mosaic GPU (its interpreter is JAX >= 0.11's, and slow): the tuning's launches
                rows += mosaic_rows(args, name, page, live, copy_GBps)
            del args
    return rows


def mosaic_rows(args, name: str, page: int, live: int, copy_GBps: float) -> list[dict]:
    """The Mosaic GPU launches the engine's tuning would time for this batch, each timed."""
    import jax

    from pallas_kernels.ragged_paged_attention import kernel as attention_kernel

    decode = not name.startswith("mixed")  # every sequence one row: a decode call
    call = (*args[:5], None if decode else args[5])
    rows = []
    for launch in attention_kernel.mosaic_candidates(attention_kernel.shape_of(args[0], args[1], args[4], 0, decode)):
        fn = jax.jit(functools.partial(attention_kernel.ragged_paged_attention, scale=0.1, form="mosaic",
                                       pages_per_block=launch.pages_per_block, num_stages=launch.num_stages,
                                       kv_splits=launch.kv_splits))
        variant = {"batch": name, "page": page, "form": "mosaic", "keys_per_step": launch.pages_per_block * page,
                   "block_q": "-", "num_stages": launch.num_stages, "kv_splits": launch.kv_splits}
        rows.append(_timed(variant, fn, call, live, copy_GBps))
    return rows


def kernel_lines(results: dict, line) -> None:
    """The kernel sections' lines of bench_device's table."""
    for r in results.get("kernel", []):
        line("kernel", f"{r.get('form', 'triton')} hd{r['head_dim']} {r['dtype']} page{r['page']} {r['mix']} "
             f"w{r['window']}",
             f"rel err {r['rel_error']:.1e} {'ok' if r['ok'] else 'FAIL'}")
    for r in results.get("kernel_bw", []):
        figure = (f"{r['ms']:.3f} ms {r['GBps']:.0f} GB/s ({suspect(r['of_copy'], 'copy')})" if "ms" in r
                  else "error")
        line("kernel_bw", f"{r.get('form', 'triton')} {r['batch']} p{r['page']} k{r['keys_per_step']} "
             f"q{r['block_q']} s{r['num_stages']} "
             f"x{r.get('kv_splits', 1)}", figure)
