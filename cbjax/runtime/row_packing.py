"""The host side of a step's inputs: each row's scalars and sampling parameters packed into
the few small arrays a program takes (one host-to-device copy each), and the checks that
a request's sampling parameters fit them."""

from __future__ import annotations

import numpy as np

from cbjax.request import SamplingParams
from cbjax.runtime.device_state import pack_sampling
from cbjax.runtime.engine_config import bucket_for
from cbjax.scheduling.plan import Row

BLANK = SamplingParams(max_tokens=1)  # the sampling parameters of a row that samples nothing


def stop_ids(sampling: SamplingParams, eos_ids, max_stop_tokens: int) -> np.ndarray:
    """The request's stop token ids (EOS included unless ignored), -1 padded."""
    ids = sorted(set(list(sampling.stop_token_ids) + ([] if sampling.ignore_eos else list(eos_ids))))
    if len(ids) > max_stop_tokens:
        raise ValueError(f"at most {max_stop_tokens} stop tokens (EOS included) per request, got {len(ids)}")
    out = np.full((max_stop_tokens,), -1, np.int32)
    out[:len(ids)] = ids
    return out


def check_sampling(sampling: SamplingParams, max_logprobs: int, max_logit_bias: int, vocab: int) -> None:
    """Refuse (ValueError) logprobs and logit_bias an engine with these limits cannot apply."""
    if sampling.logprobs is not None and sampling.logprobs > (max_logprobs or -1):
        raise ValueError(f"logprobs={sampling.logprobs} exceeds this engine's max_logprobs={max_logprobs}"
                         if max_logprobs else "this engine computes no logprobs (max_logprobs=0)")
    if len(sampling.logit_bias) > max_logit_bias:
        raise ValueError(f"at most {max_logit_bias} logit_bias entries per request, got {len(sampling.logit_bias)}")
    bad = [t for t, _ in sampling.logit_bias if t >= vocab]
    if bad:
        raise ValueError(f"logit_bias token ids outside the vocabulary [0, {vocab}): {bad[:8]}")


def sampling_row(row: Row | None, stops: np.ndarray | None, max_stop_tokens: int,
                 max_logit_bias: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's packed sampling parameters (device_state.pack_sampling); None: a row that
    samples nothing."""
    if row is None:
        return pack_sampling(BLANK, 0, np.full(max_stop_tokens, -1, np.int32), max_logit_bias)
    return pack_sampling(row.sampling, row.seed, stops, max_logit_bias)


def history_tokens(row: Row, buckets: list[int]) -> np.ndarray:
    """A row's history (the tokens before it), -1 padded to a length bucket."""
    tokens = np.full(bucket_for(len(row.history), buckets), -1, np.int32)
    tokens[:len(row.history)] = row.history
    return tokens


def copy_pairs(copies: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) ids padded to a power of two (destinations out of range: dropped)."""
    size = 1 << (len(copies) - 1).bit_length()
    src = np.zeros(size, np.int32)
    dst = np.full(size, np.iinfo(np.int32).max, np.int32)
    src[:len(copies)], dst[:len(copies)] = zip(*copies)
    return src, dst
