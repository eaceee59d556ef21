"""What the adaptive speculation length learns from the rounds it ran: each request's
acceptance (`Acceptance`) and what a round costs at each batch size and verify size
(`CostCurve`). `speculation_length.AdaptiveLength` decides from both."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestRecord:
    trials: float = 0.0  # decayed tokens tried
    accepted: float = 0.0  # decayed tokens kept
    source: int | None = None  # where its latest guess came from
    confidence: int = 0  # its latest verified guess's
    probed: int = -(1 << 30)  # the round of its latest probe


class Acceptance:
    """Per-token acceptance: each request's decayed record (`memory` tokens), shrunk toward the
    decayed rate of guesses of the same confidence across the engine (`prior_weight` tokens of
    it, itself shrunk toward `prior_acceptance`)."""

    def __init__(self, memory: int = 32, prior_acceptance: float = 0.5, prior_weight: float = 4.0,
                 batch_memory: int = 256):
        self.decay = 1.0 - 1.0 / memory  # a request's record, per token tried
        self.batch_decay = 1.0 - 1.0 / batch_memory  # a confidence's rate, per token tried
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.by_confidence: dict[int, list[float]] = {}  # confidence -> [tokens tried, kept] (decayed)
        self.requests: dict[str, RequestRecord] = {}

    def confidence_rate(self, confidence: int) -> float:
        tried, kept = self.by_confidence.get(confidence, (0.0, 0.0))
        w = self.prior_weight
        return (kept + w * self.prior_acceptance) / (tried + w)

    def rate(self, request_id: str, confidence: int) -> float:
        """The request's per-token acceptance for a guess of this confidence."""
        record = self.requests.get(request_id)
        prior = self.confidence_rate(confidence)
        if record is None:
            return min(prior, 0.999)
        w = self.prior_weight
        return min((record.accepted + w * prior) / (record.trials + w), 0.999)

    def renew(self, request_id: str, source: int | None) -> None:
        """A guess from a new place (another n-gram match): the request's own record counts half."""
        record = self.requests.get(request_id)
        if record is not None and None not in (source, record.source) and source != record.source:
            record.trials *= 0.5
            record.accepted *= 0.5

    def observe(self, request_id: str, asked: int, accepted: int, confidence: int = 0) -> bool:
        """A verify row's outcome: `accepted` tokens kept of the `asked` it proposed. Per token
        given the ones before it were kept (what `expected_tokens` assumes): it tried its kept
        tokens and, if it stopped short, one more. False if it tried none."""
        trials = accepted + (accepted < asked)
        if not trials:
            return False
        record = self.requests.setdefault(request_id, RequestRecord())
        record.confidence = confidence
        d = self.decay ** trials
        record.trials, record.accepted = record.trials * d + trials, record.accepted * d + accepted
        rate = self.by_confidence.setdefault(confidence, [0.0, 0.0])
        d = self.batch_decay ** trials
        rate[0], rate[1] = rate[0] * d + trials, rate[1] * d + accepted
        return True

    def record(self, request_id: str) -> RequestRecord:
        return self.requests.setdefault(request_id, RequestRecord())

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


class CostCurve:
    """The measured seconds of a round per batch size and verify size, batches grouped by
    powers of two. A verify round's size is what its cost follows: the token bucket its
    `batch + total` tokens are padded to (`buckets`, the engine's), or without buckets (the
    simulator charges the real tokens) the mean proposal length rounded. Key 0 is a plain
    round, -1 one run ahead of the previous one's record. A size's first round (which may have
    compiled) counts only once a second confirms it; estimates fall fast and rise slowly. A
    size not measured for `stale_after` rounds is stale: exploring measures it again, and that
    reading replaces its estimate (a size measured slow once, by a hiccup of the machine, is
    otherwise never picked, so never measured again: locked out for good)."""

    def __init__(self, buckets: tuple[int, ...] | None = None, stale_after: int = 64):
        self.buckets = sorted(buckets) if buckets else None
        self.stale_after = stale_after
        self.seconds: dict[tuple[int, int], tuple[float, int]] = {}  # (batch group, size) -> (seconds, rounds seen)
        self.last: dict[tuple[int, int], int] = {}  # (batch group, size) -> the round it was last measured

    @staticmethod
    def group(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()

    def size(self, batch: int, total: int, exact: bool = False) -> float:
        """The verify size of a round at `batch` rows proposing `total` tokens (0: a plain
        round): its token bucket, or without buckets its batch group times one plus the mean
        proposal length (at least 1), rounded to a key unless `exact`."""
        if total <= 0:
            return 0
        if self.buckets is None:
            kbar = max(1.0, total / batch)
            return self.group(batch) * (1 + (kbar if exact else max(1, round(kbar))))
        return next((b for b in self.buckets if b >= batch + total), self.buckets[-1])

    def record(self, batch: int, total: int, seconds: float, ahead: bool = False, now: int = 0) -> None:
        """A round of `batch` rows proposing `total` tokens took `seconds`; `now`: the round's index."""
        key = (self.group(batch), -1 if ahead else self.size(batch, total))
        old, count = self.seconds.get(key, (seconds, 0))
        if count >= 2 and self.is_stale(key, now):
            estimate = seconds
        elif count <= 1 or seconds < old:  # the first round of a size may have compiled its program
            estimate = min(old, seconds) if count == 1 else 0.5 * old + 0.5 * seconds
        else:
            estimate = 0.9 * old + 0.1 * min(seconds, 2 * old)
        self.seconds[key] = (estimate, count + 1)
        self.last[key] = now

    def is_stale(self, key: tuple[int, int], now: int) -> bool:
        return now - self.last.get(key, now) >= self.stale_after

    def to_measure(self, batch: int, size: int, now: int) -> bool:
        """Whether exploring should measure this verify size at this batch: not yet confirmed
        (seen twice), or stale."""
        key = (self.group(batch), size)
        return self.seconds.get(key, (0.0, 0))[1] < 2 or self.is_stale(key, now)

    def measured(self, batch: int) -> dict[int, float]:
        """The confirmed (seen twice) sizes at this batch's group and their seconds; -1 left out."""
        g = self.group(batch)
        return {k: y for (b, k), (y, c) in self.seconds.items() if b == g and c >= 2 and k >= 0}

    def ahead(self, batch: int) -> float | None:
        """A round run ahead at this batch, once confirmed."""
        seconds, count = self.seconds.get((self.group(batch), -1), (0.0, 0))
        return seconds if count >= 2 else None

    def cost(self, batch: int, total: int) -> float | None:
        """The seconds of a round at `batch` proposing `total` tokens, or None before two sizes
        were measured at that batch. A round with any proposal runs the verify program (one
        step a call, every row sampled at each position), a cost of its own: below the smallest
        measured verify size it costs that size's round, never a share of the way down to a
        plain round's; linear between measured sizes; past the largest measured, that one's
        round. The last is optimism, and it is how longer lengths get measured: one that looks
        best is run, and two rounds of it put it on the curve."""
        measured = self.measured(batch)
        if len(measured) < 2:
            return None
        if total <= 0:
            return measured.get(0)
        size = self.size(batch, total, exact=True)
        points = sorted((k, y) for k, y in measured.items() if k >= 1)
        if not points:
            return None
        if size <= points[0][0]:
            return points[0][1]
        if size >= points[-1][0]:
            return points[-1][1]
        (k0, y0), (k1, y1) = next((a, b) for a, b in zip(points, points[1:]) if size <= b[0])
        return max(y0 + max(y1 - y0, 0.0) * (size - k0) / (k1 - k0), 1e-9)
