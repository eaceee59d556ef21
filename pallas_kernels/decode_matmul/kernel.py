"""The decode matmul's entry point: its launch settings (and the space the device tunes them
over), the shapes it takes, and the choice between the Triton kernel, its interpreted body (CPU)
and the reference (other backends). Weights are 8-bit with scales, or plain bf16/f16/f32."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tuning
from pallas_kernels.decode_matmul import mosaic_kernel, triton_kernel
from pallas_kernels.decode_matmul.reference import reference

MAX_ROWS = 64  # decode-sized products; more rows are compute-bound and XLA's dot is the tool
REDUCE_ROWS = 4  # up to this many rows the "reduce" form, past it the tensor cores' "dot"
# One row's defaults from a sweep on an H200 (bench_device quant_matmul, Llama-3-8B's matrices):
# "reduce", 32 outputs, one block a step, 4 warps, 4 stages was the fastest weighted by a layer's
# uses (docs/quantization.md has the sweep).
# An engine's decode step on a GPU has at least 16 rows (its smallest token bucket), so it runs
# "dot", whose settings (64 outputs a program) are not swept yet.
TARGET_PROGRAMS = 512  # about four per SM of an H100/H200 (132): enough loads in flight
MOSAIC_PROGRAMS = 256  # two per SM: each keeps `num_stages` TMA copies in flight itself
FORMS = (*triton_kernel.FORMS, "mosaic")
EIGHT_BIT = (jnp.int8, jnp.float8_e4m3fn)
FLOAT = (jnp.bfloat16, jnp.float16, jnp.float32)
KERNEL = "decode_matmul"  # its name in pallas_kernels/tuning.py


@dataclasses.dataclass(frozen=True)
class Launch(tuning.NamedLaunch):
    """The Triton kernel's launch settings; None: chosen by `resolve` from the shapes."""

    form: str | None = None  # "dot", "reduce" or "stream" (triton_kernel.py), or "mosaic" (mosaic_kernel.py)
    block_n: int | None = None  # outputs a program
    splits: int | None = None  # programs sharing one output block's inputs
    unroll: int | None = None  # input blocks a loop step (Triton)
    num_warps: int = 4  # Triton
    num_stages: int = 4  # pipeline stages (Mosaic: shared-memory buffers in flight)
    block_k: int | None = None  # inputs a step (Mosaic; Triton's is the group, or up to 256)


def candidates(rows: int, groups: int = 0) -> list[Launch]:
    """The launches a device times for a product of `rows` activation rows against a weight with
    `groups` scales a row (0: none) (tuning.py): the shape's own choice first, then the Triton
    forms it may take with wider or narrower blocks, more warps, fewer stages, then the Mosaic
    GPU form (not for grouped scales) with its blocks and stages."""
    if rows > REDUCE_ROWS:
        triton = [Launch(), Launch(block_n=32), Launch(block_n=128), Launch(unroll=2), Launch(num_stages=3),
                  Launch(num_warps=8), Launch(splits=1)]
    else:
        triton = [Launch(), Launch(form="reduce", block_n=16), Launch(form="reduce", block_n=64),
                  Launch(form="reduce", unroll=2), Launch(form="reduce", num_stages=2),
                  Launch(form="reduce", num_warps=8), Launch(form="stream"), Launch(form="stream", block_n=16),
                  Launch(form="dot")]
    mosaic = [Launch(form="mosaic"), Launch(form="mosaic", block_n=128), Launch(form="mosaic", block_k=256),
              Launch(form="mosaic", num_stages=2)]
    return triton + (mosaic if groups <= 1 and rows <= mosaic_kernel.TILE_ROWS else [])


def shape_of(rows: int, out_dim: int, in_dim: int, groups: int, dtype) -> tuple:
    """A product's key in the tuning table: rows, the weight's shape, its scale groups (0: none),
    its dtype."""
    return rows, out_dim, in_dim, groups, jnp.dtype(dtype).name


