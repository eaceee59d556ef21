"""The layer loop, measured: a Python loop over per-layer arrays (unrolled into the program)
against a `lax.scan` over stacked `[layers, ...]` arrays, on this machine's JAX backend.

For each token count (1 and 8 are decode steps, 512 a prefill) it prints the compile time
(lower + compile, no persistent cache) and the median run time of the model's layer stack
(the real layer: norms, q/k/v, RoPE, attention over the step's own tokens, output
projection and MLP; no KV cache, which the engine keeps per layer) with XLA's own matmuls
(XLA's operations in both, not the C++ CPU kernels, so the loop is what differs). The engine's choice
(`forward` in cbjax/models/transformer.py says which and why) follows these numbers.

    python -m experiments bench_layer_loop
    python -m experiments bench_layer_loop --model=smollm2-135m-random --tokens=1,8,512 --dtype=bfloat16
"""

from __future__ import annotations

import time

from absl import app, flags

from experiments.lib import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-random", "A random-weight preset (its shape is what matters).")
flags.DEFINE_list("tokens", ["1", "8", "512"], "Tokens per step (one row each: the engine's flat buffer).")
common.validate_list("tokens", int, 1, "positive integers")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weight and activation dtype.")
flags.DEFINE_integer("repeats", 20, "Timed runs per case (the median is kept).", lower_bound=1)
flags.DEFINE_string("output_json", "results/bench_layer_loop.json", "Where to write the results.")


def layer_fn(config):
    """One layer over `x [N, 1, hidden]` at positions `pos [N]` (tokens see each other causally)."""
    import jax.numpy as jnp

    from cbjax.experimental import attention_part, dense, merge_parts, mlp, norm, rope_inv_freq, rope_tables, visible
    from cbjax.experimental import qkv_projections

    inv_freq = rope_inv_freq(config)

    def layer(x, p, pos):
        cos, sin = rope_tables(pos[:, None], inv_freq)
        q, k, v = qkv_projections(x, p, config, cos, sin)
        mask = visible(pos[:, None], pos[None, :], 0)
        part = attention_part(q[:, 0][None], k[:, 0][None].swapaxes(1, 2), v[:, 0][None].swapaxes(1, 2),
                              mask[None], q.shape[-1] ** -0.5)
        out = merge_parts([part], q[:, 0][None].shape, q.dtype)[0][:, None]
        x = x + dense(out.reshape(x.shape[0], 1, -1), p["wo"], p.get("bo"))
        return x + mlp(norm(x, p["mlp_norm"], config), p, config)

    del jnp
    return layer


def measure(fn, args) -> tuple[float, float]:
    import jax
    import numpy as np

    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    runs = []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        runs.append(time.perf_counter() - t0)
    return compile_s, float(np.median(runs))


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cbjax.experimental import compile_cache, load_preset

    compile_cache.enable("off")  # compile times are the point: nothing read back
    model = load_preset(FLAGS.model, dtype=FLAGS.dtype, with_tokenizer=False)
    config = model.config
    layers = model.params["layers"]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    layer = layer_fn(config)

    def unrolled(x, layers, pos):
        for p in layers:
            x = layer(x, p, pos)
        return x

    def scanned(x, stacked, pos):
        return jax.lax.scan(lambda x, p: (layer(x, p, pos), None), x, stacked)[0]

    rows = []
    print(f"{jax.default_backend()}, {FLAGS.model} ({config.num_layers} layers), {FLAGS.dtype}")
    print(f"{'tokens':>6} {'unrolled compile':>17} {'scanned compile':>16} {'unrolled run':>13} {'scanned run':>12}"
          f" {'run scanned/unrolled':>21}")
    for n in map(int, FLAGS.tokens):
        x = jnp.asarray(np.random.default_rng(n).normal(size=(n, 1, config.hidden_size)), jnp.dtype(FLAGS.dtype))
        pos = jnp.arange(n, dtype=jnp.int32)
        unrolled_c, unrolled_r = measure(unrolled, (x, layers, pos))
        scanned_c, scanned_r = measure(scanned, (x, stacked, pos))
        rows.append({"tokens": n, "unrolled_compile_s": unrolled_c, "scanned_compile_s": scanned_c,
                     "unrolled_run_ms": 1000 * unrolled_r, "scanned_run_ms": 1000 * scanned_r})
        print(f"{n:>6} {unrolled_c:>16.2f}s {scanned_c:>15.2f}s {1000 * unrolled_r:>11.2f}ms "
              f"{1000 * scanned_r:>10.2f}ms {scanned_r / unrolled_r:>20.2f}x", flush=True)
        common.release_programs()
    common.write_json({"backend": jax.default_backend(), "model": FLAGS.model, "dtype": FLAGS.dtype, "rows": rows},
                      FLAGS.output_json)


if __name__ == "__main__":
    app.run(main)
