"""Property-based tests of the scheduler with a fake clock and a fake model (no JAX)."""

from __future__ import annotations

import collections
import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.scheduling.block_manager import BlockManager
from cbjax.scheduling.host_tier import HostTier
from cbjax.request import Request, RequestState, SamplingParams
from cbjax.scheduling.scheduler import Scheduler, SchedulerConfig
from cbjax.scheduling.update import record_decode, record_prefill

EOS = 2
MAX_SEQ_LEN = 48
TICK = 0.001  # fake seconds per engine round
TALLY = collections.Counter()  # what the host-tier and speculation properties exercised, over their examples


@dataclasses.dataclass
class Spec:
    arrival: float
    prompt_len: int
    max_tokens: int
    eos_at: int | None  # index of the output token that is EOS, if any
    priority: int


def fake_token(spec: Spec, index: int) -> int:
    return EOS if spec.eos_at == index else 10 + index % 7


class FakeEngine:
    """Mirrors the device: slots become active on a final prefill chunk, decode emits a
    token per active slot per step (-1 for idle ones) and deactivates finished slots."""

    def __init__(self, num_slots: int, steps: int):
        self.active = [False] * num_slots
        self.specs: list[Spec | None] = [None] * num_slots
        self.generated = [0] * num_slots
        self.lengths = [0] * num_slots
        self.max_tokens = [0] * num_slots
        self.steps = steps
        self.swapped = {}

    def _done(self, slot, token):
        return token == EOS or self.generated[slot] >= self.max_tokens[slot] or self.lengths[slot] >= MAX_SEQ_LEN

    def prefill(self, slot, spec, request, is_last):
        if not is_last:
            return None
        before = len(request.output_token_ids)  # > 0 when resumed after a preemption
        self.specs[slot], self.generated[slot] = spec, before + 1
        self.max_tokens[slot] = request.sampling.max_tokens
        self.lengths[slot] = request.prompt_len + before + 1
        token = fake_token(spec, before)
        self.active[slot] = not self._done(slot, token)
        return token

    def move_kv(self, ops):
        """A swapped-out slot's counters kept aside and restored (prefix pages carry no data here)."""
        for op in ops:
            if op.kind == "seq_out":
                self.swapped[op.key] = (self.specs[op.slot], self.generated[op.slot], self.lengths[op.slot],
                                        self.max_tokens[op.slot])
            elif op.kind == "seq_in":
                s = op.slot
                self.specs[s], self.generated[s], self.lengths[s], self.max_tokens[s] = self.swapped.pop(op.key)
                self.active[s] = True
            elif op.kind == "seq_drop":
                del self.swapped[op.key]

    def decode(self):
        out = []
        for _ in range(self.steps):
            row = []
            for slot, on in enumerate(self.active):
                if not on:
                    row.append(-1)
                    continue
                token = fake_token(self.specs[slot], self.generated[slot])
                self.generated[slot] += 1
                self.lengths[slot] += 1
                self.active[slot] = not self._done(slot, token)
                row.append(token)
            out.append(row)
        return out

    def verify(self, proposals: dict[int, list[int]]) -> list[list[int]]:
        """One step in which the slots in `proposals` verify their proposed tokens (the target's
        token at each position, kept while it agrees, then its own) and the other active slots
        decode one token: `[positions][slots]`, -1 past a slot's tokens."""
        width = 1 + max((len(p) for p in proposals.values()), default=0)
        out = [[-1] * len(self.active) for _ in range(width)]
        for slot, on in enumerate(self.active):
            for j in range(1 + len(proposals.get(slot, []))):
                if not on:
                    break
                token = fake_token(self.specs[slot], self.generated[slot])
                self.generated[slot] += 1
                self.lengths[slot] += 1
                on = self.active[slot] = not self._done(slot, token)
                out[j][slot] = token
                if j < len(proposals.get(slot, [])) and proposals[slot][j] != token:
                    break
        return out


