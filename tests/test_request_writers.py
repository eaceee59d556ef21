"""Only scheduling/ writes a `Request` after it is created: a field assigned, augmented or
mutated in place (`r.state = ...`, `r.metrics.token_times.append(...)`) anywhere else in
cbjax/, experiments/ or pallas_kernels/ fails here. Found by AST, whatever the variable is
called."""

import ast
import dataclasses
import pathlib

from cbjax.request import Request, RequestMetrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIELDS = frozenset(f.name for f in dataclasses.fields(Request))
METRICS = frozenset(f.name for f in dataclasses.fields(RequestMetrics))
MUTATORS = frozenset({"append", "extend", "insert", "pop", "clear", "remove", "sort", "update", "setdefault"})
WRITERS = ("cbjax/scheduling/", "cbjax/request.py")  # the scheduler, and the request's own methods
# Objects that share a field name with Request but are not requests: an engine's device `state`.
NOT_REQUESTS = ("engine",)


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        found = [node.func.value]
    elif isinstance(node, ast.Delete):
        found = node.targets
    else:
        return []
    flat: list[ast.expr] = []
    for t in found:
        flat += t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
    return flat


def request_writes(source: str) -> list[str]:
    """Where `source` writes a Request field through a name other than `self`: `x.field`,
    `x.field[i]`, `x.field.append(...)`, `x.metrics.field`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            while isinstance(target, ast.Subscript):
                target = target.value
            chain = []
            while isinstance(target, ast.Attribute):
                chain.append(target.attr)
                target = target.value
            chain.reverse()
            if not chain or not isinstance(target, ast.Name) or target.id == "self":
                continue
            if any(word in target.id for word in NOT_REQUESTS):
                continue
            if chain[0] in FIELDS and (chain[0] != "metrics" or len(chain) == 1 or chain[1] in METRICS):
                found.append((node.lineno, f"{node.lineno}: {target.id}.{'.'.join(chain)}"))
    return [where for _, where in sorted(found)]


def test_the_writer_finder_finds_every_kind():
    source = ("r.state = 1\nreq.slot, x = 2, 3\nholder.output_token_ids.append(4)\nw.metrics.finish_time = 5\n"
              "a.logprobs[0] = 6\nb.num_prefilled += 7\nself.state = 8\nengine.state = 9\nc.other = 10\n")
    assert [w.split(": ")[1] for w in request_writes(source)] == [
        "r.state", "req.slot", "holder.output_token_ids", "w.metrics.finish_time", "a.logprobs", "b.num_prefilled"]


def test_only_scheduling_writes_a_request():
    writes = []
    for package in ("cbjax", "experiments", "pallas_kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(WRITERS):
                continue
            writes += [f"{rel}:{w}" for w in request_writes(path.read_text(encoding="utf-8"))]
    assert writes == []
