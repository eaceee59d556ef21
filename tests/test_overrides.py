"""Every method that overrides one is marked `@override` (typing_extensions on 3.11), and the
type checker holds the marking and the seams: mypy (pinned in the test extra, configured in
pyproject.toml) over cbjax, pallas_kernels and tests/typed/seams.py, where each Protocol's
implementations must be assignable to it. mypy reports a missing mark (`explicit-override`)
and a mark on a method that overrides nothing. Its other findings in cbjax's own code are
not held yet."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import cbjax
import pallas_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]


def classes():
    seen = set()
    for package in (cbjax, pallas_kernels):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for cls in vars(module).values():
                if inspect.isclass(cls) and cls.__module__ == module.__name__ and cls not in seen:
                    seen.add(cls)
                    yield cls


def unmarked_overrides(cls) -> list[str]:
    """The methods `cls` defines (its own source, not a metaclass's) that a base also has,
    without `@override`."""
    found = []
    for name, value in vars(cls).items():
        fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if (name.startswith("__") or not inspect.isfunction(fn)
                or fn.__qualname__ != f"{cls.__qualname__}.{name}"):
            continue
        if any(name in vars(base) for base in cls.__mro__[1:] if base is not object):
            if not getattr(fn, "__override__", False):
                found.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return found


def test_every_override_is_marked():
    found = [f for cls in classes() for f in unmarked_overrides(cls)]
    assert found == []


def test_the_finder_sees_a_missing_mark():
    from typing_extensions import override

    class Base:
        def run(self):
            pass

        def stop(self):
            pass

    class Child(Base):
        @override
        def run(self):
            pass

        def stop(self):
            pass

    assert unmarked_overrides(Child) == [f"{__name__}.{Child.__qualname__}.stop"]


def mypy(*paths: str, cache: pathlib.Path) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(cache), "--no-error-summary", "--show-error-codes", *paths],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stderr  # 2: mypy itself failed
    return [line for line in done.stdout.splitlines() if ": error:" in line]


def held(errors: list[str]) -> list[str]:
    """The errors this test holds: any in the seams file, and every override's marking."""
    return [e for e in errors if e.startswith("tests/typed/") or "[explicit-override]" in e
            or "marked as an override" in e]


def test_the_type_checker_holds_the_seams_and_the_overrides(tmp_path):
    errors = mypy("cbjax", "pallas_kernels", "tests/typed/seams.py", cache=tmp_path / "mypy")
    assert held(errors) == []


def test_the_type_checker_finds_a_broken_seam_and_a_wrong_mark(tmp_path):
    """A proposer whose `propose` takes other arguments, an override left unmarked and a mark
    on nothing: each is named."""
    bad = tmp_path / "bad_seams.py"
    bad.write_text('''
from typing_extensions import override
from cbjax.scheduling.speculation import Proposer

class Wrong:
    def propose(self, requests: list[int]) -> list[list[int]]:
        return []
    def forget(self, request_id: str) -> None: ...
    def warmup(self) -> int:
        return 0

class Base:
    def run(self) -> None: ...

class Child(Base):
    def run(self) -> None: ...
    @override
    def walk(self) -> None: ...

def proposer(p: Wrong) -> Proposer:
    return p
''')
    errors = mypy(str(bad), cache=tmp_path / "mypy")
    text = "\n".join(errors)
    assert re.search(r'Incompatible return value type \(got "Wrong", expected "Proposer"\)', text)
    assert '"run" is not using @override' in text
    assert '"walk" is marked as an override' in text


@pytest.mark.parametrize("seam", ["StepEngine", "Core", "Front", "Proposer"])
def test_the_seams_file_names_every_protocol(seam):
    assert f"-> {seam}:" in (ROOT / "tests" / "typed" / "seams.py").read_text()
