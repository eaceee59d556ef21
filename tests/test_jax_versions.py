"""What the suite runs on is what the pins admit, and a deprecation in cbjax's own code is a
failure (docs/jax_versions.md; CI runs Python 3.11 with JAX 0.10.x and Python 3.12 with the
newest JAX the pins admit)."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import pathlib
import warnings

import jax
import pytest
from packaging.version import Version

# CI's own check of a leg's versions (.ci/versions.py), tested here with the suite.
_spec = importlib.util.spec_from_file_location(
    "ci_versions", pathlib.Path(__file__).resolve().parents[1] / ".ci" / "versions.py")
ci_versions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ci_versions)


@pytest.mark.parametrize("package", ["jax", "jaxlib"])
def test_the_installed_jax_is_one_the_pins_admit(package):
    installed = Version(metadata.version(package))
    assert installed in ci_versions.admitted("jax"), f"{package} {installed} is outside the pins"


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
