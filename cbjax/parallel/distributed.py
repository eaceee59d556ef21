"""Several hosts (or processes) serving one model: JAX's own multi-controller runtime.

Every process runs the same program: it builds the same `LLM` with a mesh over
`jax.devices()` (which, after `initialize`, lists every process's devices), receives
the same requests, and so its scheduler makes the same decisions and issues the same
jitted calls; XLA's collectives carry the tensor-parallel traffic between them
(NCCL on GPUs, gloo between CPU processes). Host inputs of a step are the same
numpy arrays on every process, and each step's one small result is replicated, so
every process reads the tokens locally. There is no home-made runtime: only
`jax.distributed.initialize` and the sharded jits.
"""

from __future__ import annotations

import os

import jax


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_count: int | None = None) -> None:
    """Join the job. On GPU/TPU clusters the arguments may be left out (JAX reads them from
    SLURM, Open MPI or the TPU metadata); on CPU give all three, and optionally how many
    host devices this process should expose (before JAX starts its backend)."""
    if local_device_count is not None:
        expose_host_devices(local_device_count)
    # CPU processes need a collectives implementation to talk to each other (only the CPU
    # client reads this; GPUs use NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def expose_host_devices(count: int) -> None:
    """Make the CPU backend show `count` devices (XLA_FLAGS), unless the flags already set a
    count. Takes effect only before JAX starts its backend (the first array or device query)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()

