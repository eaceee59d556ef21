"""The seams' written contracts: every engine keeps `StepEngine` (cbjax/runtime/interface.py),
every core `Core` (cbjax/core/interface.py), every front `Front` (cbjax/front.py); the server
and the experiments use nothing of a front but that surface; nothing asks an engine what it
can do with `getattr`."""

from __future__ import annotations

import inspect
import pathlib
import ast
import re
import typing

import pytest

from cbjax import LLM, SamplingParams
from cbjax.core.disaggregation import DisaggregatedCore
from cbjax.core.engine_core import EngineCore
from cbjax.core.interface import Core
from cbjax.front import Front
from cbjax.parallel.replicas import Replicas
from cbjax.runtime.engine import Engine
from cbjax.runtime.interface import EngineInfo, StepEngine
from cbjax.runtime.scale.pipeline import PipelineEngine
from cbjax.simulator import SimulatedEngine
from tests.internals import engine_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
CAPABILITIES = ("reads_block_tables", "can_run_ahead", "supports_structured_output", "takes_sampler_variants")
OPTIONS = dict(num_slots=2, max_seq_len=32)


def protocol_members(protocol) -> dict[str, object]:
    """The protocol's own members: attributes (annotated) and methods/properties (defined)."""
    members = {name: None for name in typing.get_type_hints(protocol)}
    for name, value in vars(protocol).items():
        if not name.startswith("_") and (callable(value) or isinstance(value, property)):
            members[name] = value
    return members


def breaches(obj, protocol) -> list[str]:
    """What `obj` lacks of `protocol`, or where its methods' parameters differ from the contract's
    (the same names in the same order; an implementation may add parameters with defaults)."""
    found = []
    for name, spec in protocol_members(protocol).items():
        if not hasattr(obj, name):
            found.append(f"{type(obj).__name__} has no {name}")
            continue
        if callable(spec) and not isinstance(spec, property):
            wanted = [p for p in inspect.signature(spec).parameters if p != "self"]
            have = inspect.signature(getattr(obj, name)).parameters
            if any(p.kind == p.VAR_KEYWORD for p in have.values()):
                continue
            named = [p for p in have if have[p].kind not in (inspect.Parameter.VAR_POSITIONAL,)]
            if named[:len(wanted)] != wanted:
                found.append(f"{type(obj).__name__}.{name}{tuple(named)} breaks {protocol.__name__}.{name}"
                             f"{tuple(wanted)}")
    return found


def test_the_breach_finder_finds_a_missing_member_and_a_renamed_parameter():
    class Partial:
        clock = staticmethod(lambda: 0.0)

        def add(self, req):  # the contract names it `request`
            pass

    found = breaches(Partial(), Core)
    assert "Partial has no run_round" in found
    assert any(f.startswith("Partial.add") for f in found)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **OPTIONS)


def test_engine_kinds_keep_the_engine_contract(llm):
    pipeline = LLM("tiny-llama", pipeline_stages=2, **OPTIONS)
    simulated = LLM("tiny-llama", simulate="h100", **OPTIONS)
    for front, kind in [(llm, Engine), (pipeline, PipelineEngine), (simulated, SimulatedEngine)]:
        engine = engine_of(front)
        assert type(engine) is kind
        assert isinstance(engine, StepEngine) and breaches(engine, StepEngine) == []
        for name in CAPABILITIES:  # declared on the class, not probed
            assert isinstance(vars(type(engine)).get(name, getattr(type(engine), name)), bool), name
        info = engine.info()
        assert isinstance(info, EngineInfo) and info.num_slots == OPTIONS["num_slots"]
        assert info.max_model_len == front.max_model_len == OPTIONS["max_seq_len"]
    assert pipeline.engine_info.kind == "pipeline" and pipeline.engine_info.num_devices == 2
    assert simulated.engine_info.kind == "simulated" and simulated.wait_for_compiles() == 0
    assert not engine_of(pipeline).can_run_ahead and not engine_of(simulated).supports_structured_output


