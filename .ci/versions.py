"""Print what a CI leg tests (Python, JAX, jaxlib, torch) and check it against cbjax's pins:
the installed JAX must be one pyproject.toml admits on this Python, and with --newest the
newest release the pins admit (asked of the package index with `pip index versions`)."""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import platform
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.version import Version


def admitted(package: str):
    """The specifier cbjax's own requirements give `package` on this Python."""
    for line in metadata.requires("cbjax") or []:
        req = Requirement(line)
        if req.name == package and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return req.specifier
    raise SystemExit(f"cbjax does not require {package} on Python {platform.python_version()}")


def published(package: str) -> list[Version]:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package],
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("Available versions:"))
    return [Version(v.strip()) for v in line.split(":", 1)[1].split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--newest", action="store_true", help="require the newest JAX the pins admit")
    args = parser.parse_args()
    versions = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "torch", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    spec = admitted("jax")
    print("CI leg:", json.dumps(versions), f"(pins admit jax{spec})")
    if versions["jax"] is None or Version(versions["jax"]) not in spec:
        raise SystemExit(f"jax {versions['jax']} is not what pyproject.toml admits here: jax{spec}")
    if args.newest:
        newest = max(v for v in published("jax") if v in spec and not v.is_prerelease)
        if Version(versions["jax"]) != newest:
            raise SystemExit(f"jax {versions['jax']} installed, but the newest the pins admit is {newest}")


if __name__ == "__main__":
    main()
