"""The house's shape: no import circle among cbjax/ and pallas_kernels/, no module importing
one from a layer above its own (docs/architecture.md draws the layers), no file over 400
lines and no class over 220 (a class near it has two jobs: split it by responsibility).
Imports inside functions count too."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("cbjax", "pallas_kernels")

# Bottom to top; a module may import from its own layer or any layer below. The longest
# matching prefix places a module.
LAYERS = [
    ("leaves", ["cbjax.checks", "cbjax.knobs", "cbjax.config", "cbjax.request", "cbjax.metrics", "cbjax.workload",
                "cbjax.tokenization", "cbjax.compile_cache", "cbjax.grammar", "cbjax.traces",
                "cbjax.shipped_predictors", "cbjax.prompt_scores", "pallas_kernels"]),
    ("models", ["cbjax.models"]),
    ("loading", ["cbjax.loading", "cbjax.perplexity"]),
    ("scheduling", ["cbjax.scheduling"]),
    ("runtime", ["cbjax.runtime"]),
    ("simulator", ["cbjax.simulator"]),
    ("core", ["cbjax.core"]),
    ("front door", ["cbjax.llm", "cbjax.front"]),
    ("parallel", ["cbjax.parallel"]),
    ("package face", ["cbjax", "cbjax.experimental"]),
    ("serve", ["cbjax.serve"]),
    ("eval", ["cbjax.eval"]),
]


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def layer_of(module: str) -> int:
    """The layer of `module`: its longest matching prefix's (the package face holds `cbjax` itself
    alone, so a new module at the root must be placed)."""
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact = p == "cbjax"
            if (module == p or (not exact and module.startswith(p + "."))) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return rank


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                # A package's face re-exports its members; a member importing it is not a cycle of
                # code, and the face itself is checked as its own module.
                if target and target != name and not name.startswith(target + "."):
                    deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in import_graph().items() for d in sorted(deps)
              if d != "cbjax" and layer_of(d) > layer_of(m)]
    assert upward == []


def test_layers_are_documented():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name, prefixes in LAYERS:
        for p in prefixes:
            if p.startswith("cbjax."):
                path = p.replace(".", "/")
                assert path in doc or path + ".py" in doc, f"docs/architecture.md does not place {path}"


def test_files_and_classes_stay_small():
    too_long = []
    for name, path in modules().items():
        source = path.read_text(encoding="utf-8")
        if source.count("\n") > 400:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 220:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_one_request_passes_through_at_most_13_modules():
    """A greedy `generate` of one prompt, once compiled, runs host code in at most 13 of our
    modules (docs/architecture.md lists them), and enters the front door once per request."""
    import sys

    from cbjax import LLM, SamplingParams

    llm = LLM("tiny-llama", num_slots=4, max_seq_len=64)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # compiles
    calls: dict[str, int] = {}

    def profile(frame, event, arg):
        if event == "call" and str(ROOT) in frame.f_code.co_filename:
            path = pathlib.Path(frame.f_code.co_filename).relative_to(ROOT).as_posix()
            if path.startswith(PACKAGES):
                calls[path] = calls.get(path, 0) + 1

    sys.setprofile(profile)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        sys.setprofile(None)
    assert len(calls) <= 13, "\n".join(sorted(calls))
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert all(path in doc for path in calls), [p for p in calls if p not in doc]


OURS = ("cbjax", "experiments", "pallas_kernels")


def private_reaches(source: str) -> list[str]:
    """Where `source` touches another of our modules' `_underscore` names: imports them, or reads
    them off an imported module or an imported name (`module._helper`, `Class._attr`), or off
    what calling one made (`Class(...)._attr`)."""
    tree = ast.parse(source)
    imported: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                imported.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in OURS)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value.func if isinstance(node.value, ast.Call) else node.value
        if isinstance(owner, ast.Name) and owner.id in imported:
            called = "(...)" if owner is not node.value else ""
            found.append(f"{node.lineno}: {owner.id}{called}.{node.attr}")
    return sorted(found, key=lambda hit: int(hit.split(":")[0]))


def test_the_private_reach_finder_finds_both_kinds():
    source = ("from cbjax.models.transformer import _qkv\nfrom experiments.lib import common\ncommon._ok(1)\n"
              "from cbjax.experimental import BlockManager\nkeys = BlockManager(1, 4)._keys\n")
    assert private_reaches(source) == ["1: from cbjax.models.transformer import _qkv", "3: common._ok",
                                       "5: BlockManager(...)._keys"]


def test_nothing_touches_another_modules_private_names():
    found = {str(path.relative_to(ROOT)): hits for package in OURS for path in sorted((ROOT / package).rglob("*.py"))
             if (hits := private_reaches(path.read_text(encoding="utf-8")))}
    assert found == {}
