"""Request traces as workloads (cbjax/traces.py): the shipped files read whole, windows,
time and length scaling, caps, shared prefixes from Mooncake's hash ids (and the prefix
cache's hits on them), and clear errors for bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.traces import TRACES, block_reuse, read_trace, select, trace_workload
from tests.internals import pages_of

ROWS = {"azure_code": 8819, "azure_conv": 19366, "mooncake": 12031, "mooncake_synthetic": 3993}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_shipped_traces_read_whole_in_arrival_order(name):
    records = read_trace(name)
    assert len(records) == ROWS[name]
    arrivals = np.array([r.arrival for r in records])
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    assert 900 < arrivals[-1] < 3700  # about an hour (Mooncake's synthetic: about 17 minutes)
    assert all(r.prompt_len >= 0 and r.output_len >= 0 for r in records)
    if name.startswith("mooncake"):  # one hash id per 512-token block
        assert all(len(r.blocks) == -(-r.prompt_len // 512) for r in records)
        assert 0 < block_reuse(records) < 1
    else:
        assert block_reuse(records) == 0


def test_azure_times_keep_their_sub_second_digits():
    # The first two requests of the code trace: 18:17:03.9799600 and 18:17:04.0319600.
    first, second = read_trace("azure_code")[:2]
    assert second.arrival - first.arrival == pytest.approx(0.052, abs=1e-6)
    assert (first.prompt_len, first.output_len) == (4808, 10)


def test_window_scaling_and_caps():
    records = read_trace("azure_conv")
    window = select(records, start_s=600, window_s=60)
    assert window and all(0 <= r.arrival < 60 for r in window)
    assert len(window) == sum(600 <= r.arrival < 660 for r in records)
    work = trace_workload("azure_conv", vocab_size=100, start_s=600, window_s=60, length_scale=0.1, max_len=64,
                          max_output_len=16)
    assert len(work) == len(window)
    for w, r in zip(work, window):
        assert w.arrival == pytest.approx(r.arrival)
        assert len(w.prompt) == min(max(1, round(r.prompt_len * 0.1)), 63)
        assert 1 <= w.sampling.max_tokens <= min(16, 64 - len(w.prompt)) and w.sampling.ignore_eos
        assert all(3 <= t < 100 for t in w.prompt)
    faster = trace_workload("azure_conv", vocab_size=100, start_s=600, window_s=60, time_scale=0.5)
    assert [f.arrival for f in faster] == pytest.approx([w.arrival * 0.5 for w in work])
    paced = trace_workload("azure_conv", vocab_size=100, num_requests=201, rate=4.0)
    assert paced[-1].arrival == pytest.approx(200 / 4.0)
    assert all(w.arrival == 0 for w in trace_workload("mooncake", vocab_size=100, num_requests=5, all_at_once=True))


def test_shared_hash_ids_are_shared_prefixes():
    records = select(read_trace("mooncake"), num_requests=30)
    work = trace_workload("mooncake", vocab_size=1000, num_requests=30, length_scale=1 / 32)  # blocks of 16
    for i, (r, w) in enumerate(zip(records, work)):
        for j in range(i):
            common = 0
            while common < min(len(r.blocks), len(records[j].blocks)) and r.blocks[common] == records[j].blocks[common]:
                common += 1
            shared = min(common * 16, len(w.prompt), len(work[j].prompt))
            assert w.prompt[:shared] == work[j].prompt[:shared]
            if common < min(len(r.blocks), len(records[j].blocks)) and len(w.prompt) > 16 * (common + 1) \
                    and len(work[j].prompt) > 16 * (common + 1):
                assert w.prompt[16 * common:16 * (common + 1)] != work[j].prompt[16 * common:16 * (common + 1)]


def test_prefix_cache_hits_what_the_trace_shares():
    """Mooncake's first requests one at a time through a paged engine with prefix caching:
    the pages it finds cached are the pages of blocks an earlier request had (less at most
    one page per request: the last prompt token is always computed)."""
    n, block, page = 40, 16, 8
    records = select(read_trace("mooncake"), num_requests=n)
    work = trace_workload("mooncake", vocab_size=500, num_requests=n, length_scale=block / 512, max_len=384,
                          max_output_len=4)
    llm = LLM("tiny-llama", num_slots=2, max_seq_len=384, kv_cache="paged", page_size=page,
              num_pages=n * 384 // page, enable_prefix_caching=True)
    seen, expected = set(), 0
    for r, w in zip(records, work):
        leading = 0
        while leading < len(r.blocks) and r.blocks[leading] in seen:
            leading += 1
        expected += min(leading * block, len(w.prompt)) // page
        seen.update(r.blocks)
        llm.generate([w.prompt], SamplingParams(max_tokens=w.sampling.max_tokens, ignore_eos=True), use_tqdm=False)
    hits = pages_of(llm).stats.hits
    assert expected > n  # the window does share prefixes
    assert expected - n <= hits <= expected


@pytest.mark.parametrize("content, message", [
    ("a,b\n1,2\n", "missing columns"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,12,x\n", ":2"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
])
def test_bad_trace_files_are_refused_clearly(tmp_path, content, message):
    path = tmp_path / "trace.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_trace(str(path))


def test_bad_jsonl_and_names_are_refused(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 2}) + "\n{\"timestamp\": 1}\n")
    with pytest.raises(ValueError, match=":2: not a Mooncake trace line"):
        read_trace(str(path))
    with pytest.raises(ValueError, match="unknown trace"):
        read_trace("sharegpt-but-misspelt")
    with pytest.raises(ValueError, match="no trace request"):
        select(read_trace("mooncake_synthetic"), start_s=10 ** 6)
    with pytest.raises(ValueError, match="positive"):
        trace_workload("mooncake", vocab_size=10, length_scale=0)


# ------------------------------------------------------------------ ShareGPT
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.hf_models import save_byte_level_tokenizer

    return save_byte_level_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=400)


def test_sharegpt_conversations_read_up_to_the_packages_cut():
    from cbjax.traces import sharegpt_conversations

    pairs = sharegpt_conversations()
    assert len(pairs) > 10_000 and all(isinstance(h, str) and isinstance(r, str) for h, r in pairs[:100])


def test_sharegpt_workload_takes_prompts_and_reply_lengths(tokenizer):
    from cbjax.traces import sharegpt_conversations, sharegpt_workload

    pairs = {tuple(tokenizer.encode(h, add_special_tokens=False)): r for h, r in sharegpt_conversations()[:3000]}
    work = sharegpt_workload(30, vocab_size=400, tokenizer=tokenizer, qps=5.0, max_len=1024, max_output_len=200,
                             seed=4)
    assert len(work) == 30 and np.all(np.diff([w.arrival for w in work]) >= 0) and work[-1].arrival > 0
    matched = 0
    for w in work:
        assert 4 <= len(w.prompt) < 1024 and 1 <= w.sampling.max_tokens <= min(200, 1024 - len(w.prompt))
        reply = pairs.get(tuple(w.prompt))
        if reply is not None:  # a prompt among the first 3000: its output is the reply's length
            matched += 1
            assert w.sampling.max_tokens == min(len(tokenizer.encode(reply, add_special_tokens=False)), 200,
                                                1024 - len(w.prompt))
    assert matched > 0
    blind = sharegpt_workload(30, vocab_size=400, qps=5.0, max_len=1024, seed=4)  # no tokenizer: ~4 chars a token
    assert len(blind) == 30 and all(4 <= len(w.prompt) < 1024 for w in blind)
    with pytest.raises(ValueError, match="fit"):
        sharegpt_workload(10 ** 6, vocab_size=400)


def test_trace_prompts_in_sharegpt_text_keep_lengths_and_shared_blocks(tokenizer):
    work = trace_workload("mooncake", vocab_size=400, tokenizer=tokenizer, num_requests=10, length_scale=1 / 32,
                          max_len=512)
    records = select(read_trace("mooncake"), num_requests=10)
    for w, r in zip(work, records):
        assert len(w.prompt) == min(max(1, round(r.prompt_len / 32)), 511)
    assert records[0].blocks[0] == records[1].blocks[0]  # both open with the same block
    assert work[0].prompt[:16] == work[1].prompt[:16]
    from cbjax.traces import TextTokens, sharegpt_conversations

    first_turn = sharegpt_conversations()[TextTokens(tokenizer, seed=0).order[0]][0]
    assert work[0].prompt[:16] == tokenizer.encode(first_turn, add_special_tokens=False)[:16]  # ShareGPT's text
