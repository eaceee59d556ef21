"""Speculative decoding's host side: what to propose for each running request, and how many
tokens to propose at the current load. No JAX: the device verifies (cbjax/runtime/traced/speculative.py).

A `Proposer` proposes up to `k` next tokens for each of a round's speculating requests, all at
once; `NgramProposer` is prompt lookup (the request's latest earlier occurrence of its last n
tokens, and what followed it) from what the host holds, `cbjax/core/draft.py`'s `DraftProposer`
runs a draft model on an engine of its own. A proposer that reads the target's hidden states
(EAGLE) would take the same call.

The length policies pick each round's `k`: `FixedLength`, or `AdaptiveLength`, which
maximises SmartSpec's goodput (arXiv 2406.14066): with a per-token acceptance rate `a`, a
request asked for `k` tokens makes (1 - a^(k+1)) / (1 - a) tokens a round, and the round costs
`c(B, k)` at `B` requests, measured; at high load the extra tokens cost more than they bring
and `k` falls to 0. `SimulatedProposer` stands in for either proposer in the simulator.
"""

from __future__ import annotations

from typing import Callable, Protocol

from cbjax.request import Request, RequestState

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
    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """For each request, up to its `k` tokens to follow its tokens (fewer, or none, when it
        has no guess; none for `k` 0). Proposals must be point masses (a fixed guess, or a
        draft's greedy token): the verification is exact rejection sampling for those."""

    def forget(self, request_id: str) -> None:
        """`request_id` finished: drop what was kept for it."""

    def warmup(self) -> int:
        """Compile what it runs ahead of time; the number of programs."""


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the request's last `n` tokens
    (`max_n` down to `min_n`) in its prompt and output, and propose the tokens that followed
    it. Each request keeps an index of its n-grams (n-gram -> the position after its latest
    occurrence), extended by the tokens appended since the last call: O(new tokens) a step."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, tuple[dict, list[int]]] = {}  # request id -> (index, [positions indexed])

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [self.lookup(r, k) if k > 0 else [] for r, k in zip(requests, ks)]

    def warmup(self) -> int:
        return 0

    def lookup(self, r: Request, k: int) -> list[int]:
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
                return tokens[after:after + k]
        return []

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
        self._random = random.Random(seed)

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(requests, ks):
            right = 0
            while right < k and self._random.random() < self.acceptance:
                right += 1
            token = self.filler(r)
            out.append([token] * right + [token + 1] * (k - right))
        if self.charge is not None and any(ks):
            self.charge(requests, ks)
        return out

    def forget(self, request_id: str) -> None:
        pass

    def warmup(self) -> int:
        return 0


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step makes for a request proposing `k` at per-token acceptance `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class FixedLength:
    def __init__(self, k: int):
        self.k = k

    def length(self, batch: int) -> int:
        return self.k

    next_length = length

    def observe(self, asked: int, accepted: int) -> None:
        pass

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        pass


class AdaptiveLength:
    """`k` in 0..`max_k` maximising goodput at the batch's size. The acceptance rate is a
    running mean over the last ~`memory` proposed tokens tried. The cost of a round is measured
    per (batch, k), batches grouped by powers of two, and interpolated over k between measured
    lengths (extrapolated past them along the nearest segment): keyed by k rather than by the
    step's tokens, it holds what proposing costs (a draft model's steps) and where the engine
    pads every k to one step size. A length's estimate falls fast and rises slowly, and its
    first round (which may have compiled a program) counts only once a second confirms it.
    At a batch with fewer than two lengths measured it tries `max_k`, then 0; every
    `probe_every` rounds the unmeasured length nearest the best (or, all measured and the best
    0, one token, to keep the acceptance current)."""

    def __init__(self, max_k: int, memory: int = 256, prior_acceptance: float = 0.5, probe_every: int = 16):
        self.max_k = max_k
        self.decay = 1.0 - 1.0 / memory
        self.proposed, self.accepted = 1.0, prior_acceptance
        self.seconds: dict[tuple[int, int], tuple[float, int]] = {}  # (batch group, k) -> (seconds, rounds seen)
        self.probe_every = probe_every
        self._rounds = 0

    @property
    def acceptance(self) -> float:
        return min(self.accepted / self.proposed, 0.999)

    def observe(self, asked: int, accepted: int) -> None:
        """A request's outcome: `accepted` tokens kept of the `asked` its proposal could hold. The
        rate is per token given the ones before it were accepted (what `expected_tokens`
        assumes): the request tried its accepted tokens and, if it stopped short of `asked`,
        one more. A proposal shorter than asked, or none (n-gram lookups often find nothing),
        counts as rejected where it stopped: the rate is what a round at `k` yields."""
        trials = accepted + (accepted < asked)
        if trials:
            d = self.decay ** trials
            self.proposed = self.proposed * d + trials
            self.accepted = self.accepted * d + accepted

    @staticmethod
    def group(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A round of `batch` decoding requests at length `k` took `seconds`."""
        key = (self.group(batch), k)
        old, count = self.seconds.get(key, (seconds, 0))
        if count <= 1 or seconds < old:  # the first round of a length may have compiled its program
            estimate = min(old, seconds) if count == 1 else 0.5 * old + 0.5 * seconds
        else:
            estimate = 0.9 * old + 0.1 * min(seconds, 2 * old)
        self.seconds[key] = (estimate, count + 1)

    def _measured(self, batch: int) -> dict[int, float]:
        g = self.group(batch)
        return {k: y for (b, k), (y, c) in self.seconds.items() if b == g and c >= 2}

    def cost(self, batch: int, k: int) -> float | None:
        """The seconds of a round at `batch` and length `k`, or None before two lengths were
        measured at that batch."""
        points = sorted(self._measured(batch).items())
        if len(points) < 2:
            return None
        if k <= points[0][0]:
            return points[0][1]
        (k0, y0), (k1, y1) = next(((a, b) for a, b in zip(points, points[1:]) if k <= b[0]), points[-2:])
        return max(y0 + max(y1 - y0, 0.0) * (k - k0) / (k1 - k0), 1e-9)

    def length(self, batch: int) -> int:
        """The goodput-maximising `k` at `batch` requests (no side effect)."""
        measured = self._measured(batch)
        if batch < 1 or self.max_k == 0 or len(measured) < 2:
            return 0 if self.max_k in measured else self.max_k
        a = self.acceptance
        goodput = [expected_tokens(a, k) / self.cost(batch, k) for k in range(self.max_k + 1)]
        return max(range(self.max_k + 1), key=lambda k: (goodput[k], -k))

    def next_length(self, batch: int) -> int:
        """This round's `k`: `length`, but every `probe_every` rounds a length still to measure."""
        best = self.length(batch)
        self._rounds += 1
        if self._rounds % self.probe_every:
            return best
        measured = self._measured(batch)
        unmeasured = [k for k in range(self.max_k + 1) if k not in measured]
        if unmeasured:
            return min(unmeasured, key=lambda k: (abs(k - best), k))
        return 1 if best == 0 else best


class Speculator:
    """A proposer and a length policy, with their running totals (`/metrics`, the step stats)."""

    def __init__(self, proposer: Proposer, lengths, max_seq_len: int):
        self.proposer = proposer
        self.lengths = lengths
        self.max_seq_len = max_seq_len
        self.proposed = 0
        self.accepted = 0
        self.verify_rows = 0
        self._asked: dict[str, int] = {}  # request id -> the tokens its proposal was asked for this round

    def length(self, batch: int) -> int:
        """The most tokens each request would propose at `batch` decoding requests."""
        return self.lengths.length(batch)

    def next_length(self, batch: int) -> int:
        """The most tokens each request proposes this round (at `batch` decoding requests)."""
        return self.lengths.next_length(batch)

    def proposals(self, requests: list[Request], k: int) -> list[list[int]]:
        """At most `k` tokens for each request: none past its max_tokens or the cache's length
        (the verify row's positions all fit where a decode's would), nor for a request that may
        not speculate."""
        ks = [max(min(k, r.sampling.max_tokens - len(r.output_token_ids) - 1, self.max_seq_len - r.num_tokens), 0)
              if may_speculate(r) else 0 for r in requests]
        proposals = self.proposer.propose(requests, ks)
        for r, asked, proposal in zip(requests, ks, proposals):
            if asked and proposal:
                self._asked[r.request_id] = asked
            elif asked:  # no guess: to the length policy, a proposal rejected at its first token
                self.lengths.observe(asked, 0)
        return proposals

    def warmup(self) -> int:
        return self.proposer.warmup()

    def record(self, r: Request, proposed: int, accepted: int) -> None:
        """A verify row's outcome: `accepted` of its `proposed` tokens were kept."""
        self.proposed += proposed
        self.accepted += accepted
        self.verify_rows += 1
        r.metrics.num_draft_tokens += proposed
        r.metrics.num_accepted_tokens += accepted
        self.lengths.observe(self._asked.pop(r.request_id, proposed), accepted)

    def after_round(self, calls: list[list], k: int, seconds: float | None) -> None:
        """A round's rows (per call), its length `k` and, for a round of decodes alone, its
        seconds: the length policy's cost."""
        self._asked.clear()
        if seconds is not None:
            self.lengths.observe_step(sum(r.decodes for rows in calls for r in rows), k, seconds)


def make_speculator(method: str, k: int, length_policy: str, max_seq_len: int, min_n: int = 2, max_n: int = 4,
                    draft: Proposer | None = None) -> Speculator | None:
    """The speculator `EngineArgs` ask for, or None (`method` "none" or `k` 0). `draft`: the
    draft model's proposer (`method` "draft"; a `SimulatedProposer` for either method in a
    simulation)."""
    if method not in METHODS:
        raise ValueError(f"speculative_method must be one of {METHODS}, got {method!r}")
    if length_policy not in LENGTH_POLICIES:
        raise ValueError(f"speculative_length must be one of {LENGTH_POLICIES}, got {length_policy!r}")
    if method == "none" or k == 0:
        return None
    lengths = FixedLength(k) if length_policy == "fixed" else AdaptiveLength(k)
    if method == "draft" and draft is None:
        raise ValueError("speculative_method='draft' needs speculative_model (the draft to load)")
    proposer = draft if method == "draft" or isinstance(draft, SimulatedProposer) else NgramProposer(min_n, max_n)
    return Speculator(proposer, lengths, max_seq_len)
