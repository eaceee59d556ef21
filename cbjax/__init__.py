"""cbjax: static, dynamic and continuous batching for LLM inference in JAX."""

from cbjax.core import EngineArgs
from cbjax.llm import LLM
from cbjax.request import RequestOutput, SamplingParams

__all__ = ["EngineArgs", "LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
