"""Kernel launch settings chosen on the device that runs them.

A kernel's best launch (block sizes, splits, warps, stages; or XLA's own op instead of the
kernel) depends on the device and the shape, and only the device can say which is fastest.
So each kernel names a small space of candidates for a shape, `tune` times them there (a few
milliseconds each, after one untimed run that compiles), keeps the fastest and remembers it
in a `TuningCache`: a JSON file keyed by kernel, device kind, JAX version and shape, beside
the compilation cache, so the next start reads the choice instead of timing again.

The choices of this process live in one table (`use`, `chosen`) that a kernel's entry point
reads when a program is traced; `None` (nothing chosen) means the kernel's own defaults.
Tuning only chooses among launches that compute the same product: no kernel lives here, and
each kernel's pure-JAX reference beside it is what the tests hold every candidate to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import jax

FILE_NAME = "kernel_tuning.json"

# (kernel, shape) -> the chosen candidate's name, for the device this process tunes for.
_chosen: dict[tuple[str, tuple], str] = {}
# While `recording`: (kernel, shape) -> the arguments' shapes of the first call seen.
_recorded: list[dict] = []


def shape_key(shape: tuple) -> str:
    return ",".join(str(part) for part in shape)


class NamedLaunch:
    """A kernel's launch settings (a frozen dataclass) named by its fields set away from their
    defaults: the name a `TuningCache` keeps and `parse` reads back."""

    @property
    def name(self) -> str:
        return launch_name(self)

    @classmethod
    def parse(cls, name: str):
        return parse_launch(cls, name)


def launch_name(launch) -> str:
    """A launch dataclass's fields set away from their defaults, `form=dot,block_n=128`
    ("default" when none is), the name `parse_launch` reads back."""
    return ",".join(f"{f.name}={getattr(launch, f.name)}" for f in dataclasses.fields(launch)
                    if getattr(launch, f.name) != f.default) or "default"


def parse_launch(cls, name: str):
    """The `cls` launch `launch_name` named (string fields stay strings, the others are ints)."""
    if name == "default":
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(part.split("=", 1) for part in name.split(","))
    return cls(**{k: v if fields[k].type in (str, "str", "str | None") else int(v) for k, v in values.items()})


class TuningCache:
    """Choices by `kernel | device kind | jax version | shape`, each with the sweep that made it
    (`{candidate: seconds, or the error it raised}`), in `path` (None: kept in memory only).
    Written whole after each new choice (a temporary file renamed over the old: a reader
    never sees half a file); a file that does not parse is ignored and rewritten."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path is not None else None
        self._entries: dict[str, dict] | None = None

    @staticmethod
    def key(kernel: str, device_kind: str, shape: tuple) -> str:
        return f"{kernel}|{device_kind}|jax {jax.__version__}|{shape_key(shape)}"

    def entries(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = {}
            if self.path is not None and self.path.exists():
                try:
                    loaded = json.loads(self.path.read_text())
                    self._entries = loaded if isinstance(loaded, dict) else {}
                except (OSError, ValueError):
                    self._entries = {}
        return self._entries

    def get(self, kernel: str, device_kind: str, shape: tuple) -> dict | None:
        return self.entries().get(self.key(kernel, device_kind, shape))

    def put(self, kernel: str, device_kind: str, shape: tuple, choice: str, sweep: dict) -> None:
        self.entries()[self.key(kernel, device_kind, shape)] = {"choice": choice, "sweep": sweep}
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(self.entries(), indent=1, sort_keys=True))
        scratch.replace(self.path)


def time_call(run: Callable[[], object], *, rounds: int = 5, calls: int = 10) -> float:
    """Seconds a call of `run` takes: after one untimed call (which compiles), the median over
    `rounds` of `calls` calls issued back to back and waited for once, so the device's queue
    hides the host's dispatch as it does in a step (a kernel of tens of microseconds timed one
    call at a time would time the host)."""
    jax.block_until_ready(run())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready([run() for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def tune(kernel: str, shape: tuple, candidates: Mapping[str, Callable[[], object]], *, cache: TuningCache,
         device_kind: str, timer: Callable[[str, Callable[[], object]], float] | None = None) -> str:
    """The name of the fastest of `candidates` (name -> a call that runs the kernel so on this
    shape) for `kernel` on `shape`: read from `cache` when it holds this device kind, JAX
    version and shape (and the candidate still exists), else timed by `timer(name, run)`
    (default: `time_call`) and written there. A candidate that raises is left out (its error
    kept in the sweep); if all raise, the first is chosen. The choice is also made this
    process's (`chosen`)."""
    if not candidates:
        raise ValueError(f"tuning {kernel} on {shape}: no candidates")
    hit = cache.get(kernel, device_kind, shape)
    if hit is not None and hit.get("choice") in candidates:
        return use(kernel, shape, hit["choice"])
    timer = timer or (lambda name, run: time_call(run))
    sweep: dict[str, float | str] = {}
    for name, run in candidates.items():
        try:
            sweep[name] = float(timer(name, run))
        except Exception as error:  # a launch the device or its compiler refuses: not a choice
            sweep[name] = f"{type(error).__name__}: {str(error)[:200]}"
    timed = {name: seconds for name, seconds in sweep.items() if isinstance(seconds, float)}
    choice = min(timed, key=timed.get) if timed else next(iter(candidates))
    cache.put(kernel, device_kind, shape, choice, sweep)
    return use(kernel, shape, choice)


def use(kernel: str, shape: tuple, choice: str) -> str:
    """Make `choice` the one `chosen(kernel, shape)` returns from now on (programs traced after)."""
    _chosen[(kernel, tuple(shape))] = choice
    return choice


def chosen(kernel: str, shape: tuple) -> str | None:
    """The candidate this process chose for `kernel` on `shape`, or None (the kernel's defaults)."""
    return _chosen.get((kernel, tuple(shape)))


@contextlib.contextmanager
def recording():
    """Within: every kernel entry point's call (`note`) is kept, `{(kernel, shape): example}`, so
    a caller can trace its programs once and learn which shapes its kernels will see."""
    _recorded.append({})
    try:
        yield _recorded[-1]
    finally:
        _recorded.pop()


def note(kernel: str, shape: tuple, example) -> None:
    """A kernel entry point's call on `shape`; `example` (its arguments as shapes, its settings)
    is what a tuner needs to time candidates on it."""
    if _recorded:
        _recorded[-1].setdefault((kernel, tuple(shape)), example)


def choices_digest() -> str:
    """This process's choices as one string: part of the key of anything compiled from a trace
    that read them (cbjax/runtime/compiled/executables.py)."""
    return repr(sorted(_chosen.items()))


def forget() -> None:
    """Drop this process's choices (programs traced after use the kernels' defaults)."""
    _chosen.clear()