def fake_proposal(spec: Spec, r: Request, k: int, round_: int) -> list[int]:
    """`k` tokens, right for a prefix whose length varies with the round, then wrong."""
    done = len(r.output_token_ids)
    right = (round_ + int(r.request_id)) % (k + 1)
    return [fake_token(spec, done + i) if i < right else 99 for i in range(k)]


configs = st.builds(
    SchedulerConfig,
    policy=st.sampled_from(["static", "dynamic", "continuous"]),
    num_slots=st.integers(1, 6),
    window_ms=st.sampled_from([0.0, 2.0, 10.0]),
    refill_interval=st.integers(1, 4),
    waiting_served_ratio=st.sampled_from([0.0, 0.5, 2.0]),
    max_waiting_steps=st.integers(1, 6),
    max_prefill_tokens=st.sampled_from([None, 8, 20]),
    ordering=st.sampled_from(["fcfs", "priority", "score", "sjf"]),
    score_wait=st.sampled_from([0.0, 1.0, 50.0]),
    score_short=st.sampled_from([0.0, 0.5, 10.0]),
    score_priority=st.sampled_from([0.0, 2.0]),
    priority_preemption=st.booleans(),
    length_aware=st.booleans(),
    decode_steps=st.integers(1, 3),
    num_speculative_tokens=st.sampled_from([0, 0, 1, 3]),
).flatmap(lambda c: st.builds(lambda b: dataclasses.replace(c, batch_size=b), st.integers(1, c.num_slots)))

specs = st.lists(
    st.builds(Spec, arrival=st.floats(0, 0.05), prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 20),
              eos_at=st.one_of(st.none(), st.integers(0, 25)), priority=st.integers(0, 3)),
    min_size=1, max_size=25)


def run(config: SchedulerConfig, workload: list[Spec], check_round=None, pages: BlockManager | None = None,
        host: HostTier | None = None):
    sched = Scheduler(config, {EOS}, MAX_SEQ_LEN, pages=pages, host=host)
    engine = FakeEngine(config.num_slots, config.decode_steps)
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    requests: list[Request] = [None] * len(workload)  # type: ignore[list-item]
    finish_events: dict[str, int] = {}
    batches: list[set[str]] = []
    now, pending, rounds = 0.0, 0, 0
    for _ in range(10_000):
        while pending < len(order) and workload[order[pending]].arrival <= now:
            i = order[pending]
            s = workload[i]
            requests[i] = Request(str(i), [5] * s.prompt_len, SamplingParams(max_tokens=s.max_tokens), s.arrival,
                                  priority=s.priority)
            sched.add(requests[i])
            pending += 1
        sched.drain(pending == len(order))
        if pending == len(order) and not sched.has_unfinished():
            break
        before = {r.request_id for r in sched.running}
        plan = sched.schedule(now, config.num_speculative_tokens)
        admitted = {r.request_id for r in sched.running} - before
        if admitted:
            batches.append(admitted)
        if check_round:
            check_round(sched, plan, now, admitted)
        _check_slots(sched)
        if plan.idle:
            nxt = [t for t in ([workload[order[pending]].arrival] if pending < len(order) else []) +
                   ([plan.wake_time] if plan.wake_time is not None else [])]
            assert nxt, "scheduler idles with requests waiting and nothing to wake it"
            now = max(now + TICK / 10, min(nxt))
            continue
        now += TICK
        rounds += 1
        speculating = [r for r in sched.running if r.state == RequestState.RUNNING]
        for slot in plan.preempted_slots:
            engine.active[slot] = False
        engine.move_kv(plan.kv_ops)
        for chunk in plan.prefills:
            token = engine.prefill(chunk.slot, workload[int(chunk.request.request_id)], chunk.request, chunk.is_last)
            if record_prefill(sched, chunk, -1 if token is None else token, now):
                finish_events[chunk.request.request_id] = finish_events.get(chunk.request.request_id, 0) + 1
        if plan.decode and plan.draft_len:  # as the core: a proposal for each request running before the round
            proposals = {}
            for r in speculating:
                k = min(plan.draft_len, r.sampling.max_tokens - len(r.output_token_ids) - 1, MAX_SEQ_LEN - r.num_tokens)
                if k > 0 and r.slot is not None:
                    proposals[r.slot] = fake_proposal(workload[int(r.request_id)], r, k, rounds)
                    if pages is not None:  # the verify row's positions are in the request's pages
                        assert r.num_tokens - 1 + k < len(pages.tables[r.request_id]) * pages.page_size
            TALLY.update(verify_rows=len(proposals), proposed=sum(map(len, proposals.values())))
            for r in record_decode(sched, engine.verify(proposals), now, 1):
                finish_events[r.request_id] = finish_events.get(r.request_id, 0) + 1
        elif plan.decode:
            for r in record_decode(sched, engine.decode(), now):
                finish_events[r.request_id] = finish_events.get(r.request_id, 0) + 1
        _check_slots(sched)
    else:
        raise AssertionError("workload did not finish")
    return sched, requests, finish_events, batches


