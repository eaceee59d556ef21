"""What runs inside the engine's jitted programs: the one ragged step (step.py), on-device
sampling, speculative verification, the per-slot decode state, and the small programs beside
the step (KV copies, resets). Pure JAX functions; the host side is ../packing.py."""
