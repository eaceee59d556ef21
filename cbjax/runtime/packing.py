"""The host side of the one device step (step.py): the token buckets its programs are compiled
for, the round's rows split into calls and packed into a few small arrays (each row's scalars
and sampling parameters, one host-to-device copy each), the checks that a request's sampling
parameters fit them, and a call's result brought back to the host. Nothing here is traced."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from cbjax import grammar
from cbjax.checks import FieldError
from cbjax.request import SamplingParams
from cbjax.runtime.traced.device_state import (FREQUENCY, LOGPROBS, LORA, MAX_TOKENS, MIN_P, MIN_TOKENS, NUM_FLOATS,
                                               NUM_INTS, PRESENCE, REPETITION, SEED, TEMPERATURE, TOP_K, TOP_P)
from cbjax.runtime.packed import HEADER
from cbjax.scheduling.plan import Row


def token_buckets(max_tokens: int, steps: int = 1, floor: int = 1, smallest: int = 1) -> list[int]:
    """Flat-buffer sizes up to the first one holding `max_tokens`: powers of two from 1, and
    from `floor` on `steps` evenly spaced sizes per doubling (2: 16, 24, 32, 48, 64, 96, ...);
    none below `smallest` (but at least the last)."""
    buckets, b = [], 1
    while True:
        stride = b // steps if b >= floor and b % steps == 0 else b
        for size in range(b, 2 * b, stride):
            buckets.append(size)
            if size >= max_tokens:
                return [size for size in buckets if size >= min(smallest, buckets[-1])]
        b *= 2


def row_bucket(num_tokens: int, num_slots: int) -> int:
    """Rows of a flat buffer: every row has a token, and there is at most one row per slot."""
    return min(num_tokens, 1 << (num_slots - 1).bit_length())


def slot_decodes_key(rows: list[Row], num_tokens: int) -> tuple | None:
    """The key of a call whose rows are decodes named by slot alone (the overlap's calls,
    Executor._run_ahead: the same rows step after step, so their arrays can be packed
    once), else None."""
    if all(r.is_decode and r.request is None and r.start == 0 and r.generated == 0 and r.prompt_len == 0
           and not r.is_last and r.history is None for r in rows):
        return num_tokens, tuple(r.slot for r in rows)
    return None


def packed_once(kept: dict, key, make) -> tuple:
    """`kept[key]`, made by `make()` the first time (host arrays made read-only; at most 1024
    kept: beyond, start over)."""
    if key not in kept:
        if len(kept) >= 1024:
            kept.clear()
        kept[key] = make()
        for array in kept[key]:
            if isinstance(array, np.ndarray):
                array.flags.writeable = False
    return kept[key]


def pack(rows: list[Row], num_tokens: int, num_rows: int, sampling_row) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host arrays of a step: `flat [2, N]` (token ids, each token's row; padding points at
    row R), row `ints [R, ...]` and `floats [R, ...]`. `sampling_row(row)` packs a row's
    sampling parameters (`Engine.sampling_row`); a decode row's live on the device."""
    flat = np.zeros((2, num_tokens), np.int32)
    flat[1] = num_rows
    blank_ints, blank_floats = sampling_row(None)
    ints = np.zeros((num_rows, HEADER + len(blank_ints)), np.int32)
    ints[:, HEADER:] = blank_ints
    floats = np.tile(blank_floats, (num_rows, 1))
    t = 0
    for i, row in enumerate(rows):
        n = row.num_tokens
        if row.tokens:
            flat[0, t:t + n] = row.tokens
        flat[1, t:t + n] = i
        ints[i, :HEADER] = (row.slot, row.start, n, row.is_decode, row.is_last, row.generated, row.prompt_len,
                            row.verify, row.adapter)
        if row.is_last:
            ints[i, HEADER:], floats[i] = sampling_row(row)
        t += n
    return flat, ints, floats


