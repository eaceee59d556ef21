"""Smoke runs of the experiment scripts on a tiny preset: they run, and write JSON and a plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_compare_batching_writes_table_json_and_plot(tmp_path):
    run_script("compare_batching.py", "--model=tiny-llama", "--max_gen_lens=32", "--num_requests=8",
               "--num_slots=2", "--prompt_len=8", f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "compare_batching.json").read_text())
    assert [c["max_gen_len"] for c in result["columns"]] == [32]
    for column in result["columns"]:
        assert set(column["rows"]) == {"static", "dynamic", "continuous", "continuous-paged"}
        assert column["rows"]["continuous-paged"]["num_pages"] > 0
        assert column["bound_continuous_over_static"] >= 1.0
    assert (tmp_path / "compare_batching.png").stat().st_size > 0
    assert "machine" in result and result["flags"]["model"] == "tiny-llama"


def test_latency_sweep_and_ablate_write_results(tmp_path):
    run_script("latency_sweep.py", "--model=tiny-llama", "--qps=50", "--num_requests=6", "--policies=static,continuous",
               "--num_slots=2", "--max_seq_len=128", "--ttft_ms=1000", f"--output_dir={tmp_path}")
    sweep = json.loads((tmp_path / "latency_sweep.json").read_text())
    assert set(sweep["results"]) == {"static@50", "continuous@50"}
    assert all(r["completed"] == 6 and "request_goodput" in r for r in sweep["results"].values())
    run_script("ablate.py", "--model=tiny-llama", "--knob=refill_interval", "--values=1,4", "--num_requests=6",
               "--max_seq_len=128", f"--output_dir={tmp_path}")
    ablate = json.loads((tmp_path / "ablate_refill_interval.json").read_text())
    assert [r["value"] for r in ablate["runs"]] == [1, 4]
    assert (tmp_path / "ablate_refill_interval.png").stat().st_size > 0


def test_static_bound():
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
        from compare_batching import static_bound
    finally:
        sys.path.pop(0)
    assert static_bound([4, 4, 4, 4], 2) == pytest.approx(1.0)
    # batches [1, 3] and [2]: static spends 3*2 + 2*1 = 8 slot-steps for 6 tokens.
    assert static_bound([1, 3, 2], 2) == pytest.approx(8 / 6)


def test_paged_attention_benchmark_smoke_in_interpret_mode(tmp_path):
    out = tmp_path / "bench.json"
    run_script("bench_paged_attention.py", "--interpret", "--batch_sizes=2", "--context_lens=64", "--page_sizes=16",
               "--q_heads=4", "--kv_heads=2", "--head_dim=32", "--dtype=float32", "--iters=1",
               "--pages_per_block=2", "--splits=2", f"--output_json={out}")
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and all("us" in rows[0][n] for n in ("ours", "xla_reference", "dense"))