def _check_slots(sched: Scheduler):
    held = [r for r in sched.slots if r is not None]
    assert len({r.request_id for r in held}) == len(held), "a request holds two slots"
    for i, r in enumerate(sched.slots):
        if r is not None:
            assert r.slot == i and r.state in (RequestState.PREFILLING, RequestState.RUNNING)
    assert not {r.request_id for r in held} & {r.request_id for r in sched.waiting}


def expected_output_len(spec: Spec) -> int:
    budget = min(spec.max_tokens, MAX_SEQ_LEN - spec.prompt_len)
    if spec.eos_at is not None and spec.eos_at < budget:
        return spec.eos_at + 1
    return budget


@settings(max_examples=150, deadline=None)
@given(configs, specs)
def test_every_request_finishes_exactly_once_and_no_slot_is_lost(config, workload):
    workload = [s for s in workload if s.prompt_len < MAX_SEQ_LEN]
    sched, requests, finish_events, _ = run(config, workload)
    assert sorted(finish_events) == sorted(r.request_id for r in requests)
    assert all(n == 1 for n in finish_events.values())
    for spec, r in zip(workload, requests):
        assert r.finished and r.finish_reason.value in ("stop", "length")
        assert len(r.output_token_ids) == expected_output_len(spec)
        assert r.metrics.first_token_time is not None and r.metrics.finish_time >= r.metrics.first_token_time
        assert len(r.metrics.token_times) == len(r.output_token_ids)
    assert sched.slots == [None] * config.num_slots and not sched.waiting


@settings(max_examples=100, deadline=None)
@given(configs.map(lambda c: dataclasses.replace(c, policy="static")), specs)
def test_static_never_mixes_batches(config, workload):
    finished_at_admission = []

    def check(sched, plan, now, admitted):
        if admitted:
            in_flight = [r for r in sched.running if r.request_id not in admitted]
            finished_at_admission.append(in_flight)
            if not sched.draining:
                assert len(admitted) == config.batch_size

    _, _, _, batches = run(config, workload, check)
    assert all(not rest for rest in finished_at_admission), "a batch started while another was running"
    assert all(len(b) <= config.batch_size for b in batches)


@settings(max_examples=100, deadline=None)
@given(configs.map(lambda c: dataclasses.replace(c, policy="dynamic")), specs)
def test_dynamic_never_waits_past_its_window_when_a_slot_is_free(config, workload):
    def check(sched, plan, now, admitted):
        if sched.waiting and not sched.running:
            deadline = min(r.arrival_time for r in sched.waiting) + config.window_ms / 1000
            assert now < deadline and len(sched.waiting) < config.batch_size, \
                "dynamic left a batch waiting past its window (or full) with every slot free"

    run(config, workload, check)