def tuned(rows: int, out_dim: int, in_dim: int, groups: int, dtype) -> Launch | str | None:
    """What this process's tuning chose for the product: a `Launch`, "xla" (XLA's dot was faster
    there), or None (not tuned)."""
    choice = tuning.chosen(KERNEL, shape_of(rows, out_dim, in_dim, groups, dtype))
    return choice if choice in (None, "xla") else Launch.parse(choice)


_default_launch = Launch()


def set_default_launch(launch: Launch) -> Launch:
    """The settings `decode_matmul` uses when a call gives none and nothing is tuned for its shape
    (a benchmark's sweep). Read when a program is traced. Returns the previous."""
    global _default_launch
    previous, _default_launch = _default_launch, launch
    return previous


def _largest_power_of_two_dividing(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _block_k(in_dim: int, groups: int) -> int:
    """Inputs a step reads: a scale group, or (one scale a row) up to 256."""
    return in_dim // groups if groups > 1 else _largest_power_of_two_dividing(in_dim, 256)


def _power_of_two(name: str, value: int | None) -> None:
    if value is not None and (value < 1 or value & (value - 1)):
        raise ValueError(f"decode_matmul: {name}={value} must be a power of two")


def resolve(launch: Launch, rows: int, out_dim: int, in_dim: int, groups: int) -> tuple:
    """`(form, block_n, block_k, splits, unroll)` for `rows` activations against a `[out_dim,
    in_dim]` weight with `groups` scales a row: the settings `launch` names, fitted to the shape
    (a block_n, splits or unroll that does not divide it is halved until it does: one launch
    serves every matrix of a model), the rest chosen: "reduce" up to REDUCE_ROWS rows, a group
    (or up to 256 inputs, per-row scales) a block, one block a step, 32 (reduce, stream) or 64
    (dot) outputs a program, and the inputs split until there are about TARGET_PROGRAMS
    programs, each with at least 2 steps."""
    for name in ("block_n", "splits", "unroll", "block_k"):
        _power_of_two(name, getattr(launch, name))
    form = launch.form or ("reduce" if rows <= REDUCE_ROWS else "dot")
    if form not in FORMS:
        raise ValueError(f"decode_matmul: form={form!r}: expected one of {FORMS}")
    if form == "mosaic":
        return form, *_resolve_mosaic(launch, out_dim, in_dim)
    block_k = _block_k(in_dim, groups)
    block_n = _largest_power_of_two_dividing(out_dim, launch.block_n or (64 if form == "dot" else 32))
    blocks = in_dim // block_k
    unroll = _largest_power_of_two_dividing(blocks, launch.unroll or 1)
    if launch.splits is not None:
        return form, block_n, block_k, _largest_power_of_two_dividing(blocks // unroll, launch.splits), unroll
    splits = 1
    while ((out_dim // block_n) * splits < TARGET_PROGRAMS and blocks % (splits * 2 * unroll) == 0
           and blocks // (splits * 2 * unroll) >= 2):
        splits *= 2
    return form, block_n, block_k, splits, unroll


def _resolve_mosaic(launch: Launch, out_dim: int, in_dim: int) -> tuple:
    """(block_n, block_k, splits, unroll) of the Mosaic GPU form: 64 outputs and 128 inputs a
    step unless named, the inputs split until about MOSAIC_PROGRAMS programs with 2+ steps each."""
    block_n, block_k = launch.block_n or 64, launch.block_k or 128
    if launch.splits is not None:
        return block_n, block_k, launch.splits, 1
    splits, blocks = 1, in_dim // block_k
    while ((out_dim // block_n) * splits < MOSAIC_PROGRAMS and blocks % (splits * 2) == 0
           and blocks // (splits * 2) >= 2):
        splits *= 2
    return block_n, block_k, splits, 1


def unsupported(rows: int, out_dim: int, in_dim: int, groups: int, dtype) -> str | None:
    """Why the kernel does not take this product (the caller then uses XLA's dot), or None.
    `groups`: scales a row of an 8-bit weight; 0 for a float weight (no scales)."""
    group = in_dim // max(groups, 1)
    eight_bit = jnp.dtype(dtype) in [jnp.dtype(d) for d in EIGHT_BIT]
    if not eight_bit and jnp.dtype(dtype) not in [jnp.dtype(d) for d in FLOAT]:
        return f"the weight is {jnp.dtype(dtype)}, the kernel reads int8, float8_e4m3fn, bf16, f16 or f32"
    if eight_bit != (groups > 0):
        return "8-bit weights come with scales, float weights without"
    if rows > MAX_ROWS:
        return f"{rows} rows: the kernel is for decode-sized products (<= {MAX_ROWS} rows)"
    if groups > 1 and (group < 16 or group & (group - 1) or in_dim % groups):
        return f"groups of {group} inputs: the kernel takes power-of-two groups >= 16"
    block_n = _largest_power_of_two_dividing(out_dim, 64)
    if block_n < 16 or _block_k(in_dim, groups) < 16:
        return f"a [{out_dim}, {in_dim}] weight has no power-of-two blocks >= 16"
    return None


def note(x, values, scale) -> tuple:
    """The product's key in the tuning table (`shape_of`), its call recorded for a tuner
    (`tuning.recording`): by the kernel's entry point, and by a caller that sends the product to
    XLA's dot while nothing is tuned for it."""
    shape = shape_of(int(np.prod(x.shape[:-1])), values.shape[0], x.shape[-1], 0 if scale is None else scale.shape[1],
                     values.dtype)
    tuning.note(KERNEL, shape, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x, values, scale)))
    return shape


def decode_matmul(x, values, scale=None, *, interpret: bool = False, launch: Launch | None = None):
    """`x [..., in] @ (values * scale).T` in x's dtype (f32 accumulation): `values [out, in]`
    int8 or float8_e4m3fn with `scale [out, groups]` float32 (see `reference`), or bf16 / f16 /
    f32 with `scale` None. On a GPU the Triton kernel, or with `form="mosaic"` the Mosaic GPU one;
    `interpret=True` runs its body in Pallas interpret mode (Mosaic's: the GPU interpreter; any
    platform); otherwise a CPU or TPU computes the reference. `launch`: the
    kernel's settings (default: this process's tuned choice for the shape, else those of
    `set_default_launch`, whose unset fields `resolve` chooses). The choice is made here, outside
    the jitted body, so a new choice is a new static argument, never a stale trace."""
    shape = note(x, values, scale)
    why_not = unsupported(*shape)
    if why_not:
        raise ValueError(f"decode_matmul: {why_not}")
    if launch is None:
        chosen = tuned(*shape)
        launch = chosen if isinstance(chosen, Launch) else _default_launch
    return _decode_matmul(x, values, scale, interpret=interpret, launch=launch)


@functools.partial(jax.jit, static_argnames=("interpret", "launch"))
def _decode_matmul(x, values, scale, *, interpret: bool, launch: Launch):
    lead, in_dim = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, in_dim)
    out_dim, groups = values.shape[0], (0 if scale is None else scale.shape[1])
    form, block_n, block_k, splits, unroll = resolve(launch, flat.shape[0], out_dim, in_dim, max(groups, 1))
    if form == "mosaic":
        why_not = mosaic_kernel.unsupported(flat.shape[0], out_dim, in_dim, groups, values.dtype, x.dtype,
                                            block_n=block_n, block_k=block_k, splits=splits)
        if why_not:
            raise ValueError(f"decode_matmul: {why_not}")
        run = functools.partial(_mosaic, block_n=block_n, block_k=block_k, splits=splits, stages=launch.num_stages)
    else:
        run = functools.partial(triton_kernel.matmul, form=form, block_n=block_n, splits=splits, block_k=block_k,
                                unroll=unroll, num_warps=launch.num_warps, num_stages=launch.num_stages)
    if interpret:
        y = run(flat, values, scale, interpret=True)
    else:
        y = jax.lax.platform_dependent(flat, values, scale, cuda=functools.partial(run, interpret=False),
                                       default=reference)
    return y.astype(x.dtype).reshape(lead + (out_dim,))


def _mosaic(x, values, scale, *, interpret: bool, **settings):
    """The Mosaic GPU form, its per-output scale (if any) applied once per output after the sum."""
    y = mosaic_kernel.matmul(x, values, interpret=interpret, **settings)
    return y if scale is None else y * scale[:, 0][None, :]
