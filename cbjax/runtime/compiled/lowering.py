"""Every program of an engine lowered for an accelerator without one: tracing on this machine,
the Pallas kernels' Triton (cuda) and Mosaic (tpu) lowering rules included; only the final
compile needs the device (tests/test_cross_lowering.py)."""

from __future__ import annotations

import contextlib

import jax

from cbjax.request import ALL
from cbjax.runtime.traced.step import ragged_step


def lowering_target(platform: str):
    """The context a lowering for `platform` runs in off the device: for "cuda", an abstract
    mesh naming an H100 (from JAX 0.11 the Pallas Triton lowering reads the compute capability
    of the device it targets, which a CPU does not have); nothing for the others."""
    if platform != "cuda":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    # Auto axes, as JAX 0.10 and 0.11 default to: from 0.12 an abstract mesh's axes default to
    # Explicit, under which `ragged_dot_general` (a mixture of experts' grouped matmul) asks for
    # an out_sharding that nothing here is sharded by.
    mesh = jax.sharding.AbstractMesh((1,), ("lowering",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def lower_programs(engine, platforms: tuple[str, ...], samplers: tuple | None = None,
                   programs: list[tuple] | None = None) -> dict[tuple, dict]:
    """`{program: {platform: jax Lowered}}`: every program `engine.warmup` compiles (or those of
    `programs`, of `engine.programs()`), traced here and lowered for each of `platforms`
    ("cuda", "tpu") without the device (the Pallas kernels' Triton and Mosaic lowering rules
    run; only the final compile needs it). Params may be shapes. `samplers`: lower each program
    for each of these sampler variants, keyed `(*program, sampler)`; None: the variant every
    call can run, keyed by the program alone."""
    out = {}
    for prog in engine.programs() if programs is None else programs:
        for sampler in samplers or (ALL,):
            args, static = engine.padding_arguments(prog[1], prog[2], sampler,
                                                    verify=engine.verify_positions if prog[0] == "verify" else 0)
            key = prog if samplers is None else (*prog, sampler)
            out[key] = {}
            for p in platforms:
                # Traced inside the target's context, not once for all: from JAX 0.11 a trace made
                # outside it fails to lower for cuda ("No supported GPU devices found").
                with lowering_target(p):
                    out[key][p] = ragged_step.trace(*args, **{**static, "platform": p}).lower(lowering_platforms=(p,))
    return out
