"""Seeded workloads: arrival processes and prompt/output length distributions.

A workload is a list of `WorkloadRequest`s: arrival offset (seconds from the
start), prompt token ids and sampling parameters. Arrivals: all at once, Poisson
at a QPS, or gamma-distributed gaps with a burstiness factor (as `vllm bench
serve`: shape = burstiness, mean gap 1/QPS; burstiness 1 is Poisson). Lengths:
fixed, uniform, or the capped exponential of the Anyscale study (mean 128,
capped at the max generation length, EOS ignored so each request makes exactly
its budget). Optionally real chat prompts from the `chitchat-dataset` package.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import numpy as np

from cbjax.request import SamplingParams

ARRIVALS = ("all_at_once", "poisson", "gamma")
LENGTHS = ("fixed", "uniform", "capped_exponential")


@dataclasses.dataclass
class WorkloadRequest:
    arrival: float
    prompt: list[int] | str
    sampling: SamplingParams

    def as_tuple(self):
        return self.arrival, self.prompt, self.sampling


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """`fixed` (value), `uniform` (low..high inclusive), `capped_exponential` (mean, cap)."""

    kind: str = "fixed"
    value: int = 128
    low: int = 1
    high: int = 128
    mean: float = 128.0
    cap: int = 512
    floor: int = 1

    def __post_init__(self):
        if self.kind not in LENGTHS:
            raise ValueError(f"length distribution must be one of {LENGTHS}, got {self.kind!r}")
        if self.kind == "uniform" and not 1 <= self.low <= self.high:
            raise ValueError(f"uniform lengths need 1 <= low <= high, got {self.low}, {self.high}")
        if self.kind == "fixed" and self.value < 1:
            raise ValueError(f"fixed length must be >= 1, got {self.value}")
        if self.kind == "capped_exponential" and (self.mean <= 0 or self.cap < 1):
            raise ValueError("capped_exponential needs mean > 0 and cap >= 1")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            out = np.full(n, self.value)
        elif self.kind == "uniform":
            out = rng.integers(self.low, self.high + 1, size=n)
        else:
            out = np.minimum(np.ceil(rng.exponential(self.mean, size=n)), self.cap)
        return np.maximum(out, self.floor).astype(np.int64)


def arrival_times(kind: str, n: int, rng: np.random.Generator, qps: float = 1.0,
                  burstiness: float = 1.0) -> np.ndarray:
    """Arrival offsets in seconds, sorted, the first at 0 for `all_at_once`."""
    if kind not in ARRIVALS:
        raise ValueError(f"arrival process must be one of {ARRIVALS}, got {kind!r}")
    if kind == "all_at_once":
        return np.zeros(n)
    if qps <= 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    if kind == "poisson":
        gaps = rng.exponential(1.0 / qps, size=n)
    else:
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (qps * burstiness), size=n)
    return np.cumsum(gaps) - gaps[0]


def synthetic(n: int, *, prompt_len: LengthDist, output_len: LengthDist, vocab_size: int, seed: int = 0,
              arrival: str = "all_at_once", qps: float = 1.0, burstiness: float = 1.0, ignore_eos: bool = True,
              first_token: int = 3) -> list[WorkloadRequest]:
    """Random-token prompts with drawn lengths (ids in [first_token, vocab) to avoid specials)."""
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(arrival, n, rng, qps, burstiness)
    p_lens, o_lens = prompt_len.sample(rng, n), output_len.sample(rng, n)
    return [WorkloadRequest(float(t), rng.integers(first_token, vocab_size, size=int(p)).tolist(),
                            SamplingParams(max_tokens=int(o), ignore_eos=ignore_eos))
            for t, p, o in zip(arrivals, p_lens, o_lens)]


def chitchat_path() -> str:
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the chat workload needs the PyPI package chitchat-dataset "
                                "(pip install 'cbjax[chat]')")
    path = os.path.join(spec.submodule_search_locations[0], "dataset.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"chitchat-dataset is installed but has no dataset.json at {path}")
    return path


def chat_messages(n: int, seed: int = 0, max_chars: int = 600) -> list[str]:
    """Opening turns of `n` human conversations (seeded choice), as user messages."""
    with open(chitchat_path()) as f:
        conversations = json.load(f)
    openings = []
    for key in sorted(conversations):
        turns = conversations[key].get("messages") or []
        if turns:
            text = " ".join(m["text"] for m in turns[0]).strip()
            if text:
                openings.append(text[:max_chars])
    rng = np.random.default_rng(seed)
    return [openings[i] for i in rng.choice(len(openings), size=min(n, len(openings)), replace=False)]


def chat(n: int, tokenizer, *, max_tokens: int = 256, seed: int = 0, arrival: str = "all_at_once",
         qps: float = 1.0, burstiness: float = 1.0) -> list[WorkloadRequest]:
    """Real chat prompts, chat-templated, generating until EOS (or `max_tokens`)."""
    from cbjax.tokenization import chat_prompt_ids

    rng = np.random.default_rng(seed)
    messages = chat_messages(n, seed)
    arrivals = arrival_times(arrival, len(messages), rng, qps, burstiness)
    return [WorkloadRequest(float(t), chat_prompt_ids(tokenizer, m), SamplingParams(max_tokens=max_tokens))
            for t, m in zip(arrivals, messages)]


def recorded_lengths(pairs: list[dict], *, arrival: str = "all_at_once", qps: float = 1.0,
                     burstiness: float = 1.0, seed: int = 0) -> list[WorkloadRequest]:
    """Prompts with the output lengths a model gave them (the pairs of
    experiments/studies/train_length_predictor.py's data: `prompt_token_ids`, `output_len`). Each
    request generates exactly its recorded length, EOS ignored, so a scheduler that reads
    max_tokens knows the true length (oracle SJF) and a simulator can replay it."""
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(arrival, len(pairs), rng, qps, burstiness)
    return [WorkloadRequest(float(t), list(p["prompt_token_ids"]),
                            SamplingParams(max_tokens=int(p["output_len"]), ignore_eos=True))
            for t, p in zip(arrivals, pairs)]


@dataclasses.dataclass(frozen=True)
class Profile:
    """An application profile of source note 003: its length distributions, arrivals and the
    objective its developers tune for. Lengths are for a GPU-scale model; `profile_workload`
    scales them down for a small CPU run."""

    name: str
    prompt_len: LengthDist
    output_len: LengthDist
    arrival: str
    objective: str  # "throughput" (higher wins) or a latency percentile key (lower wins)
    questions_per_document: int = 1  # > 1: prompts share a document prefix (prefix caching pays)


PROFILES = {
    # Reading comprehension: long documents, several short questions each; an offline batch.
    "reading": Profile("reading", LengthDist("uniform", low=1024, high=2048), LengthDist("uniform", low=8, high=32),
                       "all_at_once", "output_throughput", questions_per_document=4),
    # Chat: short turns both ways, online; the tail of end-to-end latency.
    "chat": Profile("chat", LengthDist("uniform", low=32, high=256), LengthDist("uniform", low=32, high=256),
                    "poisson", "p99_e2el_ms"),
    # Creative writing: a short brief, a long text, online; the first token's tail.
    "creative": Profile("creative", LengthDist("uniform", low=16, high=96),
                        LengthDist("uniform", low=512, high=1024), "poisson", "p99_ttft_ms"),
}


def profile_workload(profile: Profile, n: int, *, vocab_size: int, qps: float = 1.0, scale: float = 1.0,
                     seed: int = 0, first_token: int = 3) -> list[WorkloadRequest]:
    """`n` requests of `profile`, lengths multiplied by `scale` (at least 1 token). With
    `questions_per_document` > 1, consecutive requests share a document prefix (85% of the
    prompt) and differ in the question after it."""
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(profile.arrival, n, rng, qps)
    p_lens = np.maximum((profile.prompt_len.sample(rng, n) * scale).astype(np.int64), 2)
    o_lens = np.maximum((profile.output_len.sample(rng, n) * scale).astype(np.int64), 1)
    group = profile.questions_per_document
    out, document = [], []
    for i, (t, p, o) in enumerate(zip(arrivals, p_lens, o_lens)):
        if i % group == 0:
            document = rng.integers(first_token, vocab_size, size=int(p)).tolist()
        shared = document[:int(0.85 * p)] if group > 1 else []
        prompt = shared + rng.integers(first_token, vocab_size, size=int(p) - len(shared)).tolist()
        out.append(WorkloadRequest(float(t), prompt, SamplingParams(max_tokens=int(o), ignore_eos=True)))
    return out


def random_json_schema(rng, depth: int = 0) -> dict:
    """A random JSON schema of bounded size (structured-output workloads and tests): an object
    of 1-3 properties (each required with probability 0.7, no others), whose values are
    booleans, enums, bounded integers, short strings, arrays of 0-2 items or objects of 1-2
    properties, nested to depth 2. `rng`: a `random.Random`."""
    kinds = ["boolean", "enum", "integer", "string"] + (["array", "object"] if depth < 2 else [])
    kind = rng.choice(kinds) if depth else "object"
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", "ünï", "42"], rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 300)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 4)}
    if kind == "array":
        return {"type": "array", "items": random_json_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 2)}
    names = rng.sample(["id", "name", "tags", "size", "ok", "kind", "meta"], rng.randint(1, 3 if depth == 0 else 2))
    return {"type": "object", "properties": {n: random_json_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.7], "additionalProperties": False}
