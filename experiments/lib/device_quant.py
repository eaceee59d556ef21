"""bench_device.py's quantization sections: what int8 and fp8 weights buy a decode step.

- quant_matmul: one layer's matmul shapes of a Llama-3-8B (and its LM head) at 1, 16 and 64
  rows, bf16 (XLA's dot, the Pallas kernel's Triton default and its Mosaic GPU form) against each
  way of multiplying by 8-bit weights: XLA's (`cbjax.models.quant.dense`, widened inside a
  dot), the Pallas kernel (pallas_kernels/decode_matmul; at --sweep_rows its launch settings
  swept over its tuning space), fp8 also as a native fp8 x fp8 dot with the
  activations scaled per row; each checked against the dequantized f32 product; time and
  weight bytes per second against the copy bandwidth.
- quant_8b: the Llama-3-8B-shaped engine (slots/auto, the default) decoding at each batch
  with bf16, int8 and fp8 weights (the Pallas matmul, the engine's default on a GPU) and int8
  through XLA's dot: ms per step, against the bf16 step of the same run and
  against (weight bytes + live KV bytes) / copy bandwidth. (Matrix-vector products written as
  reductions instead of dots ran the same on an H200: dropped, docs/code_measurements.md.)
  A quantization the device refuses (fp8 without fp8 dots) is reported as refused.
"""

from __future__ import annotations

import time

from absl import flags

from experiments.lib.device_common import (FLAGS, LLAMA3_8B, TINY, batches, budget, build_engine, decode_shape, decode_steps,
                           device_model, timed_ms)
from experiments.lib.device_copy import suspect

# (row, quantization, quantized_matmul): the bf16 baseline first, XLA's int8 dot last
# "int8 1-row buckets": decode steps compiled down to one row (an accelerator's smallest bucket is
# 16 rows otherwise), where the kernel runs its one-row form instead of the 16-row dot.
ENGINES = (("none", "none", "auto", {}), ("int8", "int8", "auto", {}), ("fp8", "fp8", "auto", {}),
           ("int8 xla", "int8", "xla", {}), ("int8 1-row buckets", "int8", "auto", {"min_step_tokens": 1}))
flags.DEFINE_bool("sweep_matmul", True, "quant_matmul: sweep the Pallas kernel's launch settings at --sweep_rows "
                  "(int8); quant_8b then runs the fastest.")
# An engine's decode step on an accelerator has at least 16 rows (engine_config.DEFAULT_MIN_STEP_TOKENS):
# a sweep at one row tunes a form the engine never runs there.
flags.DEFINE_integer("sweep_rows", 16, "quant_matmul: rows the launch sweep runs at (one of --batches).", lower_bound=1)
flags.DEFINE_float("matmul_budget_s", 100.0, "quant_matmul: start no further form past this many seconds.")
flags.DEFINE_list("quant_engines", [e[0] for e in ENGINES], "quant_8b: the engine rows to run, of "
                  + ", ".join(e[0] for e in ENGINES) + " (the first is the baseline of vs_bf16).")
CHAIN = 8  # distinct weights a timed program multiplies by in turn (their bytes far past L2), as layers do
# How often a layer of Llama-3-8B multiplies by each case's shape: the weights of the sweep's pick.
LAYER_COUNTS = {"w_up": 2, "w_down": 1, "wq": 2, "wk": 2}


def _quantized(ws: list) -> dict:
    """mode -> (the chained weights `ws` in that mode, the first of them exact in f32), for the
    8-bit modes this device runs; once per matrix, whatever the rows and forms timed."""
    import jax
    import jax.numpy as jnp

    from cbjax.experimental import quant

    out = {}
    for mode in ("int8", "fp8"):
        if mode == "fp8" and quant.fp8_refusal(jax.devices()[0]):
            continue
        qs = [quant.quantize(w, mode) for w in ws]
        out[mode] = (qs, qs[0].dequantize(jnp.float32))
    return out