@settings(max_examples=100, deadline=None)
@given(configs.map(lambda c: dataclasses.replace(c, policy="continuous", refill_interval=1,
                                                 waiting_served_ratio=0.0, max_prefill_tokens=None)), specs)
def test_continuous_never_leaves_a_slot_idle_while_a_request_waits(config, workload):
    def check(sched, plan, now, admitted):
        assert not (sched.waiting and sched.free_slots), "a slot is idle while a request waits"

    run(config, workload, check)


@settings(max_examples=60, deadline=None)
@given(configs.map(lambda c: dataclasses.replace(c, policy="continuous", ordering="priority")), specs)
def test_priority_admits_lower_values_first(config, workload):
    def check(sched, plan, now, admitted):
        if admitted and sched.waiting:
            best_waiting = min(r.priority for r in sched.waiting)
            admitted_now = [r for r in sched.running if r.request_id in admitted]
            assert max(r.priority for r in admitted_now) <= best_waiting

    run(config, workload, check)


@settings(max_examples=80, deadline=None)
@given(configs.map(lambda c: dataclasses.replace(c, policy="continuous", priority_preemption=True,
                                                 refill_interval=1, waiting_served_ratio=0.0)),
       st.sampled_from(["priority", "score"]), specs)
def test_with_priority_preemption_no_waiting_request_outranks_a_holder_after_a_round(config, ordering, workload):
    """After each round of a continuous engine with priority preemption, every waiting
    request that could start ranks no better than every request holding a slot."""
    config = dataclasses.replace(config, ordering=ordering)

    def check(sched, plan, now, admitted):
        if sched.waiting and sched.running and not sched.free_slots:
            best = min(sched.order_key(r)[0] for r in sched.waiting)
            assert best >= max(sched.order_key(r)[0] for r in sched.running)
        assert len(set(plan.preempted_slots)) == len(plan.preempted_slots)

    sched, requests, finish_events, _ = run(config, workload, check)
    assert all(n == 1 for n in finish_events.values()) and len(finish_events) == len(workload)
    for spec, r in zip(workload, requests):
        assert r.output_token_ids == [fake_token(spec, i) for i in range(expected_output_len(spec))]


