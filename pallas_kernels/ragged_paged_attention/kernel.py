"""Entry point of the ragged paged-attention kernels: the platform picks the kernel.

`jax.lax.platform_dependent` puts both kernels in the traced program and lowers only the
one for the platform it is compiled for: Triton on a GPU (`triton_kernel.py`), Mosaic on
a TPU (`tpu_kernel.py`), and on a CPU the Triton kernel's body in Pallas interpret mode. On
cuda a call may run on Mosaic GPU instead (`mosaic_kernel.py`), where a device's tuning chose
it (`Launch(form="mosaic")`; a decode call, `cu_q_lens=None`, has its own launches). A
caller that knows its platform names it (`platform=`) and only that kernel is traced.
So a program traced on this CPU and lowered with `lowering_platforms=("cuda",)` or
`("tpu",)` holds the real kernel call (tests/test_cross_lowering.py). `set_cpu_interpreter`
makes a CPU interpret the TPU kernel instead (the engine's parity tests run both).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tuning
from pallas_kernels.ragged_paged_attention import mosaic_kernel, tpu_kernel, triton_kernel

KERNEL = "ragged_paged_attention"  # its name in pallas_kernels/tuning.py

# Any head_dim a supported family ships (64, 80, 96, 112, 128, 160, 192, 256, ...): Triton
# computes with the next power of two (triton_kernel.padded_head_dim), Mosaic with its own.
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 16, 256, 8
INTERPRETERS = ("triton", "tpu")
_cpu_interpreter = "triton"


def set_cpu_interpreter(kernel: str) -> str:
    """Which kernel's body a CPU runs in interpret mode when the platform chooses: "triton"
    (the default) or "tpu" (Pallas's TPU interpreter, DMAs and semaphores simulated; slower).
    Read when a program is traced: call `jax.clear_caches()` after changing it. Returns the
    previous choice."""
    global _cpu_interpreter
    if kernel not in INTERPRETERS:
        raise ValueError(f"the CPU interpreter must be one of {INTERPRETERS}, got {kernel!r}")
    previous, _cpu_interpreter = _cpu_interpreter, kernel
    return previous


def cpu_interpreter() -> str:
    """The kernel whose body a CPU interprets (`set_cpu_interpreter`)."""
    return _cpu_interpreter


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def min_page_size(dtype) -> int:
    """The least page the kernels take: Mosaic DMAs whole sublane tiles (8 rows of 32 bits);
    8-bit KV (with its scales) only Triton reads, 16 keys a page at least (a dot's side)."""
    itemsize = np.dtype(dtype).itemsize
    return 16 if itemsize == 1 else 8 * 4 // itemsize


def _step_keys(head_dim: int) -> int:
    """Keys a program reads per step: 128 at head_dim <= 64, 64 above (the tile's K and V
    then fill the same fast memory)."""
    return 128 if triton_kernel.padded_head_dim(head_dim) <= 64 else 64


def slot_page_size(max_len: int, head_dim: int, dtype) -> int | None:
    """The pages a slot cache of `max_len` positions is read in (a slot is a run of them): one
    step's keys, or the largest power of two below that which divides `max_len`; None when
    not even the least page (`min_page_size`) does."""
    page = _step_keys(head_dim)
    while page >= min_page_size(dtype) and max_len % page:
        page //= 2
    return page if page >= min_page_size(dtype) else None


def check_supported(*, head_dim: int, page_size: int, dtype, q_heads: int | None = None,
                    kv_heads: int | None = None, block_q: int | None = None,
                    pages_per_block: int | None = None, kv_splits: int | None = None) -> None:
    """Refuse (ValueError, naming the knob) a shape the kernels cannot compile for: Triton's
    block shapes are powers of two (a dot needs 16 per side), Mosaic DMAs pages in whole
    sublane tiles (8 rows of 32 bits, 16 of a 16-bit type)."""
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(f"the Pallas attention kernels need head_dim a multiple of {HEAD_DIM_MULTIPLE} in "
                         f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}: use attention='reference'")
    min_page = min_page_size(dtype)
    if not _power_of_two(page_size) or page_size < min_page:
        raise ValueError(f"the Pallas attention kernels need page_size a power of two >= {min_page} "
                         f"for {np.dtype(dtype).name} KV, got {page_size}")
    if q_heads is not None and kv_heads is not None and q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    group = q_heads // kv_heads if q_heads and kv_heads else 1
    if block_q is not None and (not _power_of_two(block_q) or block_q * group < 16):
        raise ValueError(f"block_q must be a power of two with block_q x group ({group}) >= 16 query rows, "
                         f"got {block_q}")
    if pages_per_block is not None and not _power_of_two(pages_per_block):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block}")
    if kv_splits is not None and (not isinstance(kv_splits, int) or kv_splits < 1):
        raise ValueError(f"kv_splits must be an integer >= 1, got {kv_splits!r}")


def block_sizes(head_dim: int, page_size: int, pages_per_seq: int) -> tuple[int, int]:
    """`(block_q, pages_per_block)` for a shape: 16 query tokens per tile, and pages enough
    for one step's keys (`_step_keys`), no more than a sequence can hold."""
    pages = max(_step_keys(head_dim) // page_size, 1)
    return 16, min(pages, 1 << max(pages_per_seq - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class Launch(tuning.NamedLaunch):
    """The kernel's settings a device tunes; None: the shape's own (`block_sizes`, by head_dim,
    one program per tile). `form`: None for the Triton kernel, "mosaic" for the Mosaic GPU one
    (`num_stages` is then its shared-memory buffers)."""

    block_q: int | None = None
    pages_per_block: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    kv_splits: int | None = None
    form: str | None = None


FORMS = (None, "mosaic")


def candidates(head_dim: int, page_size: int, pages_per_seq: int) -> list[Launch]:
    """The Triton launches a device times for a shape (pallas_kernels/tuning.py): split-KV at 1,
    2, 4 and 8 programs a tile, each with the shape's own blocks, twice the pages a step, and
    the other warp count."""
    pages = block_sizes(head_dim, page_size, pages_per_seq)[1]
    wider = min(pages * 2, 1 << max(pages_per_seq - 1, 0).bit_length())
    warps = 8 if triton_kernel.padded_head_dim(head_dim) <= 64 else 4  # the one the shape does not take
    launches = []
    for splits in (1, 2, 4, 8):
        launches += [Launch(kv_splits=splits), Launch(kv_splits=splits, pages_per_block=wider),
                     Launch(kv_splits=splits, num_warps=warps)]
    return list(dict.fromkeys(launches))


def mosaic_candidates(shape: tuple) -> list[Launch]:
    """The Mosaic GPU launches for a call's key (`shape_of`), where its KV and head_dim suit the
    kernel and they fit in shared memory: 64 and 128 keys a block at 1, 2, 4 and 8 splits with
    two buffers, and three buffers of 64 keys, for a decode call; four of those for a ragged one."""
    _, q_heads, kv_heads, head_dim, page_size, _, dtype, _, decode = shape
    settings = ([(64, 2, 1), (64, 2, 2), (64, 2, 4), (64, 2, 8), (128, 2, 1), (128, 2, 2), (128, 2, 4),
                 (128, 2, 8), (64, 3, 1), (64, 3, 4)] if decode else [(64, 2, 1), (128, 2, 1), (64, 2, 4), (64, 2, 8)])
    launches = []
    for keys, stages, splits in settings:
        pages = max(keys // page_size, 1)
        if mosaic_kernel.unsupported(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                                     dtype=dtype, pages_per_block=pages, stages=stages) is None:
            launches.append(Launch(form="mosaic", pages_per_block=pages, num_stages=stages, kv_splits=splits))
    return list(dict.fromkeys(launches))


def candidates_of(shape: tuple) -> list[Launch]:
    """Every launch a device times for a call's key (`shape_of`): the Triton ones, then Mosaic GPU's."""
    return candidates(shape[3], shape[4], shape[5]) + mosaic_candidates(shape)


def shape_of(q, k_pages, page_indices, window: int, decode: bool = False) -> tuple:
    """A call's key in the tuning table: query rows, heads, head_dim, page size, pages a
    sequence, the KV's dtype, whether a window bounds it, whether it is a decode call."""
    values = k_pages.values if hasattr(k_pages, "scale") else k_pages
    return (q.shape[0], q.shape[1], values.shape[0], q.shape[2], values.shape[2], page_indices.shape[1],
            np.dtype(values.dtype).name, int(window > 0), int(decode))


def _reference_kernel(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, scale, window, **unused):
    from pallas_kernels.ragged_paged_attention.reference import reference

    return reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, scale, window)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, scale: float,
                           block_q: int | None = None, pages_per_block: int | None = None,
                           interpret: bool | str = False, window: int = 0, num_warps: int | None = None,
                           num_stages: int | None = None, kv_splits: int | None = None,
                           platform: str | None = None, form: str | None = None):
    """Attention of a flat batch of query tokens `q [T, q_heads, hd]` over paged K/V
    (`[kv_heads, num_pages, page_size, hd]`): sequence s owns rows
    `[cu_q_lens[s], cu_q_lens[s + 1])` and its first `kv_lens[s]` keys on pages
    `page_indices[s]` (`cu_q_lens` None: one row each, a decode call); causal within its new
    tokens, and with `window` > 0 each query sees only the keys in `(position - window,
    position]` (pages before that are not read). Returns `[T, q_heads, hd]` in q's dtype; rows
    past `cu_q_lens[-1]` are left unspecified. `interpret`: True runs the Triton kernel's body
    in Pallas interpret mode, "tpu" the TPU kernel's under the TPU interpreter (both on any
    platform); False lets the platform choose: `platform` ("cpu", "gpu", "cuda", "rocm",
    "tpu") when the caller knows it, else at lowering. `num_warps`, `num_stages` and
    `kv_splits` (split-KV: programs sharing a query tile's keys): the launch settings;
    `form="mosaic"`: the Mosaic GPU kernel (on cuda; under `interpret`, Pallas' GPU
    interpreter). With no launch setting given, the call takes this process's tuned `Launch`
    for its shape (`shape_of`), else the defaults (by head_dim, 1 split): chosen here, outside
    the jitted body, so a new choice is a new static argument."""
    launch = Launch(block_q, pages_per_block, num_warps, num_stages, kv_splits, form)
    shape = shape_of(q, k_pages, page_indices, window, decode=cu_q_lens is None)
    tuning.note(KERNEL, shape, (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                             (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens)),
                                dict(scale=scale, window=window)))
    if launch == Launch():
        choice = tuning.chosen(KERNEL, shape)
        launch = Launch.parse(choice) if choice is not None else launch
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: full attention), got {window}")
    if launch.form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {launch.form!r}")
    if launch.form == "mosaic":
        return _mosaic(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, scale=scale, launch=launch,
                       interpret=interpret, window=window, platform=platform)
    if cu_q_lens is None:
        cu_q_lens = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return _ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, scale=scale,
                                   block_q=launch.block_q, pages_per_block=launch.pages_per_block,
                                   interpret=interpret, window=window, num_warps=launch.num_warps,
                                   num_stages=launch.num_stages, kv_splits=launch.kv_splits, platform=platform)


