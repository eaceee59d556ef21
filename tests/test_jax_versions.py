"""What the suite runs on is what the pins admit, and a deprecation in cbjax's own code is a
failure (docs/jax_versions.md; CI runs Python 3.11 with JAX 0.10.x and Python 3.12 with the
newest JAX the pins admit)."""

from __future__ import annotations

import importlib.metadata as metadata
import warnings

import jax
import pytest
from packaging.requirements import Requirement
from packaging.version import Version


def _admitted(package: str):
    for line in metadata.requires("cbjax") or []:
        req = Requirement(line)
        if req.name == package and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return req.specifier
    raise AssertionError(f"cbjax does not require {package} on this Python")


@pytest.mark.parametrize("package", ["jax", "jaxlib"])
def test_the_installed_jax_is_one_the_pins_admit(package):
    installed = Version(metadata.version(package))
    assert installed in _admitted("jax"), f"{package} {installed} is outside the pins"


def test_jax_and_jaxlib_are_one_release():
    assert Version(metadata.version("jaxlib")).release[:2] == Version(jax.__version__).release[:2]


@pytest.mark.parametrize("module", ["cbjax.runtime.engine", "pallas_kernels.tuning", "experiments.lib.common"])
def test_a_deprecation_raised_in_our_code_fails_the_test(module):
    with pytest.raises(DeprecationWarning, match="going away"):
        warnings.warn_explicit("an API going away", DeprecationWarning, module.replace(".", "/") + ".py", 1,
                               module=module)


def test_a_deprecation_raised_elsewhere_stays_a_warning():
    with pytest.warns(DeprecationWarning):
        warnings.warn_explicit("an API going away", DeprecationWarning, "somebody/else.py", 1, module="somebody.else")
