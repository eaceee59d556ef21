"""Paged attention, timed: our ragged Pallas kernel (the one the engine's step calls: Triton
on a GPU, Mosaic on a TPU, picked by the platform under JAX's default Pallas settings) vs
JAX's shipped GPU decode kernel vs the XLA reference, and dense attention over a contiguous
cache of the same lengths.

Over a grid of batch sizes, context lengths, page sizes and query tokens per sequence (1: a
decode batch; more: prefill chunks at the end of each context), reports each one's time
and achieved memory bandwidth (K and V bytes read over time) as a fraction of a measured
device-to-device copy. Meant for an accelerator; on a CPU `--interpret` runs a tiny grid in
Pallas interpret mode as a smoke test (its timings mean nothing).

    python -m experiments bench_paged_attention                      # on a GPU or TPU
    python -m experiments bench_paged_attention --interpret --batch_sizes=2 --context_lens=64 --page_sizes=16
"""

from __future__ import annotations

import itertools
import os
import time

from absl import app, flags

from experiments.lib import common

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "8", "32", "128"], "Sequences per call.")
flags.DEFINE_list("context_lens", ["512", "2048", "8192"], "Tokens per sequence (all the same).")
flags.DEFINE_list("page_sizes", ["16", "64"], "Tokens per page.")
flags.DEFINE_integer("q_heads", 32, "Query heads.", lower_bound=1)
flags.DEFINE_integer("kv_heads", 8, "KV heads.", lower_bound=1)
flags.DEFINE_integer("head_dim", 128, "Head dimension.", lower_bound=1)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "K/V and q dtype.")
flags.DEFINE_list("q_lens", ["1"], "Query tokens per sequence (1: decode; more: a prefill chunk ending the context).")
flags.DEFINE_integer("pages_per_block", None, "Our kernel: pages per inner step (default: chosen per shape).",
                     lower_bound=1)
flags.DEFINE_integer("block_q", None, "Our kernel: query tokens per tile (default: chosen per shape).",
                     lower_bound=16)
flags.DEFINE_integer("iters", 20, "Timed calls per measurement.", lower_bound=1)
flags.DEFINE_bool("interpret", False, "Run the Pallas kernels in interpret mode (CPU smoke test).")
flags.DEFINE_string("output_json", "results/bench_paged_attention.json", "Where the results go.")
for _name in ("batch_sizes", "context_lens", "page_sizes", "q_lens"):
    common.validate_list(_name, int, 1, "positive integers")


def timed(fn, *args) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(FLAGS.iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / FLAGS.iters)
    return best


def copy_bandwidth(nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write) of an `nbytes` buffer."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 0)  # one read, one write
    return 2 * x.nbytes / timed(copy, x)


