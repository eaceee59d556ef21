"""The CPU kernels' C++ (the headers beside this file, `ffi.cc` the one translation unit)
compiled once per machine with the system C++ compiler (`$CXX`, else `c++`) against the XLA
FFI headers that jaxlib ships, cached under `$CBJAX_CACHE_DIR` (default `~/.cache/cbjax`),
loaded and registered as XLA FFI targets."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from cbjax.compile_cache import cache_root

TARGETS = ("cbjax_matmul_nt", "cbjax_expert_matmul_nt", "cbjax_matmul_blocks", "cbjax_matmul_int8",
           "cbjax_history_attention",
           "cbjax_decoder_layer", "cbjax_decoder_layer_at", "cbjax_decoder_layer_at_lora", "cbjax_lora_delta",
           "cbjax_argmax")
SOURCES = Path(__file__).parent
MAIN = SOURCES / "ffi.cc"
# The matmul kinds of crossover.h (the GGUF block kinds, f32 rows, int8 rows) and the most input
# rows the transposed form takes (matmul.h's kMaxTransposedRows).
MATMUL_KINDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "f32": 3, "int8": 4}
MAX_TRANSPOSED_ROWS = 64
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")

log = logging.getLogger(__name__)


def _cpu_signature() -> str:
    """What a `-march=native` build depends on: the CPU's feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def library_path() -> Path:
    code = [p.read_text() for p in sorted([*SOURCES.glob("*.h"), *SOURCES.glob("*.cc")])]
    key = "\n".join([*code, _compiler(), " ".join(_FLAGS), jax.__version__, platform.machine(),
                     _cpu_signature()])
    cache = cache_root()
    return cache / f"cpu_kernels-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    compiler = _compiler()
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r}) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes (test workers) never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(MAIN), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    try:
        path = library_path()
        if not path.exists():
            _build(path)
        library = ctypes.cdll.LoadLibrary(str(path))
        for target in TARGETS:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    except Exception as e:  # a machine without a compiler still runs, through XLA
        log.warning("the CPU kernels are unavailable, XLA runs everything: %s", e)
        return None, f"{type(e).__name__}: {e}"
    library.cbjax_read_sum.restype = ctypes.c_double
    library.cbjax_read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    library.cbjax_measure_crossover.restype = library.cbjax_takes_transposed.restype = ctypes.c_int64
    library.cbjax_measure_crossover.argtypes = library.cbjax_takes_transposed.argtypes = [ctypes.c_int64] * 2
    library.cbjax_set_transposed.argtypes = [ctypes.c_int64] * 4
    library.cbjax_matmul_gflops.restype = ctypes.c_double
    library.cbjax_matmul_gflops.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_double]
    return library, None


def build_error() -> str | None:
    """None once the kernels are built, loaded and registered; else why they are not."""
    return _load()[1]


def read_sum(buffer, threads: int) -> float:
    """The sum of a C-contiguous float32 numpy array read by `threads` threads, each its own
    contiguous part (bandwidth.h: the CPU roofline's memory side; the caller times it)."""
    library = _library()
    if buffer.dtype.name != "float32" or not buffer.flags.c_contiguous:
        raise ValueError("read_sum takes a C-contiguous float32 array")
    return library.cbjax_read_sum(buffer.ctypes.data, buffer.size, threads)


def matmul_gflops(rows: int, inputs: int, threads: int, seconds: float = 0.05) -> float:
    """GFLOP/s of the f32 matmul at `rows` x `inputs`, `threads` threads each over its own weight
    block held in its L2 for `seconds` (bandwidth.h: the CPU roofline's compute side)."""
    if rows < 1 or inputs < 1 or threads < 1 or seconds <= 0:
        raise ValueError("matmul_gflops takes positive rows, inputs, threads and seconds")
    return _library().cbjax_matmul_gflops(int(rows), int(inputs), int(threads), float(seconds))


def transposed_rows(kind: str = "f32") -> list[int]:
    """The input-row counts at which matmuls of `kind` (MATMUL_KINDS) take the transposed-input
    form (matmul.h): as timed when the kind first met more than one row (crossover.h), or as
    last set. Asking times the kind now if it has not been."""
    library, k = _library(), MATMUL_KINDS[kind]
    return [m for m in range(2, MAX_TRANSPOSED_ROWS + 1) if library.cbjax_takes_transposed(k, m)]


def set_transposed(first: int, last: int, on: bool, kind: str = "f32") -> None:
    """Pins `kind`'s form for input-row counts [first, last]."""
    _library().cbjax_set_transposed(MATMUL_KINDS[kind], int(first), int(last), int(on))


@contextlib.contextmanager
def pinned_form(transposed: bool):
    """Every kind at every row count from 2 to MAX_TRANSPOSED_ROWS in one form while the block
    runs (tests run both; a benchmark may compare them), the measured choices restored after."""
    measured = {kind: transposed_rows(kind) for kind in MATMUL_KINDS}
    for kind in MATMUL_KINDS:
        set_transposed(2, MAX_TRANSPOSED_ROWS, transposed, kind)
    try:
        yield
    finally:
        for kind, rows in measured.items():
            set_transposed(2, MAX_TRANSPOSED_ROWS, False, kind)
            for m in rows:
                set_transposed(m, m, True, kind)


def measure_crossover(kind: str = "f32", inputs: int = 768) -> list[int]:
    """Times `kind`'s two forms again at `inputs`-wide rows (a multiple of 32) and sets them;
    returns transposed_rows(kind)."""
    if _library().cbjax_measure_crossover(MATMUL_KINDS[kind], int(inputs)) < 0:
        raise ValueError(f"inputs must be a positive multiple of 32, not {inputs}")
    return transposed_rows(kind)


def _library() -> ctypes.CDLL:
    library, error = _load()
    if library is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {error}")
    return library
