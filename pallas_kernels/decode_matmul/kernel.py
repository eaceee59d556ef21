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
from pallas_kernels.decode_matmul import triton_kernel
from pallas_kernels.decode_matmul.reference import reference

MAX_ROWS = 64  # decode-sized products; more rows are compute-bound and XLA's dot is the tool
REDUCE_ROWS = 4  # up to this many rows the "reduce" form, past it the tensor cores' "dot"
# One row's defaults from a sweep on an H200 (bench_device quant_matmul, Llama-3-8B's matrices):
# "reduce", 32 outputs, one block a step, 4 warps, 4 stages was the fastest weighted by a layer's
# uses (docs/quantization.md has the sweep).
# An engine's decode step on a GPU has at least 16 rows (its smallest token bucket), so it runs
# "dot", whose settings (64 outputs a program) are not swept yet.
TARGET_PROGRAMS = 512  # about four per SM of an H100/H200 (132): enough loads in flight
EIGHT_BIT = (jnp.int8, jnp.float8_e4m3fn)
FLOAT = (jnp.bfloat16, jnp.float16, jnp.float32)
KERNEL = "decode_matmul"  # its name in pallas_kernels/tuning.py


@dataclasses.dataclass(frozen=True)
class Launch:
    """The Triton kernel's launch settings; None: chosen by `resolve` from the shapes."""

    form: str | None = None  # "dot", "reduce" or "stream" (triton_kernel.py)
    block_n: int | None = None  # outputs a program
    splits: int | None = None  # programs sharing one output block's inputs
    unroll: int | None = None  # input blocks a loop step
    num_warps: int = 4
    num_stages: int = 4

    @property
    def name(self) -> str:
        """The fields set away from their defaults, `form=dot,block_n=128` (`parse` reads it back)."""
        return tuning.launch_name(self)

    @classmethod
    def parse(cls, name: str) -> Launch:
        return tuning.parse_launch(cls, name)


def candidates(rows: int) -> list[Launch]:
    """The launches a device times for a product of `rows` activation rows (tuning.py): the
    shape's own choice first, then the forms it may take with wider or narrower blocks, more
    warps, fewer stages."""
    if rows > REDUCE_ROWS:
        return [Launch(), Launch(block_n=32), Launch(block_n=128), Launch(unroll=2), Launch(num_stages=3),
                Launch(num_warps=8), Launch(splits=1)]
    return [Launch(), Launch(form="reduce", block_n=16), Launch(form="reduce", block_n=64),
            Launch(form="reduce", unroll=2), Launch(form="reduce", num_stages=2), Launch(form="reduce", num_warps=8),
            Launch(form="stream"), Launch(form="stream", block_n=16), Launch(form="dot")]


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
    for name in ("block_n", "splits", "unroll"):
        _power_of_two(name, getattr(launch, name))
    form = launch.form or ("reduce" if rows <= REDUCE_ROWS else "dot")
    if form not in triton_kernel.FORMS:
        raise ValueError(f"decode_matmul: form={form!r}: expected one of {triton_kernel.FORMS}")
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


def decode_matmul(x, values, scale=None, *, interpret: bool = False, launch: Launch | None = None):
    """`x [..., in] @ (values * scale).T` in x's dtype (f32 accumulation): `values [out, in]`
    int8 or float8_e4m3fn with `scale [out, groups]` float32 (see `reference`), or bf16 / f16 /
    f32 with `scale` None. On a GPU the Triton kernel; `interpret=True` runs its body in Pallas
    interpret mode (any platform); otherwise a CPU or TPU computes the reference. `launch`: the
    kernel's settings (default: this process's tuned choice for the shape, else those of
    `set_default_launch`, whose unset fields `resolve` chooses). The choice is made here, outside
    the jitted body, so a new choice is a new static argument, never a stale trace."""
    in_dim = x.shape[-1]
    rows = int(np.prod(x.shape[:-1]))
    out_dim, groups = values.shape[0], (0 if scale is None else scale.shape[1])
    why_not = unsupported(rows, out_dim, in_dim, groups, values.dtype)
    if why_not:
        raise ValueError(f"decode_matmul: {why_not}")
    shape = shape_of(rows, out_dim, in_dim, groups, values.dtype)
    tuning.note(KERNEL, shape, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x, values, scale)))
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
    run = functools.partial(triton_kernel.matmul, form=form, block_n=block_n, splits=splits, block_k=block_k,
                            unroll=unroll, num_warps=launch.num_warps, num_stages=launch.num_stages)
    if interpret:
        y = run(flat, values, scale, interpret=True)
    else:
        y = jax.lax.platform_dependent(flat, values, scale, cuda=functools.partial(run, interpret=False),
                                       default=reference)
    return y.astype(x.dtype).reshape(lead + (out_dim,))
