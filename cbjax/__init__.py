"""cbjax: static, dynamic and continuous batching for LLM inference in JAX."""

from cbjax.llm import LLM
from cbjax.request import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
