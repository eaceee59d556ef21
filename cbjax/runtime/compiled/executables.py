"""Compiled step programs kept on disk, so that a warm start neither traces nor compiles.

JAX's persistent compilation cache (cbjax/compile_cache.py) skips XLA's compile, but its
key is the lowered program: every start still traces and lowers each step first, most of a
warm server's warm-up (docs/code_measurements.md). Here the serialized executable is keyed
by what the trace depends on instead: cbjax's own source, the JAX version and flags, the
backend, the static arguments and the arguments' pytree structure, shapes, dtypes and
shardings. Same key, same program: the
source digest changes with any edit of cbjax or pallas_kernels, and an entry that fails to
load is compiled again. The files sit beside JAX's cache (`cbjax-executables/`) and are on
and off with it.
"""

from __future__ import annotations

import collections
import copyreg
import functools
import hashlib
import importlib
import os
import pickle
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib
from jax._src import config as jax_config  # a thread's own override of the cache's threshold
from jax._src import layout as jax_layout
from jax.experimental import serialize_executable

from pallas_kernels import tuning
from pallas_kernels.ragged_paged_attention.kernel import cpu_interpreter

SUBDIR = "cbjax-executables"
# Programs kept loaded in this process, most recently used last: engines of the same shapes
# (replicas, a rebuilt LLM) share them, as they share a jit's cache.
MAX_LOADED = 64
_LOADED: collections.OrderedDict = collections.OrderedDict()
_LOADED_LOCK = threading.Lock()  # engines compile on background threads too (runtime/compiled/step_programs.py)
# "read", "compiled", "stored": what `compiled` did, counted over this process.
COUNTS: collections.Counter = collections.Counter()
# Files hashed for the source digest: every module a step's trace can run.
_PACKAGES = ("cbjax", "pallas_kernels")



@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A hash of every Python file of cbjax and pallas_kernels (read once a process)."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def directory() -> Path | None:
    """Where the executables live: beside JAX's persistent cache, when that is on."""
    if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
        return None
    return Path(jax.config.jax_compilation_cache_dir) / SUBDIR


def _leaf_signature(leaf) -> tuple:
    aval = getattr(leaf, "aval", None)
    sharding = getattr(leaf, "sharding", None)
    return (tuple(leaf.shape), str(leaf.dtype), bool(getattr(aval, "weak_type", False)),
            _sharding_signature(sharding) if sharding is not None else None)


def _sharding_signature(sharding) -> tuple:
    """A sharding's repr and its devices in order: a mesh's repr does not name its devices,
    and replicas run the same shapes on meshes of different devices."""
    devices = getattr(sharding, "_device_assignment", None) or sorted(sharding.device_set, key=lambda d: d.id)
    return repr(sharding), tuple(d.id for d in devices)


def key(name: str, args: tuple, static: dict) -> str:
    """The cache key of `name` called on `args` (arrays in pytrees) with `static` arguments."""
    leaves, tree = jax.tree.flatten(args)
    device = jax.devices()[0]
    parts = (source_digest(), name, jax.__version__, jaxlib.__version__,
             device.platform, device.client.platform_version, getattr(device, "device_kind", ""),
             os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision,
             cpu_interpreter(),  # a global the Pallas kernels read when traced on a CPU
             tuning.choices_digest(),  # the tuned launches the kernels read when traced
             repr(tree), sorted((k, repr(v)) for k, v in static.items()), [_leaf_signature(x) for x in leaves])
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _pickle_auto_layout_by_name() -> None:
    """From JAX 0.12 a compiled program's output types carry JAX's `AutoLayout`, a singleton
    compared by identity. Pickled as an object it loads as a second instance, so an array a
    loaded program returns fails the type check of the next program traced over it (a scan's
    carry: "the layouts do not match"). Pickled by name it loads as the one instance."""
    auto = getattr(jax_layout, "AutoLayout", None)
    if auto is not None:
        copyreg.pickle(type(auto), lambda _: "AutoLayout")


_pickle_auto_layout_by_name()


def load(path: Path):
    """The `jax.stages.Compiled` stored at `path`, or None (missing, or unreadable: then removed)."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        (payload, in_tree, out_tree), device_ids = pickle.loads(blob)
        devices = {d.id: d for d in jax.devices()}
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                         execution_devices=[devices[i] for i in device_ids])
    except Exception:  # a truncated or stale file: compile again
        path.unlink(missing_ok=True)
        return None


def store(path: Path, compiled) -> None:
    """Write `compiled` atomically (concurrent writers of one key write the same bytes); a
    program that cannot be serialized is simply not stored."""
    try:
        # The devices it runs on, in the program's order (a mesh's, or the one device).
        device_ids = [d.id for d in compiled._executable.xla_executable.local_devices()]
        blob = pickle.dumps((serialize_executable.serialize(compiled), device_ids))
    except Exception:  # a program that cannot be serialized (JAX internals may move): not stored
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)
    COUNTS["stored"] += 1


def compiled(jitted, jit_options: dict, args: tuple, static: dict):
    """`jitted` (a `jax.jit` of a function with `jit_options`) compiled for `args` and
    `static`: this process's copy when it has one, else read from disk when the store holds
    it, else traced, compiled and stored. Call it with `args` alone."""
    name = jitted.__wrapped__.__name__
    program_key = key(name, args, static)
    with _LOADED_LOCK:
        program = _LOADED.get(program_key)
        if program is not None:
            _LOADED.move_to_end(program_key)
            return program
    folder = directory()
    path = folder / program_key if folder is not None else None
    program = load(path) if path is not None else None
    COUNTS["read" if program is not None else "compiled"] += 1
    if program is None and path is None:
        program = jitted.lower(*args, **static).compile()
    elif program is None:
        # This store is the program's cache: JAX's would hold a second copy nothing reads (its
        # write costs as much as this one), so this thread's compile skips it. The module is named
        # after this key, which JAX's cache then never holds: an XLA:CPU executable that JAX read
        # from its cache serializes into one whose first call fails ("Function ... not found").
        renamed = functools.wraps(jitted.__wrapped__)(lambda *a, **k: jitted.__wrapped__(*a, **k))
        renamed.__name__ = f"{name}_{program_key[:16]}"
        with jax_config.persistent_cache_min_compile_time_secs(float("inf")):
            program = jax.jit(renamed, **jit_options).lower(*args, **static).compile()
        store(path, program)
    with _LOADED_LOCK:
        _LOADED[program_key] = program
        while len(_LOADED) > MAX_LOADED:
            _LOADED.popitem(last=False)
    return program


def forget() -> None:
    """Drop this process's copies (as `jax.clear_caches` drops the jit caches)."""
    _LOADED.clear()
