"""JAX's persistent compilation cache, on by default for every entry point.

An engine's programs are the same from one run to the next (same model shapes, same token
buckets), so a second start reads them from disk instead of compiling them again. The
cache lives in a per-user directory: `$CBJAX_COMPILATION_CACHE` (a path, or `off`: also
`0`, `false`, `no`, `none`, in any case), else
JAX's own `JAX_COMPILATION_CACHE_DIR` when it is set, else `~/.cache/cbjax/jax` (under
`$CBJAX_CACHE_DIR` when that is set). Entries are keyed by the program, the JAX version and
the device, so a hit is the same executable. Every front (`LLM`, `python -m cbjax.serve`,
the experiments) calls `enable` once; `--compilation_cache` / `enable(path)` moves it,
`off` disables it.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "CBJAX_COMPILATION_CACHE"
# What turns the cache off, in the variable or the flag (`0` was once a directory named "0").
OFF = ("off", "0", "false", "no", "none")
# Programs that compile faster than this are not worth a file (tiny host-side ops).
MIN_COMPILE_SECONDS = 0.2


def cache_root() -> Path:
    """Where cbjax keeps what it derives once per machine (compiled programs, the CPU kernels'
    build, converted weights, tokenizers): `$CBJAX_CACHE_DIR`, else `~/.cache/cbjax`."""
    return Path(os.environ.get("CBJAX_CACHE_DIR") or Path.home() / ".cache" / "cbjax")


def default_dir() -> str:
    return str(cache_root() / "jax")


def enable(path: str | None = None) -> str | None:
    """Turn the persistent cache on at `path` (None: the environment's choice, above; "off":
    turn it off). Returns the directory in use, or None when off. A directory someone else
    configured (JAX's own variable or config, the test suite's) is kept unless `path` names one."""
    from jax.experimental.compilation_cache import compilation_cache

    path = path or os.environ.get(ENV)
    if path is not None and str(path).strip().lower() in OFF:
        if jax.config.jax_enable_compilation_cache:
            jax.config.update("jax_enable_compilation_cache", False)
            compilation_cache.reset_cache()
        return None
    current = jax.config.jax_compilation_cache_dir
    if path is None and current:
        return current
    path = path or default_dir()
    if path != current or not jax.config.jax_enable_compilation_cache:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", path)
        if jax.config.jax_persistent_cache_min_compile_time_secs > MIN_COMPILE_SECONDS:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
        # JAX decides once per process whether the cache is used, at its first compilation:
        # anything compiled before this call (a weight conversion) would have settled it off.
        compilation_cache.reset_cache()
    return path
