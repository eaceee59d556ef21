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
prompt tokens: each hash id becomes one fixed block of random tokens, so prefix caching sees
the trace's reuse; prompts without ids are random throughout.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os

import numpy as np

from cbjax.request import SamplingParams
from cbjax.workload import WorkloadRequest

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
    """Every request of a trace, in arrival order, the first arriving at 0."""
    path = trace_path(name_or_path)
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
    return [TraceRequest(t - t0, p, o, b) for t, p, o, b in rows]


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


def trace_workload(name_or_path: str, *, vocab_size: int, start_s: float = 0.0, window_s: float | None = None,
                   num_requests: int | None = None, time_scale: float = 1.0, rate: float | None = None,
                   length_scale: float = 1.0, max_len: int | None = None, max_output_len: int | None = None,
                   all_at_once: bool = False, seed: int = 0, first_token: int = 3) -> list[WorkloadRequest]:
    """A trace's requests as a workload, EOS ignored (each makes exactly its traced output).

    Arrivals: the window's, times `time_scale` (0.5 replays it twice as fast), or rescaled to a
    mean of `rate` requests/s (the trace's burstiness kept); `all_at_once` puts every arrival
    at 0. Lengths: times `length_scale` (at least 1), outputs capped at `max_output_len`, and
    prompt plus output at `max_len` (the prompt keeps at least 1 token of room for output).
    A hash block is `512 * length_scale` tokens (at least 1)."""
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
                blocks[h] = np.random.default_rng([seed, h]).integers(first_token, vocab_size, block_len).tolist()
            prompt += blocks[h]
        prompt = prompt[:prompt_len]
        prompt += rng.integers(first_token, vocab_size, prompt_len - len(prompt)).tolist()
        out.append(WorkloadRequest(float(t), prompt, SamplingParams(max_tokens=output_len, ignore_eos=True)))
    return out
