"""An OpenAI-compatible HTTP server over the engine: `python -m cbjax.serve --model ...`.

`Server(llm, model_name)` serves `/v1/completions`, `/v1/chat/completions` (both with
SSE streaming), `/v1/models`, `/health` and `/metrics` (Prometheus, vLLM's names).
"""

from cbjax.serve.app import Server

__all__ = ["Server"]
