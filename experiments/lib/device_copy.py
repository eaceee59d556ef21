"""The memory roofline of experiments/benchmarks/bench_device.py: the device's HBM bandwidth measured the
ways the hardware allows, the best of them kept, beside the vendor's nominal figure.

One XLA elementwise op over 1 GiB (`a * 2.0`, the bench's only method before) moved 2.64 TB/s
on an H200 whose HBM sustains 4.2 TB/s under torch's `copy_`: a roofline 1.6x too low made every
"% of roofline" read 1.6x high. So several methods, each counting the bytes it reads and
writes: XLA's scale into a new buffer and into a donated one, XLA's read-only sum, a Pallas
copy kernel with wide blocks (each block size of a small sweep), and torch's `copy_` in a
subprocess when torch imports (before this process's JAX takes the device's memory, where
it can). Every method's figure goes into the JSON; a step "above 100% of the roofline" is then
a sign that the roofline is wrong, and the table says so instead of reading it as success.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from experiments.lib.common import suspect  # noqa: F401  (re-exported for the device sections)
from experiments.lib.device_common import timed_ms

# Nominal HBM bandwidth by device kind (vendors' data sheets), bytes/s: matched by substring.
NOMINAL = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
           ("A100 80GB", 2.039e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12),
           ("TPU v5 lite", 0.819e12), ("TPU v5e", 0.819e12), ("TPU v5p", 2.765e12), ("TPU v4", 1.2e12),
           ("TPU v6", 1.64e12))
BLOCK_ROWS = (4, 8, 16)  # the Pallas copy's blocks: rows of 1,024 f32 (16 to 64 KB, a few registers a thread)


def nominal_GBps(device_kind: str) -> float | None:
    for name, bytes_per_s in NOMINAL:
        if name.lower() in device_kind.lower():
            return bytes_per_s / 1e9
    return None


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def pallas_copy(x, block_rows: int, interpret: bool = False):
    """`x` ([rows, 1024]) copied by a Pallas kernel, one program per `block_rows` rows."""
    import jax
    from jax.experimental import pallas as pl

    rows, cols = x.shape
    spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
    return pl.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(rows // block_rows,),
                          in_specs=[spec], out_specs=spec, interpret=interpret)(x)


def reference_copy(x):
    """The pure-JAX reference of `pallas_copy`: the array itself."""
    return x


def jax_methods(num_bytes: int) -> dict:
    """{method: {"GBps", "ms", "bytes"}} for the JAX methods over an f32 array of `num_bytes`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = num_bytes // 4 // 1024
    x = jnp.arange(rows * 1024, dtype=jnp.float32).reshape(rows, 1024)
    size = x.nbytes
    out = {}

    def record(name, moved, fn, *args, **kw):
        try:
            ms = timed_ms(fn, *args, **kw)
            out[name] = {"bytes": moved, "ms": ms, "GBps": moved / ms / 1e6}
        except Exception as e:  # a method this backend cannot run: reported, not fatal
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    record("xla_scale_new_buffer", 2 * size, jax.jit(lambda a: a * 2.0), x, reps=20)
    record("xla_sum_read_only", size, jax.jit(lambda a: a.sum()), x, reps=20)
    donated = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    held = [jnp.copy(x)]

    def in_place():
        held[0] = donated(held[0])
        return held[0]

    record("xla_scale_donated", 2 * size, in_place, reps=20)
    interpret = jax.default_backend() == "cpu"
    for block in BLOCK_ROWS:
        if rows % block:
            continue
        fn = jax.jit(lambda a, b=block: pallas_copy(a, b, interpret))
        if block == BLOCK_ROWS[0]:  # the kernel copies: checked against its reference once
            try:
                if not np.array_equal(np.asarray(fn(x)), np.asarray(reference_copy(x))):
                    out["pallas_copy_error"] = "the Pallas copy differs from its input"
                    break
            except Exception as e:
                out[f"pallas_copy_rows{block}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                break
        record(f"pallas_copy_rows{block}", 2 * size, fn, x, reps=20)
    return out


TORCH_COPY = textwrap.dedent("""
    import json, sys, time
    import torch
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no cuda device for torch"})); sys.exit()
    n = int(sys.argv[1]) // 4
    a = torch.arange(n, dtype=torch.float32, device="cuda"); b = torch.empty_like(a)
    for _ in range(3): b.copy_(a)
    torch.cuda.synchronize(); times = []
    for _ in range(20):
        t0 = time.perf_counter(); b.copy_(a); torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    ms = 1e3 * sorted(times)[len(times) // 2]
    print(json.dumps({"bytes": 2 * a.nbytes, "ms": ms, "GBps": 2 * a.nbytes / ms / 1e6,
                      "device": torch.cuda.get_device_name()}))
""")


def torch_copy(num_bytes: int) -> dict:
    """torch's `b.copy_(a)` of `num_bytes` on the cuda device, in a subprocess."""
    try:
        done = subprocess.run([sys.executable, "-c", TORCH_COPY, str(num_bytes)], capture_output=True, text=True,
                              timeout=180, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr or done.stdout)[-300:] or "no output"}
    return json.loads(lines[-1])


def copy_bandwidth(tiny: bool) -> dict:
    """Every method's figure, the best (the roofline: `GBps`), the method that gave it, and the
    device's nominal bandwidth. torch runs first, before JAX starts here (when it has not yet)."""
    import importlib.util

    num_bytes = (1 << 30) if not tiny else (1 << 20)
    methods = {}
    if importlib.util.find_spec("torch") is not None and not tiny:
        methods["torch_copy"] = torch_copy(num_bytes)
    methods.update(jax_methods(num_bytes))
    import jax

    kind = jax.devices()[0].device_kind
    timed = {name: m for name, m in methods.items() if isinstance(m, dict) and "GBps" in m}
    best = max(timed, key=lambda name: timed[name]["GBps"])
    return {"GBps": timed[best]["GBps"], "method": best, "methods": methods, "device_kind": kind,
            "nominal_GBps": nominal_GBps(kind), "bytes": num_bytes}
