"""cbjax: static, dynamic and continuous batching for LLM inference in JAX.

The public API: the front door (`LLM`, and `Replicas` for data parallelism, both keeping the
`Front` contract), its knobs (`EngineArgs`), what goes in (`SamplingParams`,
`StructuredOutput`, a `Prompt`) and what comes out (`RequestOutput`, and `Load`, what an
engine holds). Studies that need more import `cbjax.experimental`."""

from cbjax.core import EngineArgs, Load
from cbjax.front import Front, Prompt
from cbjax.llm import LLM
from cbjax.parallel.replicas import Replicas
from cbjax.request import RequestOutput, SamplingParams, StructuredOutput

__all__ = ["EngineArgs", "Front", "LLM", "Load", "Prompt", "Replicas", "RequestOutput", "SamplingParams",
           "StructuredOutput"]
__version__ = "0.1.0"
