"""An engine that computes nothing: it keeps the per-slot decode state the device would
(lengths, tokens generated, stop conditions), answers each call with what the device
would answer, and advances a simulated clock by what the call would cost.

It is an `Engine` with the device programs replaced, so the `LLM` front, the scheduler,
the prefill grouping and bucketing, and the metrics all run unchanged. The sampled
token is a filler id outside the request's stop set: requests end on `max_tokens` or
the context (the workloads ignore EOS), exactly where the real engine's would.
"""

from __future__ import annotations

import numpy as np

from cbjax.runtime.engine import Engine, EngineConfig, bucket_for
from cbjax.scheduling.plan import Row
from cbjax.request import SamplingParams
from cbjax.simulator.cost_model import Call


def causal_pairs(start: int, n: int) -> int:
    """Query-key pairs of `n` new tokens after `start` cached ones, the masked half skipped."""
    return n * start + n * (n + 1) // 2


class SimClock:
    """Simulated seconds; `LLM` reads it as its clock and sleeps on it."""

    def __init__(self, start: float = 0.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(float(seconds), 0.0)

    def follow(self, busy: list[float], lanes: list[float]) -> None:
        """A multi-lane front's shared clock after a round: the next round's start (the
        earliest `busy` lane's time), so the arrivals before it are admitted first; with
        none busy, the latest of all `lanes` (each has run to its own time). Never back."""
        self.now = max(self.now, min(busy) if busy else max(lanes, default=self.now))


class LaneClock(SimClock):
    """One instance's own simulated time beside others' on a multi-instance front (replicas,
    disaggregated prefill and decode): its engine's charges advance it alone, so instances
    run in parallel; the front runs whichever lane is earliest, so lanes stay within a
    round of each other. `catch_up(t)`: an idle lane that gets work at `t` starts then."""

    def catch_up(self, t: float) -> None:
        self.now = max(self.now, float(t))


class SimulatedEngine(Engine):
    reads_block_tables = False  # pages only change which memory is read, not how much
    can_run_ahead = False  # the simulated clock charges each call when it is made: no overlap to model

    def __init__(self, model, config: EngineConfig, cost, clock: SimClock):
        self._configure(model, config)
        self.max_logprobs = 0  # it samples filler tokens: no distribution to report
        self.cost = cost
        self.clock = clock
        # The Pallas kernels model a GPU engine's ragged ones: a prefill computes its real
        # tokens and causal pairs, a decode reads each sequence's own pages. The reference
        # paths compute every padded row and read every slot (or, in a mixed step, every
        # token's keys) up to the attended-length bucket.
        self.reads_live_pages = config.attention == "pallas"
        self.busy_s = 0.0  # simulated device time (vs the clock, which also counts idle waits)
        self.reset()

    def reset(self) -> None:
        s = self.config.num_slots
        self.active = np.zeros(s, bool)
        self.length = np.zeros(s, np.int64)  # tokens in the slot's cache
        self.generated = np.zeros(s, np.int64)
        self.max_tokens = np.zeros(s, np.int64)
        self.filler = np.zeros(s, np.int64)

    def copy_kv(self, copies) -> None:
        pass  # a fork's copy is a few pages: not charged

    def _record_histories(self, rows) -> None:
        pass  # no logits, so no penalties to keep a history for

    def _charge(self, call: Call) -> None:
        seconds = self.cost.seconds(call)
        self.busy_s += seconds
        self.clock.advance(seconds)

    def _filler(self, sampling: SamplingParams) -> int:
        stops = set(self.stop_ids_for(sampling).tolist())
        return next(t for t in range(self.model.config.vocab_size) if t not in stops)

    def _start(self, slot: int, length: int, sampling: SamplingParams, generated: int) -> tuple[int, bool]:
        """A prompt's last chunk: the slot's first (next) token and whether that ends it."""
        token = self._filler(sampling)
        done = generated + 1 >= sampling.max_tokens or length + 1 >= self.max_len
        self.active[slot] = not done
        self.generated[slot] = generated + 1
        self.max_tokens[slot] = sampling.max_tokens
        self.filler[slot] = token
        return token, done

    # ------------------------------------------------------------ programs
    def _prefill_call(self, chunks: list[Row], bucket: int, kv_len: int) -> np.ndarray:
        rows = 1 << (len(chunks) - 1).bit_length()
        out = np.full((rows, 2), (-1, 0), np.int32)
        for r, c in enumerate(chunks):
            self.length[c.slot] = c.start + len(c.tokens)
            if c.is_last:
                out[r] = self._start(c.slot, int(self.length[c.slot]), c.sampling, c.generated)
        if self.reads_live_pages:  # ragged kernels: the real tokens, the causal half of their pairs
            sizes = [(c.start, len(c.tokens)) for c in chunks]
            self._charge(Call("prefill", tokens=sum(n for _, n in sizes), rows=len(chunks),
                              attended=sum(causal_pairs(start, n) for start, n in sizes),
                              kv_read=sum(start for start, _ in sizes)))
        else:  # the reference program: every padded row and the whole masked square
            self._charge(Call("prefill", tokens=rows * bucket, attended=rows * bucket * (kv_len + bucket),
                              kv_read=rows * kv_len, rows=len(chunks)))
        return out

    def decode(self, longest: int, slots=None) -> np.ndarray:
        steps = self.config.decode_steps
        kv_len = self._attended_len(longest + steps)
        computed = self.decode_rows_computed(slots)
        slots = self.config.num_slots
        out = np.full((steps, slots), -1, np.int32)
        rows = int(self.active.sum())
        live_keys = 0
        for step in range(steps):
            act = self.active
            self.length[act] += 1
            self.generated[act] += 1
            live_keys += int(self.length[act].sum())
            out[step, act] = self.filler[act]
            done = act & ((self.generated >= self.max_tokens) | (self.length + 1 >= self.max_len))
            self.active = act & ~done
        read = live_keys if self.reads_live_pages else steps * computed * kv_len
        self._charge(Call("decode", tokens=steps * computed, attended=read, kv_read=read, rows=rows, steps=steps))
        return out

    def mixed_step(self, rows: list[Row]) -> np.ndarray:
        total = sum(r.num_tokens for r in rows)
        num_tokens = bucket_for(total, self._mixed_token_buckets())
        kv_len = self._attended_len(max(r.start + r.num_tokens for r in rows))
        out = np.full((len(rows), 2), (-1, 0), np.int32)
        pairs = keys = 0
        for i, r in enumerate(rows):
            end = r.start + r.num_tokens
            pairs += causal_pairs(r.start, r.num_tokens)
            keys += end
            self.length[r.slot] = end
            if r.is_decode:
                if self.active[r.slot]:
                    self.generated[r.slot] += 1
                    done = self.generated[r.slot] >= self.max_tokens[r.slot] or end + 1 >= self.max_len
                    self.active[r.slot] = not done
                    out[i] = (self.filler[r.slot], done)
            elif r.is_last:
                out[i] = self._start(r.slot, end, r.sampling, r.generated)
        if self.reads_live_pages:  # ragged kernels: the real tokens, their causal pairs, live pages
            num_tokens, attended, read = total, pairs, keys
        else:  # the reference path gathers every token's keys up to the bucket
            attended = read = num_tokens * kv_len
        self._charge(Call("mixed", tokens=num_tokens, attended=attended, kv_read=read, rows=len(rows)))
        return out

    def deactivate(self, slot: int) -> None:
        self.active[slot] = False

    def insert_prefilled(self, slot: int, length: int, sampling: SamplingParams, generated: int) -> None:
        """A sequence prefilled elsewhere (a disaggregated decode instance): `length` tokens in
        the cache, `generated` sampled, the newest one the next decode input."""
        self.active[slot] = True
        self.length[slot] = length
        self.generated[slot] = generated
        self.max_tokens[slot] = sampling.max_tokens
        self.filler[slot] = self._filler(sampling)

    def warmup(self, chunked: bool = False, max_prompt_len: int | None = None, only: str | None = None) -> int:
        return 0  # nothing to compile
