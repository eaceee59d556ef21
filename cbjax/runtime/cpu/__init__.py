"""The optional CPU backend: C++ decode kernels as XLA FFI calls behind `Ops`, built on first
use. `library.py` builds, caches, loads and registers them; `kernels.py` wraps them as JAX
ops. The C++ is by concern beside them: `simd.h`, `pool.h`, `matmul.h`, `blocks.h` (GGUF
blocks), `int8.h`, `attention.h`, `layer.h`, `sampling.h`, and the FFI bindings in `ffi.cc`,
the one translation unit."""