@settings(max_examples=150, deadline=None)
@given(configs, specs, st.integers(MAX_SEQ_LEN // 4, 40), st.booleans())
def test_paged_scheduling_with_preemption_finishes_everything_and_frees_every_page(config, workload, num_pages,
                                                                                   prefix):
    """A small page pool (4-token pages, as few as one max-length sequence's worth) forces
    preemptions; every request still finishes exactly once with its full output, and
    every page is free afterwards."""
    workload = [s for s in workload if s.prompt_len < MAX_SEQ_LEN]
    pages = BlockManager(num_pages, 4, enable_prefix_caching=prefix)

    def check(sched, plan, now, admitted):
        held = {r.request_id for r in sched.slots if r is not None}
        assert set(pages.tables) == held, "pages are held exactly by the requests in slots"

    sched, requests, finish_events, _ = run(config, workload, check, pages=pages)
    assert all(n == 1 for n in finish_events.values()) and len(finish_events) == len(workload)
    for spec, r in zip(workload, requests):
        assert len(r.output_token_ids) == expected_output_len(spec)
        assert r.output_token_ids == [fake_token(spec, i) for i in range(len(r.output_token_ids))]
    assert pages.num_free == num_pages and not pages.tables
    assert sum(r.metrics.num_preemptions for r in requests) == sched.num_preemptions


@settings(max_examples=150, deadline=None)
@given(configs.map(lambda c: dataclasses.replace(c, policy="continuous", num_slots=max(c.num_slots, 3))),
       st.lists(st.builds(Spec, arrival=st.floats(0, 0.02), prompt_len=st.integers(4, 30),
                          max_tokens=st.integers(8, 20), eos_at=st.one_of(st.none(), st.integers(0, 25)),
                          priority=st.integers(0, 3)), min_size=8, max_size=25),
       st.integers(MAX_SEQ_LEN // 4, 30), st.booleans(), st.booleans(), st.integers(1, 60))
def test_swap_and_host_prefix_tier_lose_nothing(config, workload, num_pages, paged, prefix, host_pages):
    """Swap on preemption with a host pool of 1-60 pages' worth (often too small: recompute
    then, counted), slots or pages, prefix pages behind the device's: every request finishes
    once with its full output (a swapped-in one goes on from its own next token), the pool's
    bytes never pass its bound, and after the drain no device page, slot or swapped sequence
    is held (cached prefix pages may stay, in either tier)."""
    workload = [s for s in workload if s.prompt_len < MAX_SEQ_LEN]
    config = dataclasses.replace(config, preemption_mode="swap")
    host = HostTier(host_pages * 4 * 10, 4 * 10, lambda n: 10 * n + 7)  # 10 bytes a token, 7 a state row
    pages = BlockManager(num_pages, 4, enable_prefix_caching=prefix, host=host) if paged else None
    swaps = []

    def check(sched, plan, now, admitted):
        assert host.used <= host.capacity
        swaps.extend(op for op in plan.kv_ops if op.kind in ("seq_out", "seq_in"))
        if paged:
            assert set(pages.tables) == {r.request_id for r in sched.slots if r is not None}

    sched, requests, finish_events, _ = run(config, workload, check, pages=pages, host=host)
    assert all(n == 1 for n in finish_events.values()) and len(finish_events) == len(workload)
    for spec, r in zip(workload, requests):
        assert r.output_token_ids == [fake_token(spec, i) for i in range(expected_output_len(spec))]
        assert not r.swapped
    assert not host.sequences and sum(op.kind == "seq_out" for op in swaps) == host.stats.swaps_out
    assert host.stats.swaps_in == host.stats.swaps_out
    assert host.stats.swaps_out + host.stats.swap_fallbacks <= sched.num_preemptions
    assert sum(r.metrics.num_preemptions for r in requests) == sched.num_preemptions
    assert host.used == len(host.prefix) * host.page_bytes
    TALLY.update(swaps=host.stats.swaps_out, fallbacks=host.stats.swap_fallbacks, host_hits=host.stats.pages_in)
    if paged:
        assert pages.num_free == num_pages and not pages.tables


def test_policies_read_the_scheduler_and_never_call_back_into_it():
    """The policies (cbjax/scheduling/policies.py) see the scheduler only through a
    `SchedulerView`, which reads its attributes and calls none of its methods, and they import
    nothing of scheduler.py: following `Scheduler.schedule` never re-enters the scheduler from a
    policy. And the view reads live state: what the scheduler changes, the policy sees."""
    import ast
    import inspect

    from cbjax.scheduling import policies

    tree = ast.parse(inspect.getsource(policies))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "cbjax.scheduling.scheduler" not in imported
    view = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SchedulerView")
    calls_on_sched = [ast.unparse(n) for n in ast.walk(view) if isinstance(n, ast.Call)
                      and isinstance(n.func, ast.Attribute) and ast.unparse(n.func.value).endswith("sched")]
    writes = [ast.unparse(n) for n in ast.walk(view) if isinstance(n, (ast.Assign, ast.AugAssign))
              and any("sched." in ast.unparse(t) for t in getattr(n, "targets", [getattr(n, "target", None)]))]
    assert calls_on_sched == [] and writes == []
    sched = Scheduler(SchedulerConfig(policy="continuous", num_slots=2), {EOS}, MAX_SEQ_LEN)
    sched.add(Request("a", [5, 6], SamplingParams(max_tokens=2), 0.0))
    assert sched.view.num_waiting == 1 and sched.view.num_free == 2
    sched.schedule(0.0)
    assert sched.view.num_waiting == 0 and [r.request_id for r in sched.view.holders()] == ["a"]
