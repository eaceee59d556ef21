"""The scheduling simulator: its engine mirrors the device's state call for call, it
schedules exactly as the real engine does, its cost models fit and load, and the
experiment scripts run under --simulate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cbjax import LLM
from cbjax.simulator import ACCELERATORS, MODEL_SHAPES, CalibratedCost, Call, RooflineCost
from cbjax.simulator.hardware import gemm_inner_dim, kv_bytes_per_token, matmul_params, weight_bytes
from cbjax.simulator.profile import profile_rounds
from cbjax.workload import LengthDist, synthetic
from tests.internals import engine_of, scheduler_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _work(n, seed=0, max_prompt=40, cap=30, vocab=512):
    return synthetic(n, prompt_len=LengthDist("uniform", low=3, high=max_prompt),
                     output_len=LengthDist("capped_exponential", mean=cap / 3, cap=cap), vocab_size=vocab, seed=seed)


CONFIGS = {
    "slots continuous": dict(num_slots=4),
    "slots static": dict(num_slots=4, policy="static", batch_size=4),
    "paged, prefix cache, preempting pool": dict(num_slots=6, kv_cache="paged", page_size=8, num_pages=14,
                                                 enable_prefix_caching=True),
    "chunked mixed steps": dict(num_slots=4, merge_mode="chunked", max_num_batched_tokens=16),
    "fused mixed steps": dict(num_slots=4, merge_mode="fused"),
    "3 decode steps per call, chunked prefill": dict(num_slots=4, decode_steps=3, max_prefill_tokens=16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_simulated_engine_answers_as_the_device_does(name):
    """Every call goes to the device and to the simulated engine; their done flags and
    active slots must agree (profile_rounds raises on the first difference)."""
    llm = LLM("tiny-llama", max_seq_len=64, **CONFIGS[name])
    work = _work(16, seed=len(name))
    rounds = profile_rounds(llm, [(w.prompt, w.sampling) for w in work])
    kinds = {c.kind for calls, _ in rounds for c in calls}
    # A step is charged by what it holds: prompt rows, decode rows, or both ("mixed", which
    # only the fused and chunked modes make).
    assert "mixed" in kinds if "mixed" in name else kinds == {"prefill", "decode"}
    if "preempting" in name:
        assert scheduler_of(llm).num_preemptions > 0
    assert not llm.requests


@pytest.mark.parametrize("options", [dict(num_slots=4), dict(num_slots=6, kv_cache="paged", page_size=8,
                                                               num_pages=12),
                                     dict(num_slots=4, merge_mode="chunked", max_num_batched_tokens=12)])
def test_a_simulated_llm_schedules_like_the_real_one(options):
    work = _work(16, seed=3)
    prompts, params = [w.prompt for w in work], [w.sampling for w in work]
    real = LLM("tiny-llama", max_seq_len=64, **options)
    sim = LLM("tiny-llama", max_seq_len=64, simulate="h100", **options)
    real_out = real.generate(prompts, params, use_tqdm=False)
    sim_out = sim.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in sim_out] == [len(o.token_ids) for o in real_out]
    assert [o.finish_reason for o in sim_out] == [o.finish_reason for o in real_out]
    assert sim.stats.rounds == real.stats.rounds and sim.stats.decode_steps == real.stats.decode_steps
    assert scheduler_of(sim).num_preemptions == scheduler_of(real).num_preemptions
    assert sim.clock() == pytest.approx(engine_of(sim).busy_s) and sim.clock() > 0


def test_simulated_time_jumps_over_idle_gaps():
    """Sparse Poisson arrivals: the simulated clock jumps to each arrival instead of
    stepping through the gaps, and a request's latency is only its own work."""
    llm = LLM("opt-13b", simulate="h100", num_slots=8, max_seq_len=1024, dtype="bfloat16", policy="dynamic",
              window_ms=200)
    work = synthetic(50, prompt_len=LengthDist("fixed", value=100), output_len=LengthDist("fixed", value=20),
                     vocab_size=50272, arrival="poisson", qps=0.01)
    outs = llm.replay([w.as_tuple() for w in work], use_tqdm=False)
    assert llm.clock() > work[-1].arrival
    e2e = [o.metrics.e2e_latency for o in outs]
    assert all(0 < t < 2.0 for t in e2e)  # the 200 ms window (when alone), then ~20 decode steps of ~10 ms
    assert np.median(e2e) > 0.2


