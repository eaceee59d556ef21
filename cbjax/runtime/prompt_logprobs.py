"""Prompt log-probabilities (vLLM's `prompt_logprobs`, the completions API's `echo` with
`logprobs`) for an engine whose step does not score prompts (`scores_prompts`: a pipeline's
stages; the step of every other engine does, cbjax/prompt_scores.py): the model over the
prompt, outside the batched step, with each position's log-softmax. The forward runs in chunks
over a one-sequence cache of its own (`PromptScorer`), so that a server can interleave it with
the batched step (serve/engine_loop.py): beside running streams a small chunk at a time, with a
bounded share of the engine's time, so a long prompt's scoring never stalls them for its whole
forward. One program per chunk size serves every prompt of an engine (the cache holds
`max_len` tokens and the top `k_max` are computed; a request's k takes the first k).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading

import jax
import numpy as np

from cbjax.models import forward
from cbjax.models import quant
from cbjax.models.kv_cache import SlotCache
from cbjax.models.ops import XLA
from cbjax.prompt_scores import PromptScores
from cbjax.request import TokenLogprob
from cbjax.runtime.traced.step import score_columns

# Tokens per forward: small beside running streams (a chunk then costs about one decode step),
# large when nothing else runs.
SMALL_CHUNK, LARGE_CHUNK = 8, 64


@functools.partial(jax.jit, static_argnames=("config", "k", "ops", "history_block"), donate_argnames=("cache",))
def _chunk_columns(params, config, cache, tokens, targets, start, num_valid, *, k: int, ops=XLA,
                   history_block: int | None = None):
    """`([C, 2 + 2k] float32, cache)` for chunk positions start..start+C-1: the next prompt
    token's (`targets`) log-probability, its rank (1 = likeliest), the top k log-probabilities
    and their ids; the cache with the chunk written."""
    logits, cache = forward(params, config, cache, tokens[None], start[None], num_valid=num_valid[None], ops=ops,
                            history_block=history_block)
    return score_columns(logits[0], targets, k), cache

_compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cbjax-score-compile")
_programs: dict[tuple, concurrent.futures.Future] = {}  # compiled chunk programs, by shapes and settings
_programs_lock = threading.Lock()


class PromptScorer:
    """One prompt's logprobs, a chunk per `advance()`; `result()` once `done`. Its programs (one
    per chunk size) compile on a thread of their own: `ready(chunk)` says whether one has, so an
    engine loop never waits for a compile (a few seconds on a CPU) between two rounds."""

    def __init__(self, params, config, ids: list[int], k: int, max_len: int, k_max: int | None = None,
                 ops=XLA, history_block: int | None = None, largest_chunk: int = LARGE_CHUNK):
        if len(ids) > max_len:
            raise ValueError(f"a prompt of {len(ids)} tokens cannot be scored in {max_len}")
        self.params, self.config, self.ids, self.k = params, config, list(ids), k
        self.k_max = max(k, k_max or 0)
        self.ops, self.history_block = ops, history_block  # the engine's (cpu_kernels.py, its history read)
        self.cache = SlotCache.init(config, 1, max_len + largest_chunk, quant.activation_dtype(params))
        self.start = 0
        self.columns: list[np.ndarray] = []

    def _inputs(self, chunk: int) -> tuple[tuple, int]:
        """The chunk program's array arguments for the next `chunk` positions, and how many of
        them have a next token to score."""
        s = self.start
        tokens, targets = np.zeros(chunk, np.int32), np.zeros(chunk, np.int32)
        piece, nexts = self.ids[s:s + chunk], self.ids[s + 1:s + chunk + 1]
        tokens[:len(piece)] = piece
        targets[:len(nexts)] = nexts
        return (self.params, self.cache, tokens, targets, np.int32(s), np.int32(len(piece))), len(nexts)

    def _program(self, chunk: int) -> concurrent.futures.Future:
        static = dict(k=self.k_max, ops=self.ops, history_block=self.history_block)
        key = (chunk, self.cache.k[0].shape, str(self.cache.k[0].dtype), self.config, tuple(sorted(static.items())),
               jax.tree.structure(self.params), id(self.params))
        with _programs_lock:
            if key not in _programs:
                params, *rest = self._inputs(chunk)[0]
                _programs[key] = _compiler.submit(
                    lambda: _chunk_columns.trace(params, self.config, *rest, **static).lower().compile())
            return _programs[key]

    def ready(self, chunk: int) -> bool:
        """Whether the program for `chunk` tokens has compiled (starts its compile if not)."""
        return self._program(chunk).done()

    @property
    def done(self) -> bool:
        return self.start >= len(self.ids) - 1

    def advance(self, chunk: int = SMALL_CHUNK) -> None:
        """Score the next `chunk` positions (waits for the program's compile, then for the device)."""
        program = self._program(chunk).result()
        inputs, scored = self._inputs(chunk)
        out, self.cache = program(*inputs)
        self.columns.append(np.asarray(jax.device_get(out))[:scored])
        self.start += chunk

    def run(self) -> list[TokenLogprob | None]:
        """Score the whole prompt at once, in the largest chunks; its `result()`."""
        while not self.done:
            self.advance(LARGE_CHUNK)
        return self.result()

    def result(self) -> list[TokenLogprob | None]:
        """Each prompt token's `TokenLogprob` (with its rank and the k likeliest tokens at that
        position); None for the first, which nothing predicts."""
        scores = PromptScores(self.ids, self.k)
        if self.columns:
            columns = np.concatenate(self.columns)
            scores.fill(np.arange(len(columns)), columns)
        return scores.entries()

