"""Prefill/decode disaggregation on 8 host CPU devices (tests/conftest.py): prefill and decode
instances on disjoint device groups, tensor parallel inside a group, each request's KV
moved between them; greedy outputs equal transformers', every array's devices asserted,
and no page or slot left held after aborts, decode-side preemption or a failed move."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.runtime import kv_transfer
from tests.test_scale_out import MAX_TOKENS, gqa  # noqa: F401 (the shared fixture)
from tests.tiers import slow, sweep

OPTIONS = dict(num_slots=4, max_seq_len=64, page_size=8)
SAMPLING = SamplingParams(max_tokens=MAX_TOKENS)


def _groups(llm) -> list[set]:
    """Each instance's device set, from its params, asserted to hold its cache and state too."""
    sets = []
    for core in llm.core.cores:
        devices = core.engine.params["embed"].sharding.device_set
        for leaf in jax.tree.leaves(core.engine.cache) + jax.tree.leaves(core.engine.state):
            assert leaf.sharding.device_set == devices
        sets.append(frozenset(devices))
    return sets


def _assert_nothing_held(llm) -> None:
    for core in llm.core.cores:
        assert all(r is None for r in core.scheduler.slots)
        assert not core.scheduler.waiting
        if core.pages is not None:
            assert core.pages.num_free == core.pages.num_pages and not core.pages.tables
        assert not np.asarray(core.engine.state.active).any()
    assert not llm.core.owner and not llm.requests


def _forbid_prefill(llm) -> None:
    """The decode instances' engines refuse any prefill program (a round asks for its plan's
    prefill rows, none on a decode instance)."""
    def guard(engine):
        run = engine.run

        def refuse(rows, *args, **kwargs):
            if any(not r.is_decode for r in rows):
                raise AssertionError("a decode instance ran a prefill program")
            return run(rows, *args, **kwargs)
        return refuse

    for core in llm.core.decode:
        core.engine.run = guard(core.engine)