def case(batch, context, page_size, q_len, bandwidth):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference

    dtype = jnp.dtype(FLAGS.dtype)
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    rng = np.random.default_rng(0)
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (batch * q_len, FLAGS.q_heads, FLAGS.head_dim), dtype)
    k_pages = jax.random.normal(kk, (FLAGS.kv_heads, num_pages, page_size, FLAGS.head_dim), dtype)
    v_pages = jax.random.normal(kv, (FLAGS.kv_heads, num_pages, page_size, FLAGS.head_dim), dtype)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    cu_q_lens = jnp.arange(batch + 1, dtype=jnp.int32) * q_len
    scale = FLAGS.head_dim ** -0.5
    kv_bytes = 2 * k_pages.nbytes

    ours = jax.jit(lambda *a: ragged_paged_attention(*a, scale=scale, block_q=FLAGS.block_q,
                                                     pages_per_block=FLAGS.pages_per_block,
                                                     interpret=FLAGS.interpret))
    # JAX's GPU kernel is a decode kernel: one query per sequence.
    theirs = jax.jit(lambda q, k, v, t, n: jax_paged.paged_attention(
        q * scale, k, v, t, n, pages_per_compute_block=min(8, pages_per_seq),
        k_splits=max(1, min(16, pages_per_seq // min(8, pages_per_seq))), interpret=FLAGS.interpret))
    xla = jax.jit(lambda *a: reference(*a, scale))
    # Dense: the same keys laid out contiguously per sequence, [batch, kv_heads, context, hd];
    # causal over the chunk's own tokens.
    k_dense = k_pages[:, tables].reshape(FLAGS.kv_heads, batch, context, -1).swapaxes(0, 1)
    v_dense = v_pages[:, tables].reshape(FLAGS.kv_heads, batch, context, -1).swapaxes(0, 1)

    def dense_attention(q, k, v):
        g = FLAGS.q_heads // FLAGS.kv_heads
        qg = q.reshape(batch, q_len, FLAGS.kv_heads, g, -1)
        s = jnp.einsum("bqkgd,bktd->bkgqt", qg, k, preferred_element_type=jnp.float32) * scale
        seen = jnp.arange(context)[None, :] <= (context - q_len + jnp.arange(q_len))[:, None]
        p = jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1).astype(v.dtype)
        return jnp.einsum("bkgqt,bktd->bqkgd", p, v).reshape(q.shape)

    args = (q, k_pages, v_pages, lengths, tables, cu_q_lens)
    ref = np.asarray(xla(*args), np.float32)
    np.testing.assert_allclose(np.asarray(ours(*args), np.float32), ref, atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(jax.jit(dense_attention)(q, k_dense, v_dense), np.float32), ref,
                               atol=3e-2, rtol=3e-2)
    row = {"batch": batch, "context": context, "page_size": page_size, "q_len": q_len, "kv_bytes": kv_bytes}
    candidates = [("ours", ours, args), ("xla_reference", xla, args),
                  ("dense", jax.jit(dense_attention), (q, k_dense, v_dense))]
    if q_len == 1:
        candidates.insert(1, ("jax_pallas", theirs, (q, k_pages, v_pages, tables, lengths)))
    for name, fn, fargs in candidates:
        try:
            seconds = timed(fn, *fargs)
        except Exception as e:  # a backend that cannot run a peer still reports the rest
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        row[name] = {"us": 1e6 * seconds, "bandwidth_fraction": kv_bytes / seconds / bandwidth}
    return row


def main(argv):
    del argv
    import jax
    from tqdm.auto import tqdm

    from cbjax.experimental import write_json

    if jax.default_backend() == "cpu" and not FLAGS.interpret:
        raise app.UsageError("the Pallas kernels need a GPU or TPU; on a CPU pass --interpret (a smoke test)")
    grid = list(itertools.product(*([int(x) for x in getattr(FLAGS, name)]
                                    for name in ("batch_sizes", "context_lens", "page_sizes", "q_lens"))))
    bandwidth = copy_bandwidth(256 << 20 if not FLAGS.interpret else 1 << 20)
    print(f"device {jax.devices()[0].device_kind}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = [case(*point, bandwidth) for point in tqdm(grid, desc="cases")]
    names = ("ours", "jax_pallas", "xla_reference", "dense")
    print(f"{'batch':>6}{'context':>9}{'page':>6}{'q_len':>6}" + "".join(f"{n + ' us (bw%)':>24}" for n in names))
    for r in rows:
        cells = []
        for n in names:
            m = r.get(n, {"error": "n/a"})
            cells.append(f"{'-':>24}" if "error" in m else f"{m['us']:>15.1f} ({100 * m['bandwidth_fraction']:>4.0f}%)")
        print(f"{r['batch']:>6}{r['context']:>9}{r['page_size']:>6}{r['q_len']:>6}" + "".join(cells))
    if FLAGS.output_json:
        write_json(FLAGS.output_json, {"copy_bandwidth_Bps": bandwidth, "rows": rows,
                                       "interpret": FLAGS.interpret})
        print(f"wrote {os.path.abspath(FLAGS.output_json)}")


if __name__ == "__main__":
    app.run(main)
