"""Speculative decoding's host side: what to propose for each running request, and how many
tokens to propose at the current load. No JAX: the device verifies (cbjax/runtime/traced/speculative.py).

A `Proposer` proposes up to `k` next tokens for each of a round's speculating requests, all at
once; `NgramProposer` is prompt lookup (the request's latest earlier occurrence of its last n
tokens, and what followed it) from what the host holds, `cbjax/core/draft.py`'s `DraftProposer`
runs a draft model on an engine of its own. A proposer that reads the target's hidden states
(EAGLE) would take the same call.

Each guess says how sure the proposer is (`Guess`: an n-gram's match length) and where it
comes from; the length policies (speculation_length.py) pick how much of it each request
proposes: `FixedLength` all of it, `AdaptiveLength` SmartSpec's goodput per request.
"""

from __future__ import annotations

from typing import Callable, Protocol

from cbjax.request import Request, RequestState
from cbjax.scheduling.speculation_length import NO_GUESS, AdaptiveLength, FixedLength, Guess

METHODS = ("none", "ngram", "draft")
LENGTH_POLICIES = ("fixed", "adaptive")


def check_draft_vocabulary(draft_vocab: int, target_vocab: int) -> None:
    """Refuse (ValueError, naming the knob) a draft whose token ids are not the target's."""
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_model: the draft's vocabulary ({draft_vocab} tokens) is not the target's "
                         f"({target_vocab}): a draft proposes the target's token ids")


def may_speculate(r: Request) -> bool:
    """Whether a request's tokens may be proposed and verified: running, unconstrained (a
    structured-output mask follows each accepted token on the host) and without penalties
    (their counts would change inside the verified row). Other requests decode as before."""
    s = r.sampling
    return (r.state == RequestState.RUNNING and r.grammar is None and s.repetition_penalty == 1.0
            and not s.presence_penalty and not s.frequency_penalty)


class Proposer(Protocol):
    def propose(self, requests: list[Request], ks: list[int]) -> list[Guess]:
        """For each request, a guess of up to its `k` tokens to follow its tokens (fewer, or
        none, when it has no guess; none for `k` 0), with how sure it is. Proposals must be
        point masses (a fixed guess, or a draft's greedy token): the verification is exact
        rejection sampling for those."""

    def forget(self, request_id: str) -> None:
        """`request_id` finished: drop what was kept for it."""

    def warmup(self) -> int:
        """Compile what it runs ahead of time; the number of programs."""

    costly: bool
    """Whether a proposal costs steps of its own (a draft model's): the lengths are then planned
    before proposing, where a free guess (an n-gram's) is looked at first. Optional: False."""


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the request's last `n` tokens
    (`max_n` down to `min_n`) in its prompt and output, and propose the tokens that followed
    it. Each request keeps an index of its n-grams (n-gram -> the position after its latest
    occurrence), extended by the tokens appended since the last call: O(new tokens) a step.
    A guess's confidence is the length of the match; its source is how far back the match is
    (the same while a request keeps copying one passage)."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, tuple[dict, list[int]]] = {}  # request id -> (index, [positions indexed])

    costly = False

    def propose(self, requests: list[Request], ks: list[int]) -> list[Guess]:
        return [self.lookup(r, k) if k > 0 else NO_GUESS for r, k in zip(requests, ks)]

    def warmup(self) -> int:
        return 0

    def lookup(self, r: Request, k: int) -> Guess:
        """Up to `k` tokens that followed the latest earlier occurrence of `r`'s last n tokens."""
        tokens = r.prompt_token_ids + r.output_token_ids
        index, done = self._index.setdefault(r.request_id, ({}, [0]))
        end = len(tokens) - 1  # n-grams ending before the last token: each has a token after it
        for e in range(done[0], end):
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                index[tuple(tokens[e - n + 1:e + 1])] = e + 1
        done[0] = max(done[0], end)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            after = index.get(tuple(tokens[-n:]))
            if after is not None:
                return Guess(tokens[after:after + k], n, len(tokens) - after)
        return NO_GUESS

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)


class SimulatedProposer:
    """The simulator's proposals (its tokens are fillers, so nothing real to propose from): each
    proposed token is the target's own (`filler(r)`) with probability `acceptance`,
    independently, from a seeded generator; the first one that is not is the filler's
    neighbour. `charge(requests, ks)`: what proposing costs on the simulated clock (a draft
    model's steps), or None (n-gram lookups cost the host only)."""

    def __init__(self, acceptance: float, filler: Callable[[Request], int], seed: int = 0,
                 charge: Callable[[list[Request], list[int]], None] | None = None):
        import random

        self.acceptance, self.filler, self.charge = acceptance, filler, charge
        self.costly = charge is not None
        self._random = random.Random(seed)

    def propose(self, requests: list[Request], ks: list[int]) -> list[Guess]:
        out = []
        for r, k in zip(requests, ks):
            right = 0
            while right < k and self._random.random() < self.acceptance:
                right += 1
            token = self.filler(r)
            out.append(Guess([token] * right + [token + 1] * (k - right)))
        if self.charge is not None and any(ks):
            self.charge(requests, ks)
        return out

    def forget(self, request_id: str) -> None:
        pass

    def warmup(self) -> int:
        return 0