def score_targets(rows: list[Row], num_tokens: int) -> tuple[np.ndarray | None, list[tuple], int]:
    """A call's prompt scoring (cbjax/prompt_scores.py): `scored [2, S]` int32, the flat index of
    each token whose next prompt token's score is missing and that token (S a quarter of the
    call's tokens, at least 8, or all of them; padding scores token 0 against -1), so the step
    computes the LM head at those tokens alone; the pieces they score, (`PromptScores`, first
    column, the tokens' positions); the largest top k asked. `(None, [], 0)` when no row scores anything
    (the step without scoring)."""
    index, targets, pieces, k, t = [], [], [], 0, 0
    for row in rows:
        scores = row.request.prompt_scores if row.request is not None and not row.decodes else None
        if scores is not None and not scores.done:
            wanted = scores.targets(row.start, row.num_tokens)
            at = np.flatnonzero(wanted >= 0)
            if len(at):
                pieces.append((scores, len(index), row.start + at))
                index += (t + at).tolist()
                targets += wanted[at].tolist()
                k = max(k, scores.k)
        t += row.num_tokens
    if not pieces:
        return None, [], 0
    quarter = max(num_tokens // 4, min(8, num_tokens))  # two programs a bucket: a quarter of its tokens, or all
    size = quarter if len(index) <= quarter else num_tokens
    scored = np.zeros((2, size), np.int32)
    scored[1] = -1
    scored[0, :len(index)], scored[1, :len(index)] = index, targets
    return scored, pieces, k


def split_rows(rows: list[Row], top: int) -> list[list[tuple[int, Row]]]:
    """The round's rows in calls of at most `top` tokens (the step budget), in order; a
    prompt chunk that does not fit the call being filled continues in the next (only its
    last piece ends the prompt). Each call: (index of the round's row or -1, row)."""
    calls: list[list[tuple[int, Row]]] = [[]]
    room = top
    for i, row in enumerate(rows):
        if row.decodes:  # whole in one call (a verify row: its tokens are one decision)
            if room < row.num_tokens:
                calls.append([])
                room = top
            calls[-1].append((i, row))
            room -= row.num_tokens
            continue
        done = 0
        while done < row.length:
            if room < 1:
                calls.append([])
                room = top
            n = min(room, row.length - done)
            last = done + n == row.length
            piece = row if n == row.length else dataclasses.replace(
                row, tokens=row.tokens[done:done + n], start=row.start + done, is_last=row.is_last and last,
                history=row.history if done == 0 else None)
            calls[-1].append((i if last else -1, piece))
            done += n
            room -= n
    return [c for c in calls if c]


def grammar_masks(rows: list[Row], num_rows: int, vocab_size: int) -> np.ndarray | None:
    """`[R, words]` int32 token bitmasks of a call's rows (all bits set for a row without a
    constraint), or None when no row that samples has one (the program without a mask)."""
    constrained = [(i, r.request.grammar, r.request.output_token_ids) for i, r in enumerate(rows)
                   if r.request is not None and r.request.grammar is not None and (r.is_decode or r.is_last)]
    if not constrained:
        return None
    masks = np.full((num_rows, grammar.mask_words(vocab_size)), -1, np.int32)
    grammar.fill_masks(constrained, masks)
    return masks


# ---------------------------------------------------------------- host side: the packed rows
def pack_sampling(sampling, seed: int, stop_ids: np.ndarray, max_logit_bias: int,
                  adapter: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One row's `(ints, floats)`, in `SlotState.ints` and `.floats` columns (`adapter`: its LoRA slot)."""
    bias_ids = np.full(max_logit_bias, -1, np.int32)
    bias_values = np.zeros(max_logit_bias, np.float32)
    for i, (token, bias) in enumerate(sampling.logit_bias):
        bias_ids[i], bias_values[i] = token, bias
    logprobs = -1 if sampling.logprobs is None else sampling.logprobs
    head_ints, head_floats = np.zeros(NUM_INTS, np.int32), np.zeros(NUM_FLOATS, np.float32)
    head_ints[[MAX_TOKENS, TOP_K, SEED, MIN_TOKENS, LOGPROBS, LORA]] = (sampling.max_tokens, sampling.top_k, seed,
                                                                         sampling.min_tokens, logprobs, adapter)
    head_floats[[TEMPERATURE, TOP_P, PRESENCE, FREQUENCY, REPETITION, MIN_P]] = (
        sampling.temperature, sampling.top_p, sampling.presence_penalty, sampling.frequency_penalty,
        sampling.repetition_penalty, sampling.min_p)
    ints = np.concatenate([head_ints, stop_ids, bias_ids])
    floats = np.concatenate([head_floats, bias_values])
    return ints, floats


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
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(sampling, name)
        if k is not None and k > (max_logprobs or -1):
            raise FieldError(f"{name}={k} exceeds this engine's max_logprobs={max_logprobs}"
                             if max_logprobs else "this engine computes no logprobs (max_logprobs=0)", name)
    if len(sampling.logit_bias) > max_logit_bias:
        raise FieldError(f"at most {max_logit_bias} logit_bias entries per request, got {len(sampling.logit_bias)}",
                         "logit_bias")
    bad = [t for t, _ in sampling.logit_bias if t >= vocab]
    if bad:
        raise FieldError(f"logit_bias token ids outside the vocabulary [0, {vocab}): {bad[:8]}", "logit_bias")


def sampling_row(row: Row | None, stops: np.ndarray | None, max_stop_tokens: int,
                 max_logit_bias: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's packed sampling parameters (`pack_sampling`); None: a row that
    samples nothing."""
    if row is None:
        return pack_sampling(BLANK, 0, np.full(max_stop_tokens, -1, np.int32), max_logit_bias)
    return pack_sampling(row.sampling, row.seed, stops, max_logit_bias, row.adapter)


def history_tokens(row: Row, buckets: list[int]) -> np.ndarray:
    """A row's history (the tokens before it; none at position 0), -1 padded to a length bucket."""
    history = row.history or []
    tokens = np.full(next(b for b in buckets if b >= len(history)), -1, np.int32)
    tokens[:len(history)] = history
    return tokens


def copy_pairs(copies: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) ids padded to a power of two (destinations out of range: dropped)."""
    size = 1 << (len(copies) - 1).bit_length()
    src = np.zeros(size, np.int32)
    dst = np.full(size, np.iinfo(np.int32).max, np.int32)
    src[:len(copies)], dst[:len(copies)] = zip(*copies)
    return src, dst


def to_host(tree, platform: str):
    """A round's results as numpy. A CPU array is host memory already: reading each one in
    place skips device_get's asynchronous copies, whose hop through another thread cost the
    recording thread four times as much (docs/code_measurements.md); elsewhere device_get
    starts every leaf's copy at once."""
    if platform == "cpu":
        return jax.tree.map(np.asarray, tree)
    return jax.device_get(tree)


def split_logprobs(out):
    """A step's result and its logprob columns (None when the engine computes none)."""
    return out if isinstance(out, tuple) else (out, None)


def history_block(config, max_len: int) -> int:
    """Positions per block of the reference attention's history read (a multiple of the page size)."""
    if config.kv_cache == "paged":
        return min(max(config.page_size, 256 // config.page_size * config.page_size), max_len)
    return min(256, max_len)
