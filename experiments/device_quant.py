"""bench_device.py's quantization sections: what int8 and fp8 weights buy a decode step.

- quant_matmul: one layer's matmul shapes of a Llama-3-8B (and its LM head) at 1, 16 and 64
  rows, bf16 against each way of multiplying by 8-bit weights: XLA's (`cbjax.models.quant.dense`,
  widened inside a dot), the Pallas kernel (pallas_kernels/quantized_matmul; at one row its
  launch settings swept around its own choice), fp8 also as a native fp8 x fp8 dot with the
  activations scaled per row; each checked against the dequantized f32 product; time and
  weight bytes per second against the copy bandwidth.
- quant_8b: the Llama-3-8B-shaped engine (slots/auto, the default) decoding at each batch
  with bf16, int8 and fp8 weights (the Pallas matmul, the engine's default on a GPU) and int8
  through XLA's dot: ms per step, against the bf16 step of the same run and
  against (weight bytes + live KV bytes) / copy bandwidth. (Matrix-vector products written as
  reductions instead of dots ran the same, 5.09 vs 5.10 ms for int8 on an H200: dropped.)
  A quantization the device refuses (fp8 without fp8 dots) is reported as refused.
"""

from __future__ import annotations

import time

from device_common import (FLAGS, LLAMA3_8B, TINY, batches, budget, build_engine, decode_shape, decode_steps,
                           device_model, timed_ms)

# (row, quantization, quantized_matmul): the bf16 baseline first, XLA's int8 dot last
ENGINES = (("none", "none", "auto"), ("int8", "int8", "auto"), ("fp8", "fp8", "auto"), ("int8 xla", "int8", "xla"))


def _native_fp8(x, w):
    """fp8 x fp8 -> f32 dot: x scaled per row into e4m3, the weight's own e4m3 values."""
    import jax
    import jax.numpy as jnp

    peak = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    x_scale = jnp.where(peak > 0, peak / 448.0, 1.0)
    x8 = (x.astype(jnp.float32) / x_scale).astype(jnp.float8_e4m3fn)
    y = jax.lax.dot_general(x8, w.values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * x_scale * w.scale).astype(x.dtype)