class Speculator:
    """A proposer and a length policy, with their running totals (`/metrics`, the step stats)."""

    def __init__(self, proposer: Proposer, lengths: FixedLength | AdaptiveLength, max_seq_len: int):
        self.proposer = proposer
        self.lengths = lengths
        self.max_seq_len = max_seq_len
        self.proposed = 0
        self.accepted = 0
        self.verify_rows = 0
        self._confidence: dict[str, int] = {}  # request id -> its proposal's confidence this round

    def length(self, batch: int) -> int:
        """The most tokens a request may propose in the next round at `batch` decoding requests
        (0: none will; a decode call may then run ahead of its record)."""
        return self.lengths.length(batch)

    def proposals(self, requests: list[Request], k: int) -> list[list[int]]:
        """At most `k` tokens for each request: none past its max_tokens or the cache's length
        (the verify row's positions all fit where a decode's would), nor for a request that may
        not speculate; of each guess, as much as the length policy picks."""
        ks = [max(min(k, r.sampling.max_tokens - len(r.output_token_ids) - 1, self.max_seq_len - r.num_tokens), 0)
              if may_speculate(r) else 0 for r in requests]
        ids = [r.request_id for r in requests]
        if getattr(self.proposer, "costly", False):  # the draft runs only as far as the lengths chosen ahead of it
            chosen = ks = self.lengths.plan(ids, ks)
            guesses = self.proposer.propose(requests, ks)
        else:
            guesses = self.proposer.propose(requests, ks)
            chosen = self.lengths.choose(ids, guesses)
        for r, g, n in zip(requests, guesses, chosen):
            if n:
                self._confidence[r.request_id] = g.confidence
        return [g.tokens[:n] for g, n in zip(guesses, chosen)]

    def warmup(self) -> int:
        return self.proposer.warmup()

    def record(self, r: Request, proposed: int, accepted: int) -> None:
        """A verify row's outcome: `accepted` of its `proposed` tokens were kept."""
        self.proposed += proposed
        self.accepted += accepted
        self.verify_rows += 1
        r.metrics.num_draft_tokens += proposed
        r.metrics.num_accepted_tokens += accepted
        self.lengths.observe(r.request_id, proposed, accepted, self._confidence.pop(r.request_id, 0))

    def after_round(self, calls: list[list], seconds: float | None, ahead: bool = False) -> None:
        """A round's rows (per call) and, for a round of decodes alone, its seconds (`ahead`:
        a call run ahead of the previous record) for the length policy's cost curve."""
        self._confidence.clear()
        rows = [r for call in calls for r in call if r.decodes]
        proposed = sum(r.num_tokens - 1 for r in rows if r.verify)
        self.lengths.after_round(len(rows), proposed / len(rows) if rows else 0.0, seconds, ahead)

    def forget(self, request_id: str) -> None:
        """`request_id` finished: its proposer's and its length policy's records go."""
        self.proposer.forget(request_id)
        self.lengths.forget(request_id)


def make_speculator(method: str, k: int, length_policy: str, max_seq_len: int, min_n: int = 2, max_n: int = 4,
                    draft: Proposer | None = None, buckets: tuple[int, ...] | None = None) -> Speculator | None:
    """The speculator `EngineArgs` ask for, or None (`method` "none" or `k` 0). `draft`: the
    draft model's proposer (`method` "draft"; a `SimulatedProposer` for either method in a
    simulation). `buckets`: the engine's token buckets, which a verify round's cost follows
    (None: its mean proposal length does)."""
    if method not in METHODS:
        raise ValueError(f"speculative_method must be one of {METHODS}, got {method!r}")
    if length_policy not in LENGTH_POLICIES:
        raise ValueError(f"speculative_length must be one of {LENGTH_POLICIES}, got {length_policy!r}")
    if method == "none" or k == 0:
        return None
    lengths = FixedLength(k) if length_policy == "fixed" else AdaptiveLength(k, buckets=buckets)
    if method == "draft" and draft is None:
        raise ValueError("speculative_method='draft' needs speculative_model (the draft to load)")
    proposer = draft if method == "draft" or isinstance(draft, SimulatedProposer) else NgramProposer(min_n, max_n)
    return Speculator(proposer, lengths, max_seq_len)