def _matmul_forms(ws: list, quantized: dict, rows: int) -> dict:
    """name -> (function of (x, weights), the weights, bytes of one, the first exact in f32 or
    None, the launch or None) for the chained weights `ws` (one shape, the model's dtype) and
    their `_quantized` forms."""
    import jax.numpy as jnp

    from cbjax.experimental import quant
    from pallas_kernels.decode_matmul import Launch, candidates, decode_matmul

    def chain(product):
        return lambda x, weights: sum(product(x, w) for w in weights)

    mosaic = ws[0].dtype in (jnp.bfloat16, jnp.float16)  # its activations' dtypes (the tiny run's are f32)
    forms = {"bf16 dot": (chain(lambda x, w: jnp.einsum("bd,od->bo", x, w)), ws, ws[0].nbytes, None, None),
             "bf16 pallas": (chain(lambda x, w: decode_matmul(x, w)), ws, ws[0].nbytes, None, None)}
    if mosaic:
        forms["bf16 mosaic"] = (chain(lambda x, w: decode_matmul(x, w, launch=Launch(form="mosaic"))), ws,
                                ws[0].nbytes, None, None)
    for mode, (qs, exact) in quantized.items():
        forms[f"{mode} xla"] = (chain(quant.dense), qs, qs[0].nbytes, exact, None)
        sweep = rows == (FLAGS.sweep_rows if not FLAGS.tiny else 4) and mode == "int8" and FLAGS.sweep_matmul
        launches = [launch for launch in candidates(rows, groups=qs[0].scale.shape[1])
                    if mosaic or launch.form != "mosaic"]
        for launch in launches if sweep else [None]:
            product = (lambda x, w, launch=launch: decode_matmul(x, w.values, w.scale, launch=launch))
            name = f"{mode} pallas" + (f" {launch.name}" if launch else "")
            forms[name] = (chain(product), qs, qs[0].nbytes, exact, launch)
    return forms