def _kernel_settings(out_dim: int, in_dim: int, groups: int) -> list[dict]:
    """The Pallas kernel's launch settings swept at one row: its own choice first, then block_n
    x splits around it, and 8 warps / 3 stages at its choice."""
    from pallas_kernels.quantized_matmul import block_sizes

    block_n, block_k, splits = block_sizes(out_dim, in_dim, groups)
    steps = in_dim // block_k
    settings = [{}]
    for n in (32, 64, 128):
        for sp in (splits // 2, splits, splits * 2):
            if sp >= 1 and out_dim % n == 0 and steps % sp == 0 and (n, sp) != (block_n, splits):
                settings.append(dict(block_n=n, splits=sp))
    return settings + [dict(num_warps=8), dict(num_stages=3)]


def _matmul_forms(w, rows: int) -> dict:
    """name -> (function of x, weight bytes, the exact f32 weight or None) for one weight."""
    import functools

    import jax
    import jax.numpy as jnp

    from cbjax.models import quant
    from pallas_kernels.quantized_matmul import quantized_matmul

    forms = {"bf16 dot": (lambda x, w=w: jnp.einsum("bd,od->bo", x, w), w.nbytes, None)}
    for mode in ("int8", "fp8"):
        if mode == "fp8" and quant.fp8_refusal(jax.devices()[0]):
            continue
        qw = quant.quantize(w, mode)
        exact = qw.dequantize(jnp.float32)
        forms[f"{mode} xla"] = (lambda x, qw=qw: quant.dense(x, qw), qw.nbytes, exact)
        settings = _kernel_settings(*qw.values.shape, qw.scale.shape[1]) if rows == 1 and mode == "int8" else [{}]
        for setting in settings:
            name = f"{mode} pallas" + "".join(f" {k[:7]}={v}" for k, v in setting.items())
            kernel = functools.partial(quantized_matmul, **setting)
            forms[name] = (lambda x, qw=qw, kernel=kernel: kernel(x, qw.values, qw.scale), qw.nbytes, exact)
        if mode == "fp8":
            forms["fp8 native"] = (lambda x, qw=qw: _native_fp8(x, qw), qw.nbytes, exact)
    return forms


def quant_matmul(copy_GBps: float, deadline: float) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = LLAMA3_8B if not FLAGS.tiny else TINY
    d, inter = shape["hidden_size"], shape["intermediate_size"]
    cases = {"w_up": (inter, d), "w_down": (d, inter), "wq": (d, d), "lm_head": (shape["vocab_size"], d),
             "wk": (shape["num_kv_heads"] * 128, d)}
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    key = jax.random.key(0)
    rows_out = []
    for name, (out_dim, in_dim) in cases.items():
        w = (jax.random.normal(key, (out_dim, in_dim), jnp.float32) * 0.02).astype(dtype)
        for rows in batches() if FLAGS.tiny else (1, 16, 64):
            if time.perf_counter() > deadline:
                rows_out.append({"matrix": name, "rows": rows, "skipped": "past --budget_s"})
                continue
            x = jax.random.normal(jax.random.fold_in(key, rows), (rows, in_dim), jnp.float32).astype(dtype)
            for form, (fn, nbytes, exact) in _matmul_forms(w, rows).items():
                row = {"matrix": name, "shape": [out_dim, in_dim], "rows": rows, "form": form}
                try:
                    f = jax.jit(fn)
                    ms = timed_ms(f, x, reps=20)
                except Exception as e:  # a form or setting this backend cannot lower
                    rows_out.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                row.update(ms=ms, GBps=nbytes / ms / 1e6, of_copy=nbytes / ms / 1e6 / copy_GBps)
                if exact is not None:
                    want = np.asarray(x.astype(jnp.float32) @ exact.T)
                    got = np.asarray(f(x), np.float32)
                    row["rel_error"] = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
                rows_out.append(row)
        del w
    return rows_out


def quant_8b(copy_GBps: float, deadline: float) -> dict:
    import dataclasses

    import jax

    from cbjax.models import quant

    model = device_model(LLAMA3_8B if not FLAGS.tiny else TINY)
    max_seq_len = budget(*decode_shape(), 1)
    rows, skipped = [], []
    for label, mode, matmul in ENGINES:
        if time.perf_counter() > deadline:
            skipped.append(label)
            continue
        refusal = quant.fp8_refusal(jax.devices()[0]) if mode == "fp8" else None
        if refusal:
            rows.append({"engine": label, "refused": refusal})
            continue
        llm, startup = build_engine(model, "slots", "auto", max(batches()), max_seq_len, quantization=mode,
                                    quantized_matmul=matmul,
                                    max_step_tokens=256 if not FLAGS.tiny else 32)
        quantized = dataclasses.replace(model, params=llm.engine.params)
        row = {"engine": label, "startup_s": startup, "weights_GB": quant.weight_bytes(quantized.params) / 1e9,
               "ops": repr(llm.engine.ops), "steps": decode_steps(llm, quantized, copy_GBps)}
        if rows and "steps" in rows[0]:  # the bf16 baseline ran first
            for batch, step in row["steps"].items():
                step["vs_bf16"] = rows[0]["steps"][batch]["ms"] / step["ms"]
        rows.append(row)
        del llm, quantized
    return {"rows": rows, "skipped": skipped}


def table_lines(results: dict, line) -> None:
    """The quantization sections' lines of bench_device's table."""
    for r in results.get("quant_matmul", []):
        case = f"{r['matrix']} x{r['rows']} {r['form']}"
        figure = (f"{1e3 * r['ms']:.0f} us {r['GBps']:.0f} GB/s ({100 * r['of_copy']:.0f}% of copy)"
                  + (f" err {r['rel_error']:.0e}" if "rel_error" in r else "") if "ms" in r else "error")
        line("quant_mm", case, figure)
    decode = results.get("quant_8b", {})
    for row in decode.get("rows", []):
        if "refused" in row:
            line("quant_8b", row["engine"], "refused (see JSON)")
            continue
        line("quant_8b", f"{row['engine']} weights, start-up", f"{row['weights_GB']:.1f} GB, {row['startup_s']:.0f} s")
        for batch, s in row["steps"].items():
            vs = f", {s['vs_bf16']:.2f}x bf16" if "vs_bf16" in s else ""
            line("quant_8b", f"{row['engine']} batch {batch}",
                 f"{s['ms']:.2f} ms ({100 * s['of_roofline']:.0f}% of roofline{vs})")
    for name in decode.get("skipped", []):
        line("quant_8b", name, "skipped (past --budget_s)")
