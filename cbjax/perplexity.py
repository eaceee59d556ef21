"""Perplexity of a token stream, in non-overlapping windows scored independently."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.loading import Model
from cbjax.models import quant
from cbjax.models.kv_cache import SlotCache
from cbjax.models import forward


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows; a trailing window shorter than 2 tokens predicts nothing."""
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    out = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    return [w for w in out if len(w) >= 2]


@functools.partial(jax.jit, static_argnames=("config",))
def _window_nll(params, config, tokens, length):
    cache = SlotCache.init(config, 1, tokens.shape[0], quant.activation_dtype(params))
    logits, _ = forward(params, config, cache, tokens[None], jnp.zeros((1,), jnp.int32), num_valid=length[None])
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[1:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(jnp.arange(tokens.shape[0] - 1) < length - 1, nll, 0.0))


@functools.partial(jax.jit, static_argnames=("config", "chunk", "kv_dtype"))
def _window_nll_chunked(params, config, tokens, length, chunk: int, kv_dtype):
    """The window's NLL scored `chunk` tokens per forward, each reading the tokens before it
    from a `kv_dtype` cache (so an 8-bit KV cache's error shows, as it does in decode)."""
    n = tokens.shape[0]
    targets = jnp.concatenate([tokens[1:], jnp.zeros((1,), tokens.dtype)])

    def body(i, carry):
        cache, total = carry
        start = i * chunk
        piece = jax.lax.dynamic_slice_in_dim(tokens, start, chunk)[None]
        valid = jnp.clip(length - start, 0, chunk)
        logits, cache = forward(params, config, cache, piece, start[None], num_valid=valid[None])
        logp = jax.nn.log_softmax(logits[0], axis=-1)
        position = start + jnp.arange(chunk)
        want = jax.lax.dynamic_slice_in_dim(targets, start, chunk)
        nll = -jnp.take_along_axis(logp, want[:, None], axis=-1)[:, 0]
        return cache, total + jnp.sum(jnp.where(position + 1 < length, nll, 0.0))

    cache = SlotCache.init(config, 1, n, kv_dtype)
    return jax.lax.fori_loop(0, n // chunk, body, (cache, jnp.float32(0.0)))[1]


def window_nlls(model: Model, token_ids: list[int], window: int = 256, kv_dtype=None,
                chunk: int = 0) -> list[tuple[float, int]]:
    """(summed NLL in nats, predicted tokens) of each window: scored whole (`chunk` 0), or
    `chunk` tokens per forward over a `kv_dtype` KV cache (default the model's dtype;
    `window` must be a multiple of `chunk`)."""
    if chunk and window % chunk:
        raise ValueError(f"window ({window}) must be a multiple of chunk ({chunk})")
    kv_dtype = jnp.dtype(kv_dtype or quant.activation_dtype(model.params))
    out = []
    for w in windows(token_ids, window):
        padded = np.zeros(window, np.int32)
        padded[:len(w)] = w
        args = (model.params, model.config, jnp.asarray(padded), jnp.int32(len(w)))
        nll = _window_nll_chunked(*args, chunk, kv_dtype) if chunk else _window_nll(*args)
        out.append((float(nll), len(w) - 1))
    if not out:
        raise ValueError("text too short: need at least 2 tokens")
    return out


def negative_log_likelihood(model: Model, token_ids: list[int], window: int = 256) -> tuple[float, int]:
    """(summed NLL in nats, number of predicted tokens) over the windows."""
    per_window = window_nlls(model, token_ids, window)
    return sum(n for n, _ in per_window), sum(c for _, c in per_window)


def perplexity(model: Model, token_ids: list[int], window: int = 256) -> float:
    total, count = negative_log_likelihood(model, token_ids, window)
    return float(np.exp(total / count))
