"""The device side: the `Engine` over the jitted programs (prefill, decode, mixed step),
the per-slot device state, sampling, tensor-parallel placement (`sharding`) and the
pipeline-stage engine. Pure functions under jit; the host hands rows in and copies one
small array out per call."""
