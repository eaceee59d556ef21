"""Suite-wide fixtures."""

from __future__ import annotations

import gc
import os
import tempfile

import jax
import pytest

from cbjax import compile_cache
from cbjax.parallel.distributed import expose_host_devices
from cbjax.runtime import engine_config

# JAX's persistent compilation cache, shared by the test processes (pytest-xdist workers)
from cbjax.runtime.compiled import executables
# and the experiment scripts they start: the suite compiles the same tiny-model programs
# in many processes, and after the mapping guard below clears the in-memory caches. Keyed
# by the program and the JAX version, so a hit is the same executable. A fresh directory
# per run unless CBJAX_TEST_JAX_CACHE names one to keep. Programs that compile faster than
# cbjax's own threshold are not written (as outside the suite): the eager ops' thousands of
# 15-ms programs cost 30 ms apiece to write, more than compiling them again.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ.get("CBJAX_TEST_JAX_CACHE") or os.path.join(
        tempfile.gettempdir(), f"cbjax-jax-cache-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(compile_cache.MIN_COMPILE_SECONDS))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", compile_cache.MIN_COMPILE_SECONDS)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# The suite is mostly XLA compilation of tiny programs: LLVM's backend optimizations cost a
# quarter of the suite's time (157 s -> 120 s on a SmolLM2 test and the warm-up tests) and
# buy nothing at these sizes (no timing is asserted; matmuls call the same kernels). XLA:CPU's
# MLIR fusion emitters halve what is left (0.65 s -> 0.33 s per tiny-model program;
# test_engine_parity.py 150 s -> 85 s): the older loop emitters generate the same
# element-wise code without the MLIR pipeline. The experiment scripts the tests start
# inherit the flags. Exact results are unchanged: XLA keeps floating-point order either way
# (no fast math).
# XLA aborts on a flag it does not know: the emitters' flag only with the JAX it was checked on.
_FLAGS = ["--xla_backend_optimization_level=0"]
if jax.__version__.startswith("0.10."):
    _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# A CPU engine's smallest token bucket is 1 (engine_config.DEFAULT_MIN_STEP_TOKENS: on a CPU a
# decode step's time grows with its rows), so a 4-slot engine's decodes compile three programs
# (1, 2 and 4 rows) where one of 8 tokens would do: they were 46% of the step programs of the
# engine-heavy test files. The suite checks tokens, not speed: its CPU engines start at 8 unless
# a test sets `min_step_tokens` (the tests of the buckets themselves do).
SUITE_MIN_STEP_TOKENS = 8
engine_config.DEFAULT_MIN_STEP_TOKENS["cpu"] = SUITE_MIN_STEP_TOKENS

# Eight CPU devices for the scale-out tests (tensor parallel, replicas, pipeline stages); set
# before JAX starts its backend (importing it does not). Everything else runs on device 0.
expose_host_devices(8)

# Each XLA:CPU executable keeps a few memory mappings for its JIT code, and the jit caches
# keep every executable this process compiled. The suite builds hundreds of engines of
# different shapes, which took a single pytest process past the kernel's limit on mappings
# (vm.max_map_count, 65,530 by default): the next compilation's mmap failed and XLA
# segfaulted. Between tests, drop the caches once the count nears half that limit.
MAX_MAPPINGS = 30_000


def _num_mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _bounded_jit_mappings():
    yield
    if _num_mappings() > MAX_MAPPINGS:
        jax.clear_caches()
        executables.forget()
        gc.collect()
