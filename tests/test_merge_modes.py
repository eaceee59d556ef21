"""Mixed steps (merge_mode fused / chunked): the token budget and its order, bounded
programs (nothing compiles after warm-up), and bad settings refused."""

from __future__ import annotations

import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.runtime.engine import Engine
from cbjax.request import RequestState
from tests.internals import engine_of, scheduler_of

MAX_SEQ_LEN = 64


def random_requests(rng, n, vocab=500):
    prompts = [rng.integers(3, vocab, size=int(k)).tolist() for k in rng.integers(1, 50, size=n)]
    params = [SamplingParams(max_tokens=int(m), temperature=float(t), top_p=float(p), seed=i)
              for i, (m, t, p) in enumerate(zip(rng.integers(1, 14, size=n), rng.choice([0.0, 0.9], size=n),
                                                rng.choice([1.0, 0.8], size=n)))]
    return prompts, params


def recording(llm):
    """Wrap the scheduler so that every plan is kept with what was running when it was made."""
    plans = []
    schedule = scheduler_of(llm).schedule

    def wrapped(now, *args, **kwargs):
        running = [r for r in scheduler_of(llm).running if r.state == RequestState.RUNNING]
        plan = schedule(now, *args, **kwargs)
        plans.append((plan, running))
        return plan

    scheduler_of(llm).schedule = wrapped
    return plans


@pytest.mark.parametrize("mode,budget", [("chunked", 13), ("chunked", 24), ("fused", 30)])
def test_budget_decodes_first_then_chunks(mode, budget):
    llm = LLM("tiny-llama", num_slots=4, max_seq_len=MAX_SEQ_LEN, merge_mode=mode, max_num_batched_tokens=budget)
    plans = recording(llm)
    rng = np.random.default_rng(1)
    prompts, params = random_requests(rng, 30)
    llm.generate(prompts, params, use_tqdm=False)
    assert plans and all(plan.mixed for plan, _ in plans)
    for plan, running in plans:
        tokens = sum(c.length for c in plan.prefills)
        decodes = sum(1 for r in running if r.slot is not None)
        alone = len(plan.prefills) == 1 and decodes == 0
        assert tokens + decodes <= budget or (mode == "fused" and alone), "a step went over its token budget"
        if running:
            assert plan.decode, "every step decodes the running requests (stall-free)"
        if mode == "fused":
            assert all(c.start == 0 or c.request.num_prefilled for c in plan.prefills)
            assert all(c.is_last for c in plan.prefills), "fused takes whole prompts"
    if mode == "chunked":
        assert any(not c.is_last for plan, _ in plans for c in plan.prefills), "some prompt was chunked"


@pytest.mark.parametrize("options", [
    dict(merge_mode="chunked", max_num_batched_tokens=13),
    dict(merge_mode="fused"),
    dict(merge_mode="chunked", max_num_batched_tokens=20, kv_cache="paged", page_size=8, num_pages=24,
         enable_prefix_caching=True),
    dict(merge_mode="chunked", max_num_batched_tokens=40, token_bucket_steps=2, prefill_floor=8),
    # an accelerator's buckets (none below 16 tokens), with multi-step decode calls
    dict(merge_mode="prefill_first", decode_steps=2, min_step_tokens=16, max_step_tokens=64),
], ids=["chunked-slots", "fused-slots", "chunked-paged-prefix", "chunked-bucket-steps", "prefill-first-min-16"])
def test_nothing_compiles_after_warmup_over_200_mixed_requests(options):
    llm = LLM("tiny-llama", num_slots=4, max_seq_len=MAX_SEQ_LEN, **options)
    assert llm.warmup() == len(engine_of(llm).programs())
    # one step per token bucket, up to the first that holds the budget: powers of two, and the
    # 1.5x sizes from the prefill floor on with token_bucket_steps=2
    budget = engine_of(llm).step_tokens
    sizes = [1 << i for i in range((budget - 1).bit_length() + 1)]
    if options.get("token_bucket_steps") == 2:
        sizes = sorted(sizes + [s * 3 // 2 for s in sizes if s >= options["prefill_floor"]])
        sizes = sizes[:next(i for i, s in enumerate(sizes) if s >= budget) + 1]
        assert sizes == [1, 2, 4, 8, 12, 16, 24, 32, 48]
    sizes = [s for s in sizes if s >= engine_of(llm).config.smallest_step(engine_of(llm).platform)]
    assert [p[1] for p in engine_of(llm).programs() if p[2] == 1] == sizes
    compiled = Engine.num_backend_compilations()
    rng = np.random.default_rng(2)
    prompts, params = random_requests(rng, 200)
    done = 0
    for i in range(0, 200, 25):  # online arrivals in waves, steps in between
        for p, s in zip(prompts[i:i + 25], params[i:i + 25]):
            llm.add_request(p, s)
        for _ in range(int(rng.integers(1, 6))):
            done += sum(1 for o in llm.step() if o.finished)
    done += len(llm.run_until_done())
    assert done == 200
    assert Engine.num_backend_compilations() == compiled, "a mixed workload compiled after warm-up"


def test_decode_only_steps_cost_the_active_rows_not_the_slots():
    """The program a decode-only step runs depends on the number of active sequences, so
    64 slots with 2 active run the same shapes as 2 slots with 2 active."""
    shapes = []
    for slots in (2, 64):
        llm = LLM("tiny-llama", num_slots=slots, max_seq_len=MAX_SEQ_LEN, merge_mode="chunked",
                  max_num_batched_tokens=2 * slots + 8, min_step_tokens=1)
        calls = []
        step = engine_of(llm)._step
        engine_of(llm)._step = lambda packed, steps, *sampler: calls.append((packed[0].shape, packed[1].shape)) \
            or step(packed, steps, *sampler)
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        shapes.append(calls[-1])
    assert shapes[0] == shapes[1] == ((2, 2), (2, shapes[0][1][1]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(merge_mode="sideways"), "merge_mode"),
    (dict(merge_mode="chunked", max_num_batched_tokens=4), "num_slots"),
    (dict(merge_mode="fused", policy="static"), "continuous"),
    (dict(merge_mode="chunked", decode_steps=2), "decode_steps"),
    (dict(merge_mode="chunked", max_prefill_tokens=8), "max_prefill_tokens"),
    (dict(merge_mode="fused", max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(token_bucket_steps=3), "power of two"),
    (dict(token_bucket_steps=0), "token_bucket_steps"),
])
def test_bad_merge_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny-llama", num_slots=4, max_seq_len=MAX_SEQ_LEN, **kwargs)
