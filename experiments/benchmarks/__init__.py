"""The benchmarks: this engine against the others (transformers, llama.cpp) and against the
hardware (kernels, the step on a GPU, start-up, the server under load), side by side in one run."""
