"""`python -m experiments NAME [--flags]`: run one experiment script (`--help` for its flags);
with no name, list them with their first line."""

from __future__ import annotations

import ast
import pathlib
import runpy
import sys

HERE = pathlib.Path(__file__).resolve().parent
KINDS = ("studies", "benchmarks")


def scripts() -> dict[str, str]:
    """Every script's name -> its module."""
    return {path.stem: f"experiments.{kind}.{path.stem}" for kind in KINDS
            for path in sorted((HERE / kind).glob("*.py")) if path.stem != "__init__"}


def summary(module: str) -> str:
    path = HERE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def main() -> None:
    found = scripts()
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "list"):
        for kind in KINDS:
            print(f"{kind}:")
            for name, module in found.items():
                if module.split(".")[1] == kind:
                    print(f"  {name:<24} {summary(module)[:100]}")
        print("\nrun one: python -m experiments NAME [--flags]   (NAME --help: its flags)")
        return
    name = sys.argv[1].removesuffix(".py")
    if name not in found:
        sys.exit(f"no experiment {name!r}; the experiments: {', '.join(found)}")
    sys.argv = [f"experiments {name}", *sys.argv[2:]]
    runpy.run_module(found[name], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