def quant_matmul(copy_GBps: float, deadline: float) -> dict:
    """Per case x rows x form: ms per product (a chain of CHAIN distinct weights in one program,
    so a launch's host overhead is not counted), bandwidth, error; and `best`, the swept launch
    with the least LAYER_COUNTS-weighted time at --sweep_rows."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = LLAMA3_8B if not FLAGS.tiny else TINY
    d, inter = shape["hidden_size"], shape["intermediate_size"]
    cases = {"w_up": (inter, d), "w_down": (d, inter), "wq": (d, d), "wk": (shape["num_kv_heads"] * 128, d),
             "lm_head": (shape["vocab_size"], d)}
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    stop = min(deadline, time.perf_counter() + FLAGS.matmul_budget_s)
    rows_out, weighted = [], {}
    for name, (out_dim, in_dim) in cases.items():
        chained = CHAIN if name != "lm_head" else 2
        keys = jax.random.split(jax.random.key(out_dim + in_dim), chained)
        ws = [(jax.random.normal(k, (out_dim, in_dim), jnp.float32) * 0.02).astype(dtype) for k in keys]
        quantized = _quantized(ws)
        for rows in batches():
            x = jax.random.normal(jax.random.key(rows), (rows, in_dim), jnp.float32).astype(dtype)
            wants = {}  # the exact product of each mode's first weight, once per rows
            for form, (fn, weights, nbytes, exact, launch) in _matmul_forms(ws, quantized, rows).items():
                row = {"matrix": name, "shape": [out_dim, in_dim], "rows": rows, "form": form}
                if time.perf_counter() > stop:
                    rows_out.append({**row, "skipped": "past --matmul_budget_s"})
                    continue
                try:
                    f = jax.jit(fn)
                    ms = timed_ms(f, x, weights, reps=10) / chained
                    row.update(ms=ms, GBps=nbytes / ms / 1e6, of_copy=nbytes / ms / 1e6 / copy_GBps)
                    if exact is not None:
                        if id(exact) not in wants:
                            wants[id(exact)] = np.asarray(x.astype(jnp.float32) @ exact.T)
                        want = wants[id(exact)]
                        got = np.asarray(jax.jit(fn)(x, weights[:1]), np.float32)
                        row["rel_error"] = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
                except Exception as e:  # a form or setting this backend cannot lower
                    rows_out.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                rows_out.append(row)
                if launch is not None and name in LAYER_COUNTS and row["rel_error"] < 1e-2:
                    weighted.setdefault(launch, {})[name] = LAYER_COUNTS[name] * ms
        del ws, quantized
    layer_ms = {k: sum(v.values()) for k, v in weighted.items() if len(v) == len(LAYER_COUNTS)}
    best = min(layer_ms, key=layer_ms.get) if layer_ms else None
    return {"rows": rows_out, "best": dataclasses.asdict(best) if best else None,
            "best_name": best.name if best else None,
            "layer_ms": {k.name: v for k, v in layer_ms.items()}}


def quant_8b(copy_GBps: float, deadline: float, launch: dict | None = None) -> dict:
    """The 8B engine per ENGINES row; the Pallas matmul with `launch` (quant_matmul's pick) if given."""
    from pallas_kernels.decode_matmul import Launch, set_default_launch

    previous = set_default_launch(Launch(**launch)) if launch else None
    try:
        return _quant_engines(copy_GBps, deadline) | {"launch": launch}
    finally:
        if previous is not None:
            set_default_launch(previous)


def _quant_engines(copy_GBps: float, deadline: float) -> dict:
    import dataclasses

    import jax

    from cbjax.experimental import profile, quant

    model = device_model(LLAMA3_8B if not FLAGS.tiny else TINY)
    max_seq_len = budget(*decode_shape(), 1)
    rows, skipped = [], []
    for label, mode, matmul, options in [e for e in ENGINES if e[0] in FLAGS.quant_engines]:
        if time.perf_counter() > deadline:
            skipped.append(label)
            continue
        refusal = quant.fp8_refusal(jax.devices()[0]) if mode == "fp8" else None
        if refusal:
            rows.append({"engine": label, "refused": refusal})
            continue
        llm, startup = build_engine(model, "slots", "auto", max(batches()), max_seq_len, quantization=mode,
                                    quantized_matmul=matmul, **options, max_step_tokens=256 if not FLAGS.tiny else 32)
        with profile.engine_lent(llm) as engine:  # the quantized weights the engine holds
            quantized = dataclasses.replace(model, params=engine.params)
        row = {"engine": label, "startup_s": startup, "weights_GB": quant.weight_bytes(quantized.params) / 1e9,
               "ops": llm.engine_info.ops, "steps": decode_steps(llm, quantized, copy_GBps)}
        if rows and "steps" in rows[0]:  # the first row is the baseline
            for batch, step in row["steps"].items():
                step["vs_bf16"] = rows[0]["steps"][batch]["ms"] / step["ms"]
        rows.append(row)
        del llm, quantized
    return {"rows": rows, "skipped": skipped}


def table_lines(results: dict, line) -> None:
    """The quantization sections' lines of bench_device's table."""
    matmul = results.get("quant_matmul", {})
    for r in matmul.get("rows", []):
        if "skipped" in r:
            line("quant_mm", f"{r['matrix']} x{r['rows']} {r['form']}", "skipped (past --matmul_budget_s)")
            continue
        case = f"{r['matrix']} x{r['rows']} {r['form']}"
        figure = (f"{1e3 * r['ms']:.0f} us {r['GBps']:.0f} GB/s ({suspect(r['of_copy'], 'copy')})"
                  + (f" err {r['rel_error']:.0e}" if "rel_error" in r else "") if "ms" in r else "error")
        line("quant_mm", case, figure)
    if matmul.get("best_name"):
        line("quant_mm", "pick (weighted by a layer's uses)", matmul["best_name"])
    decode = results.get("quant_8b", {})
    for row in decode.get("rows", []):
        if "refused" in row:
            line("quant_8b", row["engine"], "refused (see JSON)")
            continue
        line("quant_8b", f"{row['engine']} weights, start-up", f"{row['weights_GB']:.1f} GB, {row['startup_s']:.0f} s")
        for batch, s in row["steps"].items():
            vs = f", {s['vs_bf16']:.2f}x bf16" if "vs_bf16" in s else ""
            line("quant_8b", f"{row['engine']} batch {batch}",
                 f"{s['ms']:.2f} ms ({suspect(s['of_roofline'])}{vs})")
    for name in decode.get("skipped", []):
        line("quant_8b", name, "skipped (past --budget_s)")
