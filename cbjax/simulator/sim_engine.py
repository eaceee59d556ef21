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
from typing_extensions import override

from cbjax.runtime.engine import Engine, EngineConfig
from cbjax.runtime.packing import row_bucket
from cbjax.scheduling.plan import Row
from cbjax.request import SamplingParams
from cbjax.simulator.cost_model import Call, kv_transfer_cost
from cbjax.simulator.hardware import DTYPE_BYTES, LINKS


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
    kind = "simulated"
    ops = None  # it traces nothing
    mesh = None
    reads_block_tables = False  # pages only change which memory is read, not how much
    can_run_ahead = False  # the simulated clock charges each call when it is made: no overlap to model
    supports_structured_output = False  # its tokens are fillers, no grammar could follow them
    takes_sampler_variants = False  # it compiles nothing
    scores_prompts = False  # nor scores a prompt in its step

    def __init__(self, model, config: EngineConfig, cost, clock: SimClock, platform: str | None = None,
                 dtype: str = "float32"):
        # The platform it stands for (its default step budget): a roofline's accelerator, else
        # this CPU (a calibration measured here).
        self.platform = platform or ("gpu" if hasattr(cost, "accelerator") else "cpu")
        self._configure(model, config)
        self.max_logprobs = 0  # it samples filler tokens: no distribution to report
        self.cost = cost
        self.clock = clock
        # The Pallas kernels model a GPU engine's ragged ones: a prefill computes its real
        # tokens and causal pairs, a decode reads each sequence's own pages. The reference
        # paths compute every padded row and read every slot (or, in a mixed step, every
        # token's keys) up to the attended-length bucket.
        self.reads_live_pages = self.attention == "pallas"
        self.busy_s = 0.0  # simulated device time (vs the clock, which also counts idle waits)
        self.kv_bytes_per_token = kv_transfer_cost(cost, model.config, dtype)[1]  # at the modelled KV dtype
        self.host_s = 0.0  # simulated time of KV moves to and from host memory (within busy_s)
        self.swapped: dict[object, tuple] = {}  # swapped-out sequences' slot counters
        self.lora = SimulatedAdapters(self, dtype_bytes(cost, dtype) / 4) if config.enable_lora else None
        self.reset()

    @override
    def wait_for_compiles(self) -> int:
        return 0

    @override
    def reset(self) -> None:
        s = self.config.num_slots
        self.active = np.zeros(s, bool)
        self.length = np.zeros(s, np.int64)  # tokens in the slot's cache
        self.generated = np.zeros(s, np.int64)
        self.max_tokens = np.zeros(s, np.int64)
        self.filler = np.zeros(s, np.int64)

    @override
    def move_kv(self, ops) -> None:
        """The host tier's moves: no data, a swapped sequence's slot counters kept aside, and
        the bytes (its cached positions, a prefix page's) charged over the host link."""
        per_token = self.kv_bytes_per_token
        moved = 0
        for op in ops:
            if op.kind == "seq_out":
                s = op.slot
                self.swapped[op.key] = (op.length, self.generated[s], self.max_tokens[s], self.filler[s])
                moved += op.length * per_token
            elif op.kind == "seq_in":
                length, generated, max_tokens, filler = self.swapped.pop(op.key)
                s = op.slot
                self.active[s], self.length[s], self.generated[s] = True, length, generated
                self.max_tokens[s], self.filler[s] = max_tokens, filler
                moved += length * per_token
            elif op.kind == "seq_drop":
                del self.swapped[op.key]
            elif op.kind in ("page_out", "page_in"):
                moved += self.config.page_size * per_token
        if moved:
            seconds = self.host_seconds(moved)
            self.host_s += seconds
            self.busy_s += seconds
            self.clock.advance(seconds)

    @override
    def copy_kv(self, copies) -> None:
        pass  # a fork's copy is a few pages: not charged

    @override
    def record_histories(self, rows) -> None:
        pass  # no logits, so no penalties to keep a history for

    def _charge(self, call: Call) -> None:
        self.charge(self.cost.seconds(call))

    def host_seconds(self, size: float) -> float:
        """Seconds `size` bytes take over the host link (the cost model's, or PCIe 4's)."""
        return getattr(self.cost, "host_link", LINKS["pcie4-host"]).transfer_seconds(size)

    def charge(self, seconds: float) -> None:
        """Device time spent: the clock moves on (a simulated draft model's steps come here too)."""
        self.busy_s += seconds
        self.clock.advance(seconds)

    def filler_for(self, sampling: SamplingParams) -> int:
        """The token every step samples for a request of `sampling` (what a simulated proposal
        must propose to be accepted)."""
        return self._filler(sampling)

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

    # ------------------------------------------------------------ the step
    def _call(self, rows: list[Row], steps: int) -> np.ndarray:
        """One call of the step over `rows`: the device's answer `[steps, rows bucket, 2]`, and
        its cost charged. A call of prompt rows alone is charged as a prefill, of decode rows
        alone as a decode, of both as a mixed step."""
        num_tokens = self.call_tokens(rows)
        positions = self.verify_positions if any(r.verify for r in rows) else steps
        out = np.full((positions, row_bucket(num_tokens, self.config.num_slots), 2), (-1, 0), np.int32)
        real = pairs = keys = longest = 0
        for step in range(steps):
            for j, r in enumerate(rows):
                if r.verify:
                    start, n = r.start, r.length
                    end = self._verify(r.slot, start, r.tokens[1:], out[:, j])
                elif r.is_decode:
                    slot = r.slot
                    if not self.active[slot]:
                        continue  # finished (or deactivated) before this step: computes nothing
                    start = int(self.length[slot])
                    self.length[slot] = end = start + 1
                    self.generated[slot] += 1
                    done = self.generated[slot] >= self.max_tokens[slot] or end + 1 >= self.max_len
                    self.active[slot] = not done
                    out[step, j] = (self.filler[slot], done)
                    n = 1
                else:
                    start, n = r.start, r.length
                    self.length[r.slot] = end = start + n
                    if r.is_last:
                        out[step, j] = self._start(r.slot, end, r.sampling, r.generated)
                real += n
                pairs += causal_pairs(start, n)
                keys += end
                longest = max(longest, start)
        adapter_bytes = self.lora.call_bytes(rows) if self.lora is not None else 0.0
        kinds = {r.is_decode for r in rows}
        kind = "mixed" if len(kinds) == 2 or any(r.verify for r in rows) else "decode" if True in kinds else "prefill"
        active = sum(r.decodes for r in rows) if kind != "prefill" else len(rows)
        if self.reads_live_pages:  # ragged kernels: the real tokens, their causal pairs, live pages
            call = Call(kind, tokens=real, attended=pairs, kv_read=keys, rows=active, steps=steps,
                        adapter_bytes=adapter_bytes)
        else:  # the reference step: every padded token, the flat square, the history in blocks
            block = self.history_block()
            read = steps * num_tokens * (-(-longest // block) * block)
            call = Call(kind, tokens=steps * num_tokens, attended=read + steps * num_tokens * num_tokens,
                        kv_read=read, rows=active, steps=steps, adapter_bytes=adapter_bytes)
        self._charge(call)
        return out

    def _verify(self, slot: int, start: int, proposal: list[int], out: np.ndarray) -> int:
        """A verify row, as the device's: the filler at every position, kept while the proposal
        agrees, cut by the stop test; `out [positions, 2]` filled. Returns the cache's length."""
        filler, kept = self.filler[slot], 0
        for p in range(1 + len(proposal)):
            self.generated[slot] += 1
            kept = p + 1
            done = self.generated[slot] >= self.max_tokens[slot] or start + p + 2 >= self.max_len
            out[p] = (filler, done)
            if done:
                self.active[slot] = False
                break
            if p < len(proposal) and proposal[p] != filler:
                break
        self.length[slot] = start + kept
        return start + kept

    @override
    def run(self, rows: list[Row], steps: int = 1) -> list:
        return [(self._call([r for _, r in members], steps), [i for i, _ in members]) for members in self.split(rows)]

    @override
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

    @override
    def warmup(self, only: str | None = None) -> int:
        return 0  # nothing to compile


def dtype_bytes(cost, dtype: str) -> float:
    """Bytes per weight the cost model charges (a roofline's modelled weight dtype), else `dtype`'s."""
    return DTYPE_BYTES[getattr(cost, "weight_dtype", None) or dtype]


class SimulatedAdapters:
    """A simulated engine's LoRA pool: no weights, each slot's bytes at the modelled weight dtype.
    A call reads its rows' distinct adapters (`Call.adapter_bytes`, charged with the weights);
    loading one moves its bytes over the host link, charged on the clock (as if the load did not
    overlap the steps: an upper bound on its cost)."""

    def __init__(self, engine: SimulatedEngine, scale: float):
        self.engine = engine
        self.scale = scale  # modelled bytes per float32 byte of the adapter
        self.nbytes: dict[int, float] = {}  # slot -> bytes
        self.load_s = 0.0  # simulated seconds of adapter loads

    def load(self, slot: int, adapter) -> None:
        size = adapter.nbytes * self.scale
        self.nbytes[slot] = size
        seconds = self.engine.host_seconds(size)
        self.load_s += seconds
        self.engine.charge(seconds)

    def call_bytes(self, rows) -> float:
        return float(sum(self.nbytes.get(slot, 0.0) for slot in {r.adapter for r in rows} if slot))

    def warmup(self) -> int:
        return 0