def test_core_kinds_keep_the_core_contract(llm):
    apart = LLM("tiny-llama", prefill_instances=1, decode_instances=1, **OPTIONS)
    for front, kind in [(llm, EngineCore), (apart, DisaggregatedCore)]:
        assert type(front.core) is kind
        assert isinstance(front.core, Core) and breaches(front.core, Core) == []
    apart.use_length_predictor(len)  # reaches every instance that admits
    assert all(c.predict_len is len for c in apart.core.prefill)
    apart.core.close()


def test_fronts_keep_the_front_contract(llm):
    replicas = Replicas("tiny-llama", data_parallel=2, **OPTIONS)
    for front in (llm, replicas):
        assert isinstance(front, Front) and breaches(front, Front) == []
        assert front.max_model_len == OPTIONS["max_seq_len"] and front.engine_info.num_slots == OPTIONS["num_slots"]
    assert replicas.data_parallel == 2 and llm.data_parallel == 1
    asks = SamplingParams(max_tokens=2, prompt_logprobs=1)
    assert replicas.prompt_scorer([1, 2, 3], asks) is None  # scored where add_request places it
    assert llm.prompt_scorer([1, 2, 3], asks) is None  # its step scores the prompt (cbjax/prompt_scores.py)
    assert llm.core.engine.prompt_scorer([1, 2, 3], 1).run()[1] is not None  # where a step cannot: a forward of its own
    with pytest.raises(ValueError, match="empty prompt"):
        llm.prompt_scorer([], asks)
    arrived = []
    replicas.watch_arrivals(lambda: bool(arrived))
    assert all(r.core.arrivals_pending is not None for r in replicas.replicas)
    replicas.close()


HANDLES = ("llm", "core", "front", "replica")  # names that hold an LLM, a front or a core
INTERNALS = frozenset({"engine", "scheduler", "pages"})


def _name_of(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name_of(node.func)
    if isinstance(node, ast.Subscript):
        return _name_of(node.value)
    return ""


def reach_throughs(source: str) -> list[str]:
    """Where `source` reads an engine, a scheduler or a page pool off an LLM, a front or a core
    (whatever holds it: a name, an attribute, a call, an item, whose name says llm, core, front
    or replica), or a front's core."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        holder = _name_of(node.value).lower()
        if holder == "cbjax":  # the package's own modules: cbjax.core
            continue
        reaches = node.attr in INTERNALS and any(h in holder for h in HANDLES)
        reaches |= node.attr == "core" and any(h in holder for h in ("llm", "front", "replica"))
        if reaches:
            found.append((node.lineno, f"{node.lineno}: {ast.unparse(node)}"))
    return [where for _, where in sorted(found)]


def test_the_reach_through_finder_finds_every_spelling():
    source = ("a = llm.engine\nb = self.llm.core\nc = core.scheduler\nd = static_llm.pages\n"
              "e = LLM('x').engine\nf = fronts[0].scheduler\ng = self.engine\nh = cbjax.core\n"
              "i = replicas.replicas[0].core\n")
    assert reach_throughs(source) == ["1: llm.engine", "2: self.llm.core", "3: core.scheduler", "4: static_llm.pages",
                                      "5: LLM('x').engine", "6: fronts[0].scheduler", "9: replicas.replicas[0].core"]


def test_the_server_and_the_experiments_use_only_a_fronts_surface():
    """0 reads of an engine, scheduler or page pool through an LLM, a front or a core from
    experiments/ and the server: they read `load()` and `snapshot()`."""
    found = {}
    for path in sorted([*(ROOT / "cbjax" / "serve").glob("*.py"), *(ROOT / "experiments").rglob("*.py")]):
        hits = reach_throughs(path.read_text(encoding="utf-8"))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert found == {}


def test_nothing_probes_an_engine_for_a_capability():
    probe = re.compile(r"getattr\([^,]*engine[^,]*,\s*\"(\w+)\"")
    found = [f"{path.relative_to(ROOT)}: {m}" for path in sorted((ROOT / "cbjax").rglob("*.py"))
             for m in probe.findall(path.read_text(encoding="utf-8"))]
    assert found == []
