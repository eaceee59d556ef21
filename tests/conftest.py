"""Suite-wide fixtures."""

from __future__ import annotations

import gc

import jax
import pytest

from cbjax.parallel.distributed import expose_host_devices

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
        gc.collect()