def test_roofline_is_memory_bound_in_decode_and_compute_bound_in_prefill():
    opt = MODEL_SHAPES["opt-13b"]
    h100 = RooflineCost(ACCELERATORS["h100"], opt)
    e = ACCELERATORS["h100"].efficiency
    assert weight_bytes(opt, 2) == pytest.approx(25.7e9, rel=0.02)
    assert kv_bytes_per_token(opt, 2) == 819200  # the study's "nearly 1 MB per token"

    def decode(batch):
        return h100.seconds(Call("decode", tokens=batch, attended=batch * 512, kv_read=batch * 512, rows=batch))

    memory = (weight_bytes(opt, 2) + 819200 * 512) / (3.35e12 * e.bandwidth)
    inner = gemm_inner_dim(opt) / (gemm_inner_dim(opt) + e.half_inner)  # the matmuls' share of peak at their K
    compute = (2 * matmul_params(opt) / inner + 4 * 40 * 40 * 128 * 512) / (989e12 * e.compute / (1 + e.half_tokens))
    assert decode(1) == pytest.approx(memory + (1 - e.overlap) * compute + e.pass_overhead_s + e.request_overhead_s,
                                      rel=1e-9)
    assert decode(16) / decode(1) < 1.5  # reading the weights dominates
    prefill = h100.seconds(Call("prefill", tokens=4096, attended=4096 * 4097 // 2, kv_read=0, rows=8))
    flops = 2 * matmul_params(opt) * 4096 / inner + 4 * 40 * 40 * 128 * 4096 * 4097 // 2  # matmuls + causal attention
    compute = flops / (989e12 * e.compute * 4096 / (4096 + e.half_tokens))
    assert compute > 10 * weight_bytes(opt, 2) / 3.35e12
    assert prefill == pytest.approx(compute + (1 - e.overlap) * weight_bytes(opt, 2) / (3.35e12 * e.bandwidth)
                                    + e.pass_overhead_s + 8 * e.request_overhead_s + e.prefill_overhead_s, rel=1e-9)
    a100 = RooflineCost(ACCELERATORS["a100-40gb"], opt)
    assert a100.seconds(Call("decode", 8, 8 * 512, 8 * 512, 8)) > decode(8)
    assert 9e9 < ACCELERATORS["a100-40gb"].kv_budget(weight_bytes(opt, 2), reserve_fraction=0.1) < 13e9


def test_calibration_fit_recovers_known_costs_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    truth = {"prefill": dict(steps=2e-3, tokens=1e-5, attended=2e-9, kv_read=0.0, rows=1e-4),
             "decode": dict(steps=5e-3, tokens=2e-4, attended=1e-8, kv_read=0.0, rows=5e-5),
             "mixed": dict(steps=4e-3, tokens=3e-5, attended=3e-9, kv_read=0.0, rows=2e-5)}
    exact = CalibratedCost(truth)
    rounds = []
    for _ in range(400):
        slots, kv, bucket = rng.choice([4, 8, 16, 32]), rng.choice([32, 64, 128, 256]), rng.choice([16, 32, 64])
        calls = [Call("decode", tokens=slots, attended=slots * kv, kv_read=slots * kv, rows=rng.integers(1, slots + 1))]
        if rng.random() < 0.4:
            calls.append(Call("prefill", tokens=bucket * 2, attended=bucket * 2 * kv, kv_read=2 * kv, rows=2))
        if rng.random() < 0.3:
            t = int(rng.choice([32, 64, 128]))
            calls = [Call("mixed", tokens=t, attended=t * kv, kv_read=t * kv, rows=int(rng.integers(1, 9)))]
        seconds = sum(exact.seconds(c) for c in calls) * (1 + 0.02 * rng.standard_normal())
        rounds.append((calls, seconds))
    fitted = CalibratedCost.fit(rounds)
    assert fitted.info["fit"]["median_abs_rel_error"] < 0.03
    for calls, seconds in rounds[:50]:
        assert sum(fitted.seconds(c) for c in calls) == pytest.approx(seconds, rel=0.1)
    path = str(tmp_path / "cost.json")
    fitted.save(path)
    loaded = CalibratedCost.load(path)
    assert loaded.coefficients == fitted.coefficients
    (tmp_path / "broken.json").write_text('{"coefficients": {"prefill": {}}}')
    with pytest.raises(ValueError, match="not a calibration file"):
        CalibratedCost.load(str(tmp_path / "broken.json"))
    with pytest.raises(ValueError, match="accelerator"):
        LLM("tiny-llama", simulate="gtx-480")


def test_calibrated_simulation_charges_the_real_engines_calls():
    """Calibrate on one profile, then simulate another workload: the simulated time is exactly
    the fitted cost of the calls the real engine makes for it (the same plan, charged). How
    close that time comes to the wall clock is a measurement, not a pass/fail check:
    experiments/studies/validate_simulator.py prints it for SmolLM2 (docs/simulator.md)."""
    rounds = []
    for slots in (2, 8):
        llm = LLM("tiny-llama", num_slots=slots, max_seq_len=64)
        profile = [(w.prompt, w.sampling) for w in _work(32, seed=slots, max_prompt=30, cap=30)]
        first, second = profile_rounds(llm, profile), profile_rounds(llm, profile)
        assert [calls for calls, _ in first] == [calls for calls, _ in second]
        rounds += [(calls, min(a, b)) for (calls, a), (_, b) in zip(first, second)]
    cost = CalibratedCost.fit(rounds)
    work = _work(48, seed=99, max_prompt=28, cap=32)
    real = profile_rounds(LLM("tiny-llama", num_slots=6, max_seq_len=64), [(w.prompt, w.sampling) for w in work])
    sim = LLM("tiny-llama", num_slots=6, max_seq_len=64, simulate=cost)
    sim.generate([w.prompt for w in work], [w.sampling for w in work], use_tqdm=False)
    charged = sum(cost.seconds(call) for calls, _ in real for call in calls)
    assert sim.stats.rounds == len(real) and charged > 0
    assert sim.clock() == pytest.approx(charged, rel=1e-9)


def _run_script(name, *args):
    proc = subprocess.run([sys.executable, "-m", "experiments", name.removesuffix(".py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_experiments_run_under_simulate(tmp_path):
    _run_script("compare_batching.py", "--simulate=a100-40gb", "--model=opt-13b", "--dtype=bfloat16",
                "--prompt_len=512", "--max_gen_lens=32,512", "--output_mean=128", "--num_requests=64",
                "--kv_cache_bytes=12000000000", "--paged_attention=pallas", f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "compare_batching.json").read_text())
    rows = result["columns"][-1]["rows"]
    assert set(rows) == {"static", "dynamic", "continuous", "continuous-paged"}
    assert rows["continuous-paged"]["tokens_per_s"] > rows["continuous"]["tokens_per_s"] > rows["static"]["tokens_per_s"]
    _run_script("latency_sweep.py", "--simulate=h100", "--model=llama3-8b", "--dtype=bfloat16", "--qps=2,8",
                "--num_requests=40", "--policies=static,continuous,continuous-paged", "--max_seq_len=512",
                f"--output_dir={tmp_path}")
    sweep = json.loads((tmp_path / "latency_sweep.json").read_text())
    assert set(sweep["results"]) == {f"{p}@{q}" for p in ("static", "continuous", "continuous-paged") for q in (2, 8)}
    assert all(r["completed"] == 40 for r in sweep["results"].values())
    proc = subprocess.run([sys.executable, "-m", "experiments", "latency_sweep", "--simulate=warp-drive"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Flags parsing error" in proc.stderr and "simulate" in proc.stderr


def test_profiles_and_held_out_sjf_run_under_simulate(tmp_path):
    """profiles.py names a winner per profile with its margin; latency_sweep replays a length
    predictor's held-out trace with FCFS, oracle SJF and predicted SJF (recorded predictions)."""
    _run_script("profiles.py", "--simulate=h100", "--model=llama3-8b", "--dtype=bfloat16", "--num_requests=40",
                "--scale=0.25", "--num_slots=8", "--chat_qps=20", "--creative_qps=4", "--budgets=256",
                f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "profiles.json").read_text())
    assert set(result["results"]) == {"reading", "chat", "creative"}
    for name, r in result["results"].items():
        assert r["winner"] in r["rows"] and "default" in r["rows"]
        assert r["rows"]["default"]["vs_default"] == 1.0
        objective = [m[r["objective"]] for m in r["rows"].values()]
        best = max(objective) if r["objective"] == "output_throughput" else min(objective)
        assert r["rows"][r["winner"]][r["objective"]] == best
        assert r["margin_vs_default"] == r["rows"][r["winner"]]["vs_default"]
    assert "prefix_cache" in result["results"]["reading"]["rows"]
    assert (tmp_path / "profiles.png").is_file()

    trace = tmp_path / "predictor"
    trace.mkdir()
    rng = np.random.default_rng(0)
    pairs = [{"prompt_token_ids": rng.integers(3, 1000, size=int(k)).tolist(), "output_len": int(n)}
             for k, n in zip(rng.integers(8, 64, size=30), rng.integers(1, 200, size=30))]
    (trace / "data.json").write_text(json.dumps({"pairs": pairs}))
    (trace / "held_out.json").write_text(json.dumps({"data": "data.json", "indices": list(range(0, 30, 2)),
                                                     "predicted": [float(p["output_len"]) for p in pairs[::2]]}))
    _run_script("latency_sweep.py", "--simulate=h100", "--model=llama3-8b", "--dtype=bfloat16", "--qps=4",
                "--workload=held_out", f"--trace={trace}", "--num_requests=15", "--max_seq_len=512",
                "--policies=continuous,continuous-sjf,continuous-sjf-predicted", "--num_slots=2",
                f"--output_dir={tmp_path}")
    sweep = json.loads((tmp_path / "latency_sweep.json").read_text())
    assert all(r["completed"] == 15 for r in sweep["results"].values())
    # Predictions equal to the truth: predicted SJF schedules exactly as oracle SJF.
    assert sweep["results"]["continuous-sjf-predicted@4"]["median_e2el_ms"] == pytest.approx(
        sweep["results"]["continuous-sjf@4"]["median_e2el_ms"])
