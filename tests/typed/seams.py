"""What mypy checks (tests/test_overrides.py runs it): each implementation of a seam's Protocol
is assignable to it, its methods' signatures and its attributes' types included. Never run,
only type-checked: a function per pair, returning the implementation as the contract."""

from __future__ import annotations

from cbjax.core.disaggregation import DisaggregatedCore
from cbjax.core.draft import DraftProposer
from cbjax.core.engine_core import EngineCore
from cbjax.core.interface import Core
from cbjax.front import Front
from cbjax.llm import LLM
from cbjax.parallel.replicas import Replicas
from cbjax.runtime.engine import Engine
from cbjax.runtime.interface import StepEngine
from cbjax.runtime.scale.pipeline import PipelineEngine
from cbjax.scheduling.speculation import NgramProposer, Proposer, SimulatedProposer
from cbjax.simulator.sim_engine import SimulatedEngine


def engine(e: Engine) -> StepEngine:
    return e


def pipeline_engine(e: PipelineEngine) -> StepEngine:
    return e


def simulated_engine(e: SimulatedEngine) -> StepEngine:
    return e


def engine_core(c: EngineCore) -> Core:
    return c


def disaggregated_core(c: DisaggregatedCore) -> Core:
    return c


def llm(f: LLM) -> Front:
    return f


def replicas(f: Replicas) -> Front:
    return f


def ngram_proposer(p: NgramProposer) -> Proposer:
    return p


def draft_proposer(p: DraftProposer) -> Proposer:
    return p


def simulated_proposer(p: SimulatedProposer) -> Proposer:
    return p