def _mosaic(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, scale, launch, interpret, window, platform):
    """The call on the Mosaic GPU kernel: on cuda, or under Pallas' GPU interpreter (asked, or on a
    CPU, as the Triton kernel's body is interpreted there)."""
    if hasattr(k_pages, "scale"):
        raise ValueError("the Mosaic GPU form does not read 8-bit KV (the Triton kernel does)")
    interpret = interpret or platform == "cpu"
    if interpret and not mosaic_kernel.interpretable():
        raise NotImplementedError("the Mosaic GPU form's interpret mode needs JAX >= 0.11 (a transposed wgmma operand)")
    if not interpret and platform not in (None, "gpu", "cuda"):
        raise ValueError(f"the Mosaic GPU form runs on NVIDIA GPUs (cuda), not {platform!r}")
    pages = launch.pages_per_block or max(64 // k_pages.shape[2], 1)
    return mosaic_kernel.attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, scale=scale,
                                   pages_per_block=pages, kv_splits=launch.kv_splits or 1,
                                   stages=launch.num_stages or 2, window=window, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block", "interpret", "window",
                                             "num_warps", "num_stages", "kv_splits", "platform"))
def _ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, scale, block_q,
                            pages_per_block, interpret, window, num_warps, num_stages, kv_splits, platform):
    head_dim, page_size = q.shape[2], k_pages.shape[2]
    auto_q, auto_pages = block_sizes(head_dim, page_size, page_indices.shape[1])
    block_q = auto_q if block_q is None else block_q
    pages_per_block = auto_pages if pages_per_block is None else pages_per_block
    check_supported(head_dim=head_dim, page_size=page_size, dtype=k_pages.dtype, q_heads=q.shape[1],
                    kv_heads=k_pages.shape[0], block_q=block_q, pages_per_block=pages_per_block, kv_splits=kv_splits)
    if cu_q_lens.shape[0] != kv_lens.shape[0] + 1 or page_indices.shape[0] != kv_lens.shape[0]:
        raise ValueError("cu_q_lens must have one entry more than kv_lens and page_indices have rows")
    args = (q, k_pages, v_pages, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32),
            cu_q_lens.astype(jnp.int32))
    kernels = {"triton": functools.partial(triton_kernel.attention, num_warps=num_warps, num_stages=num_stages,
                                           kv_splits=kv_splits or 1),
               "tpu": tpu_kernel.attention}
    if hasattr(k_pages, "scale"):  # 8-bit KV: the Mosaic kernel does not read scales yet, a TPU runs the reference
        kernels["tpu"] = _reference_kernel

    def run(kernel: str, interpreted: bool):
        return functools.partial(kernels[kernel], scale=scale, block_q=block_q,
                                 pages_per_block=pages_per_block, interpret=interpreted, window=window)

    if interpret:
        return run("tpu" if interpret == "tpu" else "triton", True)(*args)
    if platform is not None:
        on = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "tpu"}.get(platform)
        return (run(on, False) if on else run(_cpu_interpreter, True))(*args)
    return jax.lax.platform_dependent(*args, cuda=run("triton", False), rocm=run("triton", False),
                                      tpu=run("tpu", False), default=run(_cpu_interpreter, True))
