"""The KV cache's host tier: swap on preemption (token-exact with a run never preempted, for
every family, both cache layouts, both preemption causes, with and without prefix caching),
host memory behind the prefix cache, the byte bound, and the knobs' errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cbjax import LLM, SamplingParams
from cbjax.scheduling.host_tier import HostTier
from tests.hf_models import FAMILIES, make_hf_model, save_hf_model
from tests.tiers import sweep
from tests.internals import engine_of, pages_of, scheduler_of

MAX_SEQ_LEN = 64
NUM_SLOTS = 4


def workload(vocab: int, seed: int = 0, n: int = 10):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, size=int(k)).tolist() for k in rng.integers(6, 28, size=n)]
    max_tokens = [int(k) for k in rng.integers(16, 32, size=n)]
    priorities = [int(p) for p in rng.integers(0, 3, size=n)]
    return prompts, max_tokens, priorities


def run(llm: LLM, prompts, max_tokens, priorities, stagger: bool = True) -> tuple[list[list[int]], int]:
    """Requests arriving a few rounds apart (later ones outrank earlier ones sometimes: priority
    preemption); checks the bound on host bytes after every round. Returns the outputs in
    prompt order and the most host bytes seen."""
    ids, done, most = [], {}, 0
    host = scheduler_of(llm).host

    def step():
        nonlocal most
        done.update((o.request_id, o) for o in llm.step() if o.finished)
        if host is not None:
            stored = engine_of(llm).host_kv.stored_bytes if engine_of(llm).host_kv is not None else host.used
            assert stored == host.used <= host.capacity
            most = max(most, stored)

    for p, m, prio in zip(prompts, max_tokens, priorities):
        ids.append(llm.add_request(p, SamplingParams(max_tokens=m), priority=prio))
        for _ in range(2 if stagger else 0):
            step()
    while llm.has_unfinished_requests():
        step()
    return [done[i].token_ids for i in ids], most


def assert_drained(llm: LLM) -> None:
    assert scheduler_of(llm).free_slots == list(range(scheduler_of(llm).config.num_slots))
    if pages_of(llm) is not None:
        assert pages_of(llm).num_free == pages_of(llm).num_pages and not pages_of(llm).tables
    host = scheduler_of(llm).host
    if host is not None:
        assert not host.sequences and not engine_of(llm).host_kv.sequences  # every swapped sequence came back
        assert engine_of(llm).host_kv.stored_bytes == host.used  # what is left: prefix pages only
        assert set(engine_of(llm).host_kv.pages) == set(host.prefix)


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=sweep(sorted(FAMILIES), quick={"gpt2", "llama"}))
def family(request, tmp_path_factory):
    """A family's tiny model and the unconstrained answer (transformers' greedy tokens, which
    an engine never preempted gives too: tests/test_engine_parity.py)."""
    hf = make_hf_model(request.param)
    path = save_hf_model(hf, str(tmp_path_factory.mktemp(request.param)))
    prompts, max_tokens, priorities = workload(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    return request.param, path, (prompts, max_tokens, priorities), expected


SWAP = dict(preemption_mode="swap", host_kv_cache_bytes=1 << 24)
# Each family's mixed-step mode, in turn (a swapped-in request re-enters a mixed step as a decode row).
MERGE = {"prefill_first": dict(), "chunked": dict(merge_mode="chunked", max_num_batched_tokens=24),
         "fused": dict(merge_mode="fused", max_num_batched_tokens=40)}
CASES = {
    # A higher-priority arrival takes a running request's slot: it is swapped out and back.
    "slots-priority": dict(ordering="priority"),
    # 12 pages of 8 tokens for 4 slots of up to 64 tokens: the pool runs dry too.
    "paged-pool-prefix-priority": dict(ordering="priority", kv_cache="paged", page_size=8, num_pages=12,
                                       enable_prefix_caching=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_swapped_requests_resume_token_exact(family, case):
    name, path, (prompts, max_tokens, priorities), expected = family
    merge = sorted(MERGE)[sorted(FAMILIES).index(name) % len(MERGE)]
    options = {**CASES[case], **MERGE[merge]}
    if merge == "prefill_first" and "paged" in case:
        options["decode_steps"] = 2
    llm = LLM(path, num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN, **SWAP, **options)
    outputs, _ = run(llm, prompts, max_tokens, priorities)
    assert outputs == expected, (case, merge)
    stats = scheduler_of(llm).host.stats
    assert stats.swaps_out > 0 and stats.swaps_in == stats.swaps_out and stats.swap_fallbacks == 0
    assert_drained(llm)


def test_a_full_host_pool_falls_back_to_recompute_and_counts_it(tmp_path):
    """Four running requests, then three that outrank them at once: three victims, room in host
    memory for one or two of them; the rest recompute (counted), every output unchanged."""
    path = save_hf_model(make_hf_model("llama"), str(tmp_path / "llama"))
    reference = LLM(path, num_slots=8, max_seq_len=MAX_SEQ_LEN)
    prompts, max_tokens, _ = workload(reference.model.config.vocab_size, seed=3, n=7)
    priorities = [2] * 4 + [0] * 3
    expected, _ = run(reference, prompts, max_tokens, [0] * len(prompts), stagger=False)
    kwargs = dict(num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN, ordering="priority", preemption_mode="swap")
    sizing = scheduler_of(LLM(path, **kwargs, host_kv_cache_bytes=1 << 24)).host
    one_sequence = max(sizing.sequence_bytes(len(p) + m) for p, m in zip(prompts, max_tokens))
    llm = LLM(path, **kwargs, host_kv_cache_bytes=one_sequence + 1)
    ids = [llm.add_request(p, SamplingParams(max_tokens=m), priority=prio)
           for p, m, prio in list(zip(prompts, max_tokens, priorities))[:4]]
    done = {}
    for _ in range(6):
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    ids += [llm.add_request(p, SamplingParams(max_tokens=m), priority=prio)
            for p, m, prio in list(zip(prompts, max_tokens, priorities))[4:]]
    most = 0
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
        assert engine_of(llm).host_kv.stored_bytes == scheduler_of(llm).host.used <= one_sequence + 1
        most = max(most, scheduler_of(llm).host.used)
    assert [done[i].token_ids for i in ids] == expected
    stats = scheduler_of(llm).host.stats
    assert stats.swaps_out >= 1 and stats.swap_fallbacks >= 1
    assert stats.swaps_out + stats.swap_fallbacks == scheduler_of(llm).num_preemptions
    assert 0 < most <= one_sequence + 1
    assert_drained(llm)


def test_prefix_pages_evicted_to_host_are_loaded_back(tmp_path):
    """Conversations that come back after their pages were reused on the device: the host tier
    gives their prefix back (hits counted per tier), the outputs unchanged."""
    path = save_hf_model(make_hf_model("qwen3"), str(tmp_path / "qwen3"))
    rng = np.random.default_rng(7)
    first = [rng.integers(3, 150, size=int(n)).tolist() for n in (40, 33, 45, 38)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    # 16 pages: each turn evicts the others' pages from the device.
    kwargs = dict(num_slots=1, max_seq_len=MAX_SEQ_LEN, kv_cache="paged", page_size=8, num_pages=16,
                  enable_prefix_caching=True)
    device_only = LLM(path, **kwargs)
    tiered = LLM(path, **kwargs, host_kv_cache_bytes=1 << 24)
    outs = {}
    for name, llm in (("device", device_only), ("tiered", tiered)):
        answers = llm.generate(first, params, use_tqdm=False)
        second = [p + a.token_ids + [5, 6, 7] for p, a in zip(first, answers)]
        outs[name] = [o.token_ids for o in answers + llm.generate(second, params, use_tqdm=False)]
        assert_drained(llm) if scheduler_of(llm).host is not None else None
    assert outs["tiered"] == outs["device"]
    device_stats, tiered_stats = pages_of(device_only).stats, pages_of(tiered).stats
    assert device_stats.host_hits == 0
    assert tiered_stats.host_hits >= 16  # every second turn found its first turn's full pages
    assert tiered_stats.hits + tiered_stats.host_hits > device_stats.hits
    host = scheduler_of(tiered).host.stats
    assert host.pages_in == tiered_stats.host_hits and host.pages_out >= host.pages_in


def test_host_tier_accounting_and_lru():
    tier = HostTier(capacity=1000, page_bytes=100, sequence_bytes=lambda n: 10 * n)
    for key in range(10):
        tier.page_out(key, page=key)
    assert tier.used == 1000 and list(tier.prefix) == list(range(10))
    tier.page_out(3, page=3)  # already kept: most recently used now
    assert tier.swap_out("a", slot=0, length=25, pages=None)  # 250 bytes: three prefix pages go, LRU first
    assert list(tier.prefix)[:2] == [4, 5] and 3 in tier.prefix and tier.used == 950
    assert not tier.swap_out("b", slot=1, length=80, pages=None)  # 800 more: only 750 can be freed
    assert tier.stats.swap_fallbacks == 1 and "b" not in tier.sequences
    tier.claim_page(3)
    tier.page_in(3, page=9)
    tier.swap_in("a", slot=2, pages=None)
    assert tier.used == 600 and [op.kind for op in tier.take_ops()][-2:] == ["page_in", "seq_in"]
    with pytest.raises(ValueError, match="smaller than one page"):
        HostTier(capacity=99, page_bytes=100, sequence_bytes=lambda n: n)


@pytest.mark.parametrize("kwargs, match", [
    (dict(preemption_mode="swap"), "host_kv_cache_bytes > 0"),
    (dict(preemption_mode="swap", host_kv_cache_bytes=1 << 20, pipeline_stages=2), "pipeline"),
    (dict(host_kv_cache_bytes=1 << 20), "nothing to hold"),
    (dict(host_kv_cache_bytes=1 << 20, kv_cache="paged"), "nothing to hold"),
    (dict(preemption_mode="evict"), "preemption_mode"),
    (dict(host_kv_cache_bytes=-1, preemption_mode="swap"), "host_kv_cache_bytes"),
])
def test_bad_host_tier_settings_name_the_knob(kwargs, match):
    from cbjax.core.engine_args import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)


def test_a_host_pool_smaller_than_one_page_is_refused():
    with pytest.raises(ValueError, match="host_kv_cache_bytes=100 is smaller than one page"):
        LLM("tiny-llama", kv_cache="paged", page_size=8, enable_prefix_caching=True, host_kv_cache_bytes=100)


def test_metrics_report_hits_per_tier_and_swaps():
    from cbjax.core import Load
    from cbjax.serve.prometheus import ServerMetrics

    load = Load(running=1, prefix_queries=40, prefix_hits=10, prefix_host_hits=25, swaps_out=3, swap_fallbacks=1,
                host_kv_cache_usage=0.5)
    text = ServerMetrics("m").render(load).decode()
    assert 'cbjax:prefix_cache_hits{model_name="m",tier="device"} 10.0' in text
    assert 'cbjax:prefix_cache_hits{model_name="m",tier="host"} 25.0' in text
    assert 'cbjax:kv_swaps_out{model_name="m"} 3.0' in text and 'cbjax:kv_swap_fallbacks{model_name="m"} 1.0' in text
    assert 'cbjax:host_kv_cache_usage_perc{model_name="m"} 0.5' in text
    both = Load.combine([load, load])
    assert both.prefix_host_hits == 50 and both.host_kv_cache_usage == 0.5
    assert load.prefix_hit_rate == 0.25 and load.prefix_host_hit_rate == 0.625 and Load().prefix_hit_rate == 0.0
    paged = Load(num_pages=12, prefix_caching=True)
    assert Load.combine([paged, Load()]) == Load(num_pages=12, prefix_caching=True)


def test_a_fronts_load_names_its_page_pool():
    """What studies read of the page pool comes through `load()`, not the pool itself."""
    from cbjax import LLM

    paged = LLM("tiny-llama", num_slots=2, max_seq_len=32, kv_cache="paged", page_size=8, num_pages=9,
                enable_prefix_caching=True).load()
    slots = LLM("tiny-llama", num_slots=2, max_seq_len=32).load()
    assert (paged.num_pages, paged.prefix_caching) == (9, True)
    assert (slots.num_pages, slots.prefix_caching) == (0, False)


def test_the_simulator_charges_swaps_and_host_pages_over_the_host_link():
    """The same scheduler and host tier on the simulator: the swapped requests come back with
    their counters (every output its full length), and the moves cost simulated time."""
    prompts, max_tokens, priorities = workload(500, seed=4, n=12)
    kwargs = dict(num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN, kv_cache="paged", page_size=8, num_pages=12,
                  ordering="priority", enable_prefix_caching=True)
    swap = LLM("tiny-llama", simulate="h100", preemption_mode="swap", host_kv_cache_bytes=1 << 24, **kwargs)
    outputs, _ = run(swap, prompts, max_tokens, priorities)
    assert [len(o) for o in outputs] == max_tokens  # fillers never stop early
    stats = scheduler_of(swap).host.stats
    assert stats.swaps_out > 0 and stats.swaps_in == stats.swaps_out and engine_of(swap).host_s > 0
    assert not engine_of(swap).swapped
    assert pages_of(swap).num_free == pages_of(swap).num_pages
    # Disaggregated: the prefill instances keep the host tier behind their prefix caches.
    split = LLM("tiny-llama", simulate="h100", prefill_instances=1, decode_instances=1, kv_cache="paged",
                enable_prefix_caching=True, host_kv_cache_bytes=1 << 24, max_seq_len=MAX_SEQ_LEN)
    assert [len(o.token_ids) for o in split.generate(prompts[:3], SamplingParams(max_tokens=4, ignore_eos=True),
                                                     use_tqdm=False)] == [4, 4, 4]


def test_paged_swaps_without_prefix_caching_under_pool_pressure(tmp_path):
    """The page pool alone forces the preemptions (fcfs, no prefix cache): swapped requests come
    back token-exact into fresh pages."""
    hf = make_hf_model("llama")
    path = save_hf_model(hf, str(tmp_path / "llama"))
    prompts, max_tokens, _ = workload(hf.config.vocab_size, seed=11)
    expected = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    llm = LLM(path, num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN, kv_cache="paged", page_size=8, num_pages=12,
              decode_steps=2, **SWAP)
    outputs, _ = run(llm, prompts, max_tokens, [0] * len(prompts))
    assert outputs == expected
    assert scheduler_of(llm).host.stats.swaps_out > 0 and scheduler_of(llm).host.stats.swap_fallbacks == 0
    assert_drained(llm)
