"""Which programs an engine has and how they get compiled: the step programs keyed by bucket
(step_programs.py), compiled ahead at warm-up, kept on disk (executables.py), lowered for
an accelerator this machine lacks (lowering.py), and the Pallas kernels' launch settings
tuned on the engine's own shapes (kernel_tuning.py)."""
