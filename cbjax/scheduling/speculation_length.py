"""How many tokens each speculating request proposes in a round: the length policies.

`FixedLength` proposes all a proposer guessed, up to `k`. `AdaptiveLength` is SmartSpec's
goodput (arXiv 2406.14066) at request granularity. With a per-token acceptance `a`, a
request proposing `k` tokens makes `expected_tokens(a, k) = (1 - a^(k+1)) / (1 - a)` tokens
a round; the round costs `c(B, T)` at `B` decoding requests proposing `T` tokens in all,
measured per verify size (the token bucket `B + T` pads to). Each round it gives each request
its own length (0 included) so that the batch's tokens per second are highest: the next token
of request i adds `a_i^(k_i+1)` tokens, so the best lengths for any total are the highest of
those marginal gains, and the total is the one whose gains over its cost is highest.

Of the totals longer than the best whose cost and goodput are both within `flat` (2%) of
the best's, the largest goes: the measured costs carry a few percent of noise, and where the
curve is flat a longer proposal keeps more tokens for the same time (without it the size
with the luckiest measurement wins).

A request's `a_i` is its own acceptance, shrunk toward the acceptance of guesses as sure
as its current one (an n-gram's match length; `Guess.confidence`). Where it comes from:

- A request the proposer had no guess for proposes nothing and counts nothing: no guess
  is not a wrong guess, and it costs nothing. (The old engine-wide rate counted it as a
  rejection, and the first rounds of a generation, with nothing to copy yet, locked
  speculation out for the rest of it.)
- No lock-out: when a request's guess comes from a new place (`Guess.source`: a new
  n-gram match) its own record is halved, so the prior of its confidence weighs more; and a
  request left at 0 with a guess from a new place tries one token (a probe), at most once
  every `probe_every` rounds and at most `batch / probe_every` requests a round.
- Exploring is paid from one allowance, `explore_share` of the rounds' measured time: a
  probe, or a round at a verify size not yet measured, goes when the time the cost curve
  says it adds to the round fits what is left. A probe in a round that verifies anyway, or
  a size cheaper than the best one, costs nothing and goes at once (at most one size
  every `probe_every` rounds); one that turns a plain round into a verify round costs the
  difference (on a CPU, about a round) and waits until the rounds since have paid for it.
- The cost curve (`CostCurve`, speculation_estimates.py, beside the requests' records) is
  measured per (batch, verify size), batches grouped by powers of two: a size's first round
  (which may have compiled) counts only once a second confirms it; until two sizes are
  measured at a batch, a round proposes nothing until a plain round is measured there, then
  one token a guess (the cheapest verify round: on a CPU a verify of a few rows still runs
  the decode kernels, and the curve jumps where it stops). A size past the largest measured
  is taken to cost that one's round until the goodput picks it and two rounds measure it;
  the sizes between measured ones, by the line between them, until exploring tries them. A
  size not measured for 64 rounds is measured again when exploring next can, and that reading
  replaces its estimate: one slow round (the machine's hiccup) no longer keeps a length out.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

from cbjax.scheduling.speculation_estimates import Acceptance, CostCurve


class Guess(NamedTuple):
    """A proposer's tokens for one request and how sure it is: `confidence` is a small
    integer bucket (an n-gram's match length; 0 for a proposer without one), `source` where
    the guess comes from (an n-gram's position in the request's tokens; None: unknown)."""

    tokens: list[int]
    confidence: int = 0
    source: int | None = None


NO_GUESS = Guess([])


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step makes for a request proposing `k` at per-token acceptance `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def longest_near_best(flat: float, goodputs: list[float], costs: list[float]) -> int:
    """The index (a total, or a length) of the best goodput; when that proposes anything, the
    largest longer one whose cost and goodput are both within `flat` of it. The curve's costs
    carry a few percent of noise, and where they are flat the longer proposal keeps more tokens
    for the same time (left alone, the size with the luckiest measurement wins and proposals
    stay short); where they are not, the best goodput (a goodput tolerance alone bought a
    longer proposal at a dearer bucket: ShareGPT at 8 sequences, 0.96x of no speculation)."""
    best = max(range(len(goodputs)), key=goodputs.__getitem__)
    if best == 0:
        return 0
    return max(i for i in range(best, len(goodputs))
               if costs[i] <= costs[best] * (1.0 + flat) and goodputs[i] >= goodputs[best] * (1.0 - flat))


class FixedLength:
    """Every guess proposed whole, up to `k`."""

    def __init__(self, k: int):
        self.k = k

    def length(self, batch: int) -> int:
        return self.k

    def choose(self, ids: list[str], guesses: list[Guess]) -> list[int]:
        return [len(g.tokens) for g in guesses]

    def plan(self, ids: list[str], caps: list[int]) -> list[int]:
        return caps

    def observe(self, request_id: str, asked: int, accepted: int, confidence: int = 0) -> None:
        pass

    def after_round(self, batch: int, kbar: float, seconds: float | None, ahead: bool = False) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


class AdaptiveLength:
    def __init__(self, max_k: int, memory: int = 32, prior_acceptance: float = 0.5, prior_weight: float = 4.0,
                 probe_every: int = 8, batch_memory: int = 256, explore_share: float = 0.01,
                 buckets: tuple[int, ...] | None = None, flat: float = 0.02):
        self.max_k = max_k
        self.flat = flat
        self.accept = Acceptance(memory, prior_acceptance, prior_weight, batch_memory)
        self.curve = CostCurve(buckets)
        self.batch_decay = self.accept.batch_decay
        self.probe_every = probe_every
        self.explore_share = explore_share
        self.allowance = 0.0  # seconds exploring may still add: explore_share of the rounds' time
        self.rounds = 0
        self.looked = 0  # the round guesses were last looked at (`choose`)
        self.explored = 0  # the round the cost curve was last explored
        self.plan_probed = 0  # the round `plan` last tried one token after planning 0
        self.measuring = -1  # the round the lengths were last picked to measure a cost, not for goodput
        # Decayed: request-rounds looked at and those that proposed; verify rows and their kept tokens.
        self.looks, self.proposing = 1.0, 0.5
        self.rows, self.kept = 1.0, 1.0
        self.looking: dict[int, tuple[float, float]] = {}  # batch group -> decayed (rounds that looked, their seconds)

    def acceptance(self, request_id: str, guess: Guess) -> float:
        """The request's per-token acceptance for this guess."""
        return self.accept.rate(request_id, guess.confidence)

    def observe(self, request_id: str, asked: int, accepted: int, confidence: int = 0) -> None:
        if self.accept.observe(request_id, asked, accepted, confidence):
            self.rows, self.kept = self.rows * self.batch_decay + 1, self.kept * self.batch_decay + accepted

    def forget(self, request_id: str) -> None:
        self.accept.forget(request_id)

    def after_round(self, batch: int, kbar: float, seconds: float | None, ahead: bool = False) -> None:
        """A round of `batch` decoding requests proposing `kbar` tokens on average took
        `seconds` (None: not a round to measure, such as one with prompt rows); `ahead`: it ran
        ahead of the previous round's record (its seconds: since that record)."""
        looked = self.looked == self.rounds != self.measuring  # it looked at guesses (`choose`), not to measure
        self.rounds += 1
        if seconds is None or batch < 1:
            return
        if looked and not ahead:
            rounds, total = self.looking.get(self.curve.group(batch), (0.0, 0.0))
            self.looking[self.curve.group(batch)] = (rounds * 0.9 + 1, total * 0.9 + seconds)
        self.allowance = min(self.allowance + self.explore_share * seconds, 4 * seconds)  # saved: 4 rounds at most
        self.curve.record(batch, round(kbar * batch), seconds, ahead, self.rounds)

    def cost(self, batch: int, total: int) -> float | None:
        """The measured seconds of a round at `batch` proposing `total` tokens (`CostCurve`)."""
        return self.curve.cost(batch, total)

    # ----------------------------------------------------------------- choose
    def length(self, batch: int) -> int:
        """The most tokens a request may propose in the next round: `max_k` when looking at the
        guesses pays (`looking_pays`) and every `probe_every` rounds; 0 lets the next decode
        call run ahead of this one's record instead."""
        if self.rounds - self.looked >= self.probe_every or self.looking_pays(batch):
            return self.max_k
        return 0

    def looking_pays(self, batch: int) -> bool:
        """Whether looking at the guesses each round pays for the overlap it gives up: a
        proposal needs the latest token on the host, so a round that looks cannot run ahead.
        A looking round makes `1 + p x` tokens a request (`p`: the share of requests that
        propose, `x`: the tokens a verify row keeps) at the measured cost of the mean length
        such rounds propose; a round run ahead makes 1 at its own measured cost (until that is
        measured, a plain round's). Until those are measured, looking pays if `p x` beats 10%
        (about what overlap saves). A looking round's cost is the decayed mean of such rounds'
        own seconds at this batch, not the curve's at their mean length: their lengths are
        mostly 0 (no guess) or long, and the curve's estimate between may be stale."""
        gain = (self.proposing / self.looks) * (self.kept / self.rows)
        plain = self.curve.ahead(batch) or self.curve.measured(batch).get(0)
        rounds, seconds = self.looking.get(self.curve.group(batch), (0.0, 0.0))
        if rounds < 2 or plain is None:
            return gain > 0.1
        return (1.0 + gain) * rounds / seconds > 1.0 / plain

    def choose(self, ids: list[str], guesses: list[Guess]) -> list[int]:
        """Each request's proposal length (at most its guess's), the batch's goodput best."""
        batch = len(ids)
        ks = [0] * batch
        self.looked = self.rounds
        self.looks = self.looks * self.batch_decay + batch
        caps = [min(len(g.tokens), self.max_k) for g in guesses]
        for i, g in enumerate(guesses):
            if caps[i]:
                self.accept.renew(ids[i], g.source)
        if not any(caps):
            return ks
        measured = self.curve.measured(batch)
        if len(measured) < 2 or 0 not in measured:  # measure: a plain round first, then one token each
            ks = [min(c, 1) for c in caps] if 0 in measured else ks
            self.measuring = self.rounds
        else:
            rates = [self.acceptance(r, g) for r, g in zip(ids, guesses)]
            gains = [(-rates[i] ** (j + 1), i) for i in range(batch) for j in range(caps[i])]
            heapq.heapify(gains)
            tokens = float(batch)  # expected tokens at the current lengths
            costs = [self.cost(batch, 0)]
            goodputs = [tokens / costs[0]]
            order = []
            while gains:
                gain, i = heapq.heappop(gains)
                order.append(i)
                tokens -= gain
                costs.append(self.cost(batch, len(order)))
                goodputs.append(tokens / costs[-1])
            best_total = longest_near_best(self.flat, goodputs, costs)
            if self.rounds - self.explored >= self.probe_every and order:
                best_total = self._explore(batch, best_total, range(1, len(order) + 1))
                self.measuring = self.rounds if self.explored == self.rounds else self.measuring
            for i in order[:best_total]:
                ks[i] += 1
            self._probe(ids, guesses, caps, ks)
        for i, g in enumerate(guesses):
            if ks[i]:
                self.accept.record(ids[i]).source = g.source
        self.proposing = self.proposing * self.batch_decay + sum(1 for k in ks if k)
        return ks

    def plan(self, ids: list[str], caps: list[int]) -> list[int]:
        """Each request's length before its guess exists, for a proposer whose guesses cost: a
        draft model runs as many steps as the longest proposal, for every row that proposes,
        so a round's cost follows one length, not each request's. The length `k` (each request
        at most its cap) whose expected tokens, at each request's acceptance for its latest
        verified confidence, over the measured cost of `k` is highest; until the batch's cost
        curve is measured, 0 (a plain round) then 1 (the cheapest length to measure); lengths
        not yet measured as `choose` explores them; a round planned at 0 probes one token as
        `_plan_probe` allows."""
        batch = len(ids)
        self.looked = self.rounds
        self.looks = self.looks * self.batch_decay + batch
        if not any(caps):
            return [0] * batch
        measured = self.curve.measured(batch)
        if len(measured) < 2 or 0 not in measured:
            k = 1 if 0 in measured else 0
            self.measuring = self.rounds
        else:
            rates = []
            for request_id in ids:
                record = self.accept.requests.get(request_id)
                rates.append(self.accept.rate(request_id, record.confidence if record else 0))

            costs = [self.cost(batch, sum(min(c, k) for c in caps)) for k in range(self.max_k + 1)]
            goodputs = [sum(expected_tokens(a, min(c, k)) for a, c in zip(rates, caps)) / costs[k]
                        for k in range(self.max_k + 1)]
            k = longest_near_best(self.flat, goodputs, costs)
            if self.rounds - self.explored >= self.probe_every:
                totals = {sum(min(c, n) for c in caps): n for n in range(self.max_k, 0, -1)}  # a total's shortest k
                k = totals.get(self._explore(batch, sum(min(c, k) for c in caps), list(totals)), k)
                self.measuring = self.rounds if self.explored == self.rounds else self.measuring
            if k == 0 and self.rounds - self.plan_probed >= self.probe_every:
                k = self._plan_probe(batch, sum(min(c, 1) for c in caps))
        ks = [min(c, k) for c in caps]
        self.proposing = self.proposing * self.batch_decay + sum(1 for n in ks if n)
        return ks

    def _explore(self, batch: int, best_total: int, totals) -> int:
        """The cost curve filled in: of the proposal totals the round can reach (`totals`), the
        largest of the verify size not yet measured (twice: its first round may have compiled)
        or stale (`CostCurve.to_measure`) at this batch nearest the best total's, instead of the
        best when the allowance pays what it adds by the curve; else the best total. A CPU's curve is not convex (a verify
        of few rows runs the decode kernels, of more a blocked GEMM; a token over a bucket pays
        the next one), so every size is tried once the allowance has it, the cheap ones first."""
        by_size: dict[int, int] = {}
        for total in totals:
            size = self.curve.size(batch, total)
            by_size[size] = max(by_size.get(size, 0), total)
        few = [size for size in by_size if self.curve.to_measure(batch, size, self.rounds)]
        if not few:
            return best_total
        best = self.curve.size(batch, best_total)
        size = min(few, key=lambda size: (abs(size - best), size))
        if not self._pay(self.cost(batch, by_size[size]) - self.cost(batch, best_total)):
            return best_total
        self.explored = self.rounds
        return by_size[size]

    def _pay(self, added: float) -> bool:
        """Whether exploring that adds `added` seconds to a round (by the cost curve) fits the
        allowance; if so it is paid (a cheaper round pays nothing)."""
        if added > self.allowance:
            return False
        self.allowance -= max(added, 0.0)
        return True

    def _plan_probe(self, batch: int, total: int) -> int:
        """No lock-out for a costly proposer: its guesses do not exist before the plan, so a
        round planned at 0 tries one token for every row instead (a draft's step costs the
        same for one row or all), at most once every `probe_every` rounds and only when what it
        adds to the round by the curve fits `allowance`; else 0."""
        if not self._pay(self.cost(batch, total) - self.cost(batch, 0)):
            return 0
        self.plan_probed = self.rounds
        return 1

    def _probe(self, ids: list[str], guesses: list[Guess], caps: list[int], ks: list[int]) -> None:
        """No lock-out: a request left at 0 whose guess is new (it never proposed, or its guess
        comes from another place, or the proposer cannot tell) tries one token, at most once
        every `probe_every` rounds, at most `batch / probe_every` of them in a round, and only
        while the time it adds to the round (by the cost curve) fits `allowance`."""
        budget = max(1, len(ids) // self.probe_every)
        batch, total = len(ids), sum(ks)
        for i, g in enumerate(guesses):
            if not budget:
                return
            if ks[i] or not caps[i]:
                continue
            record = self.accept.requests.get(ids[i])
            fresh = record is None or g.source is None or g.source != record.source
            if fresh and (record is None or self.rounds - record.probed >= self.probe_every):
                if not self._pay(self.cost(batch, total + 1) - self.cost(batch, total)):
                    return
                total += 1
                record = record or self.accept.record(ids[i])
                ks[i], record.probed = 1, self.rounds
                budget -= 1