def _run_in_random_order(llm, prompts, seed: int) -> dict[str, list[int]]:
    """Requests added in a random order, a few rounds apart, while earlier ones run."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompts))
    ids, outputs = {}, {}
    for k, i in enumerate(order):
        ids[llm.add_request(prompts[i], SAMPLING)] = i
        for _ in range(int(rng.integers(0, 3))):
            outputs.update((o.request_id, o) for o in llm.step() if o.finished)
    outputs.update((o.request_id, o) for o in llm.run_until_done())
    assert not [o.error for o in outputs.values() if o.error]
    return {ids[rid]: o.token_ids for rid, o in outputs.items()}


@pytest.mark.parametrize("split,kv_cache", sweep([((1, 2, 1, 2), "slots"), ((1, 1, 3, 1), "paged"),
                                                  ((2, 1, 1, 2), "paged"), ((1, 2, 2, 1), "slots")],
                                                 quick={((1, 1, 3, 1), "paged"), ((1, 2, 2, 1), "slots")}))
def test_disaggregated_greedy_equals_transformers(gqa, monkeypatch, split, kv_cache):  # noqa: F811
    """(prefill instances, devices each, decode instances, devices each)."""
    model, _, prompts, expected = gqa
    p, tp_p, d, tp_d = split
    moved_to = []
    real_move = kv_transfer.move

    def move(seq, engine):
        out = real_move(seq, engine)
        moved_to.append(({frozenset(a.sharding.device_set) for a in jax.tree.leaves(out)},
                         frozenset(engine.params["embed"].sharding.device_set)))
        return out

    monkeypatch.setattr(kv_transfer, "move", move)
    llm = LLM(model, prefill_instances=p, prefill_tensor_parallel=tp_p, decode_instances=d,
              decode_tensor_parallel=tp_d, kv_cache=kv_cache, **OPTIONS)
    try:
        _forbid_prefill(llm)
        got = _run_in_random_order(llm, prompts, seed=sum(split))
        assert [got[i] for i in range(len(prompts))] == expected
        groups = _groups(llm)
        sizes = [tp_p] * p + [tp_d] * d
        assert [len(g) for g in groups] == sizes
        assert len(set().union(*groups)) == sum(sizes)  # disjoint groups
        assert set().union(*groups) == set(jax.devices()[:sum(sizes)])
        assert moved_to and all(sets == {target} for sets, target in moved_to)
        assert all(target in groups[p:] for _, target in moved_to)
        assert llm.core.transfers.moved == len(moved_to) == sum(len(e) > 1 for e in expected)
        assert all(c.stats.prefill_chunks == 0 for c in llm.core.decode)
        assert all(c.stats.decode_steps == 0 for c in llm.core.prefill)
        _assert_nothing_held(llm)
    finally:
        llm.core.close()


def test_decode_side_preemption_recomputes_on_a_prefill_instance(gqa):  # noqa: F811
    """Few pages: decode instances preempt, the prefill side recomputes, outputs unchanged."""
    model, _, prompts, expected = gqa
    llm = LLM(model, prefill_instances=1, decode_instances=1, kv_cache="paged", num_pages=12,
              **{**OPTIONS, "num_slots": 6})
    try:
        _forbid_prefill(llm)
        got = [o.token_ids for o in llm.generate(prompts, SAMPLING, use_tqdm=False)]
        assert got == expected
        assert llm.core.decode[0].scheduler.num_preemptions > 0
        assert llm.core.transfers.moved > sum(len(e) > 1 for e in expected)  # moved again after recompute
        _assert_nothing_held(llm)
    finally:
        llm.core.close()


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_aborts_and_a_failed_move_leave_nothing_held(gqa, monkeypatch, kv_cache):  # noqa: F811
    model, _, prompts, expected = gqa
    llm = LLM(model, prefill_instances=1, decode_instances=1, decode_tensor_parallel=2, kv_cache=kv_cache,
              **OPTIONS)
    real_move, failing = kv_transfer.move, {"left": 1}

    def flaky_move(seq, engine):
        if failing["left"]:
            failing["left"] -= 1
            raise RuntimeError("link down")
        return real_move(seq, engine)

    monkeypatch.setattr(kv_transfer, "move", flaky_move)
    try:
        ids = [llm.add_request(p, SAMPLING) for p in prompts]
        outputs = {}
        for _ in range(3):
            outputs.update((o.request_id, o) for o in llm.step() if o.finished)
        places = {rid: ("decode" if llm.core.owner.get(rid) in llm.core.decode else "prefill")
                  for rid in ids if rid in llm.core.owner}
        aborted = [next(r for r in ids if places.get(r) == side) for side in ("decode", "prefill")]
        for rid in aborted:
            outputs[rid] = llm.abort(rid)
        outputs.update((o.request_id, o) for o in llm.run_until_done())
        failed = [rid for rid in ids if outputs[rid].finish_reason == "error"]
        assert len(failed) == 1 and "KV transfer" in outputs[failed[0]].error and llm.core.transfers.failed == 1
        assert all(outputs[rid].finish_reason == "abort" for rid in aborted)
        for i, rid in enumerate(ids):
            if rid not in aborted and rid not in failed:
                assert outputs[rid].token_ids == expected[i]
        _assert_nothing_held(llm)
    finally:
        llm.core.close()


def test_disaggregation_rejects_what_it_cannot_run(gqa):  # noqa: F811
    model = gqa[0]
    with pytest.raises(ValueError, match="merge_mode=prefill_first"):
        LLM(model, prefill_instances=1, merge_mode="chunked", **OPTIONS)
    with pytest.raises(ValueError, match="devices needs 10"):
        LLM(model, prefill_instances=2, prefill_tensor_parallel=4, decode_instances=1, decode_tensor_parallel=2,
            **OPTIONS)
    with pytest.raises(ValueError, match="kv_link is simulated only"):
        LLM(model, prefill_instances=1, kv_link="pcie4", **OPTIONS)
    with pytest.raises(ValueError, match="kv_link"):
        LLM(model, prefill_instances=1, kv_link="carrier-pigeon", **OPTIONS)


def test_simulated_disaggregation_shares_one_clock_and_keeps_decodes_steady():
    """At GPU scale (simulated H100, Llama-3-8B shape): long prompts arriving beside running
    decodes stall the colocated engine's decodes, not the disaggregated decode instance's;
    the move costs the modelled link time. Gaps are counted from the second token on: the
    first gap of a disaggregated request is its hand-over (the move, and the wait for a
    decode slot when the prefills outpace the decodes), not a stall of running decodes."""
    workload = [(0.05 * i, [1] * (1800 if i % 2 else 50), SamplingParams(max_tokens=64, ignore_eos=True))
                for i in range(24)]

    def worst_gap(llm) -> float:
        outs = llm.replay(workload, use_tqdm=False)
        assert all(len(o.token_ids) == 64 for o in outs)
        return max(float(np.diff(o.metrics.token_times)[1:].max()) for o in outs)

    colocated = LLM("llama3-8b", simulate="h100", num_slots=16, max_seq_len=2048)
    split = LLM("llama3-8b", simulate="h100", prefill_instances=1, decode_instances=1, num_slots=16,
                max_seq_len=2048)
    gap_colocated, gap_split = worst_gap(colocated), worst_gap(split)
    assert gap_split < 0.5 * gap_colocated
    transfers = split.core.transfers
    assert transfers.moved == 24 and transfers.bytes == 12 * (1800 + 50) * split.core.kv_bytes_per_token
    seconds, _ = disaggregation_cost(split)
    assert transfers.seconds == pytest.approx(12 * (seconds(1800) + seconds(50)))
    lanes = [c.clock() for c in split.core.cores]
    assert split.clock() == max(lanes) and min(lanes) > 0  # both instances ran, on one shared clock


def disaggregation_cost(llm):
    from cbjax import simulator

    return simulator.kv_transfer_cost(llm.core.decode[0].engine.cost, llm.model.config, "bfloat16")



@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
@slow
def test_prefill_and_decode_in_two_processes(gqa, kv_cache):  # noqa: F811
    """Prefill in one process, decode in the other (2 host devices each, tensor parallel
    inside): the KV crosses through JAX's transfer server and outputs equal transformers'."""
    import json
    import os
    import subprocess
    import sys

    from tests.test_scale_out import ROOT, _free_port

    _, path, prompts, expected = gqa
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    port = _free_port()
    script = os.path.join(ROOT, "tests", "disaggregated_process.py")
    procs = [subprocess.Popen([sys.executable, script, role, path, str(port), json.dumps(prompts), kv_cache],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ("decode", "prefill")]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = {}
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
        results.update(json.loads(next(line for line in log.splitlines() if line.startswith("RESULT "))[7:]))
    assert [results[str(i)] for i in range(len(prompts))] == expected


def test_simulated_replicas_share_one_clock():
    """One simulated replica is exactly one simulated LLM; two overlap in simulated time."""
    from cbjax.parallel.replicas import Replicas

    workload = [(0.05 * i, [1] * (1800 if i % 2 else 50), SamplingParams(max_tokens=64, ignore_eos=True))
                for i in range(16)]
    options = dict(num_slots=16, max_seq_len=2048)
    single = LLM("llama3-8b", simulate="h100", **options).replay(workload, use_tqdm=False)
    one = Replicas("llama3-8b", data_parallel=1, simulate="h100", **options).replay(workload, use_tqdm=False)
    assert [o.metrics.token_times for o in one] == [o.metrics.token_times for o in single]
    two = Replicas("llama3-8b", data_parallel=2, simulate="h100", routing="least_loaded", **options)
    outs = two.replay(workload, use_tqdm=False)
    lanes = [r.clock() for r in two.replicas]
    assert two.clock() == max(lanes) and min(lanes) > 0 and sum(two.routed) == 16
    assert max(o.metrics.finish_time for o in outs) < max(o.metrics.finish_time for o in single)


def test_disaggregation_experiment_writes_table_json_and_plot(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tests.test_scale_out import ROOT

    out = tmp_path / "dis"
    proc = subprocess.run([sys.executable, "-m", "experiments", "disaggregation", "--num_devices=2",
                           "--rates_per_device=2,8", "--num_requests=24", "--prompt_low=512", "--prompt_high=1024",
                           "--output_low=16", "--output_high=32", "--max_seq_len=2048", f"--output_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "disaggregation.json").read_text())
    assert {r["config"] for r in result["goodput_req_s"]} == {
        "colocated-prefill_first x2", "colocated-chunked x2", "disaggregated 1P:1D"}
    assert all(len(runs) == 2 and 0 <= runs[0]["attainment"]["tight"] <= 1 for runs in result["runs"].values())
    assert (out / "disaggregation.png").stat().st_size > 0 and "| 2 | disaggregated 1P:1D |" in proc.stdout
