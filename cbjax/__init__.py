"""cbjax: static, dynamic and continuous batching for LLM inference in JAX."""

from cbjax.core import EngineArgs
from cbjax.llm import LLM
from cbjax.request import RequestOutput, SamplingParams, StructuredOutput

__all__ = ["EngineArgs", "LLM", "RequestOutput", "SamplingParams", "StructuredOutput"]
__version__ = "0.1.0"
