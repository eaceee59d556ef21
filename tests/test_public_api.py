"""The public API is `cbjax`'s `__all__` (and lm-eval's backend, `cbjax.eval`'s); studies that
need more import `cbjax.experimental`. By AST: experiments/ import nothing else of cbjax, the server nothing else but its own
modules, and every name of the experimental table resolves and is used."""

import ast
import pathlib

import cbjax
import cbjax.eval
import cbjax.experimental

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = frozenset(cbjax.__all__) | {"__version__"}
EXPERIMENTAL = frozenset(cbjax.experimental.__all__)
EVAL = frozenset(cbjax.eval.__all__)


def cbjax_imports(source: str) -> list[tuple[int, str, str]]:
    """(line, module, name) of every import of cbjax in `source` (name "*" for `import cbjax.x`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "cbjax":
            found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "*") for a in node.names if a.name.split(".")[0] == "cbjax"]
    return found


def outside_the_api(source: str, own: str | None = None) -> list[str]:
    """The imports of cbjax in `source` that are neither public nor experimental (nor, with
    `own`, of that package)."""
    bad = []
    for line, module, name in cbjax_imports(source):
        if own is not None and (module == own or module.startswith(own + ".")):
            continue
        allowed = ((module == "cbjax" and name in PUBLIC) or (module == "cbjax.experimental" and name in EXPERIMENTAL)
                   or (module == "cbjax.eval" and name in EVAL))
        if not allowed:
            bad.append(f"{line}: {module} {name}")
    return bad


def files(*parts: str) -> list[pathlib.Path]:
    return sorted((ROOT.joinpath(*parts)).rglob("*.py"))


def test_the_finder_tells_the_api_from_the_rest():
    source = ("from cbjax import LLM, SamplingParams\nfrom cbjax.experimental import profile\n"
              "from cbjax.scheduling.plan import Row\nimport cbjax.core\nfrom cbjax import traces\n"
              "from cbjax.serve import protocol\n")
    assert outside_the_api(source) == ["3: cbjax.scheduling.plan Row", "4: cbjax.core *", "5: cbjax traces",
                                       "6: cbjax.serve protocol"]
    assert outside_the_api(source, own="cbjax.serve") == ["3: cbjax.scheduling.plan Row", "4: cbjax.core *",
                                                          "5: cbjax traces"]


def test_experiments_import_only_the_public_and_the_experimental_api():
    found = {str(p.relative_to(ROOT)): bad for p in files("experiments")
             if (bad := outside_the_api(p.read_text(encoding="utf-8")))}
    assert found == {}


def test_the_server_imports_only_the_api_and_its_own_modules():
    found = {str(p.relative_to(ROOT)): bad for p in files("cbjax", "serve")
             if (bad := outside_the_api(p.read_text(encoding="utf-8"), own="cbjax.serve"))}
    assert found == {}


def test_every_experimental_name_resolves_and_is_used():
    for name in EXPERIMENTAL:
        assert getattr(cbjax.experimental, name) is not None, name
    used = {name for p in files("experiments") + files("cbjax", "serve")
            for _, module, name in cbjax_imports(p.read_text(encoding="utf-8")) if module == "cbjax.experimental"}
    assert EXPERIMENTAL - used == set(), "names no study or server module imports: drop them from the table"
    assert not hasattr(cbjax.experimental, "no_such_name")
