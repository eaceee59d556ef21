"""Smoke runs of the experiment scripts on a tiny preset: they run, and write JSON and a plot."""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.forked_runs import ForkedRuns
from tests.tiers import slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def experiment(name: str, *args: str) -> list[str]:
    """The command that runs experiment `name` from the repository's root, as the README shows."""
    return [sys.executable, "-m", "experiments", name.removesuffix(".py"), *args]


def run_script(name: str, *args: str) -> None:
    proc = subprocess.run(experiment(name, *args), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_compare_batching_writes_table_json_and_plot(tmp_path):
    run_script("compare_batching.py", "--model=tiny-llama", "--max_gen_lens=32", "--num_requests=4",
               "--num_slots=2", "--prompt_len=8", "--repeats=2", f"--output_dir={tmp_path}", "--roofline_read_mb=4")
    result = json.loads((tmp_path / "compare_batching.json").read_text())
    assert [c["max_gen_len"] for c in result["columns"]] == [32]
    assert "against this CPU's roofline" in result["table"]
    for column in result["columns"]:
        assert column["num_requests"] == 6  # three waves of the column's 2 slots
        continuous = column["rows"]["continuous"]
        assert len(continuous["seconds"]) == 2 and continuous["over_static"]["min"] <= continuous["over_static"]["max"]
        assert "x [" in result["table"] and "bound, this machine" in result["table"]
        assert set(column["rows"]) == {"static", "dynamic", "continuous", "continuous-paged"}
        assert column["rows"]["continuous-paged"]["num_pages"] > 0
        assert column["bound_continuous_over_static"] >= column["fcfs_bound_continuous_over_static"] >= 1.0
        # this machine's bound: the FCFS schedules priced by static's measured steps per batch size
        assert column["machine_bound_continuous_over_static"] > 0 and column["machine_step_seconds"]
        assert set(column["machine_schedule_seconds"]) == {"static", "continuous"}
        steps = column["machine_step_of_roofline"]
        assert steps.keys() == column["machine_step_seconds"].keys()
        assert all(s["share"] == pytest.approx(s["floor"]["ms"] / s["ms"]) for s in steps.values())
    assert (tmp_path / "compare_batching.png").stat().st_size > 0
    assert "machine" in result and result["flags"]["model"] == "tiny-llama"


@slow
def test_compare_batching_on_a_trace_with_an_8bit_cache(tmp_path):
    """A trace's lengths instead (Azure's code service, scaled to the tiny model)."""
    run_script("compare_batching.py", "--model=tiny-llama", "--max_gen_lens=8", "--num_requests=4", "--num_slots=2",
               "--prompt_len=24", "--policies=continuous", "--paged_policies=", "--workload=azure_code", "--repeats=1",
               "--length_scale=0.01", "--kv_cache_dtypes=auto,int8", f"--output_dir={tmp_path}")
    column = json.loads((tmp_path / "compare_batching.json").read_text())["columns"][0]
    assert set(column["rows"]) == {"continuous", "continuous-int8kv"} and column["mean_budget"] <= 8
    slots = column["slots_by_kv_dtype"]  # the same bytes hold more 8-bit sequences
    assert slots["int8"] > slots["auto"] == column["rows"]["continuous"]["slots"]
    assert column["rows"]["continuous-int8kv"]["slots"] == slots["int8"]


@slow
def test_latency_sweep_and_ablate_write_results(tmp_path):
    small = ("--num_requests=6", "--num_slots=2", "--max_seq_len=64", "--prompt_high=32", "--output_cap=24")
    run_script("latency_sweep.py", "--model=tiny-llama", "--qps=50", "--policies=static,continuous", *small,
               "--ttft_ms=1000", f"--output_dir={tmp_path}")
    sweep = json.loads((tmp_path / "latency_sweep.json").read_text())
    assert set(sweep["results"]) == {"static@50", "continuous@50"}
    assert all(r["completed"] == 6 and "request_goodput" in r for r in sweep["results"].values())
    # Mooncake's arrivals (rescaled to the QPS) and lengths (scaled to the tiny model).
    run_script("ablate.py", "--model=tiny-llama", "--knob=refill_interval", "--values=1,4", *small,
               "--workload=mooncake", "--length_scale=0.004", f"--output_dir={tmp_path}")
    ablate = json.loads((tmp_path / "ablate_refill_interval.json").read_text())
    assert [r["value"] for r in ablate["runs"]] == [1, 4]
    assert (tmp_path / "ablate_refill_interval.png").stat().st_size > 0


@slow
def test_speculation_study_writes_its_table(tmp_path):
    run_script("speculation.py", "--model=tiny-llama", "--workloads=synthetic", "--batch_sizes=2", "--ks=2",
               "--max_tokens=24", "--max_seq_len=64", "--requests_per_slot=1", "--repeats=2",
               f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "speculation.json").read_text())
    rows = result["closed_batches"]
    assert [r["config"] for r in rows.values()] == ["none", "k=2", "adaptive"]
    assert rows["synthetic/b2/none/in-process"]["speedup"] == 1.0
    assert rows["synthetic/b2/k=2/in-process"]["proposed"] > 0
    assert len(rows["synthetic/b2/k=2/in-process"]["runs_tok_per_s"]) == 2
    assert (tmp_path / "speculation.png").stat().st_size > 0
    assert "| synthetic | 2 | k=2 | in-process |" in result["table"]


def test_fcfs_schedules_count_each_steps_sequences():
    cb = experiments_module("batching_bounds")
    budgets = [3, 1, 2, 2, 1]
    # static: batches [3, 1] and [2, 2] and [1]; continuous: 2 slots, each request takes the first free one
    assert cb.fcfs_rows(budgets, 2, static=True) == [2, 1, 1, 2, 2, 1]
    assert cb.fcfs_rows(budgets, 2, static=False) == [2, 2, 2, 2, 1]
    assert sum(cb.fcfs_rows(budgets, 2, True)) == sum(cb.fcfs_rows(budgets, 2, False)) == sum(budgets)


def test_the_cpu_roofline_has_both_sides_and_flags_a_share_past_it():
    """A step's floor is the larger of its bytes over the best read method and its matmuls
    through the best GEMM; a share of it above 100% reads as a suspect roofline."""
    from cbjax.experimental import load_model

    roof = experiments_module("cpu_roofline")
    config = load_model("tiny-llama").config
    shapes = roof.matmul_shapes(config)
    assert shapes[(config.vocab_size, config.hidden_size)] == 1 and sum(shapes.values()) == 7 * config.num_layers + 1
    roofline = roof.CpuRoofline(config, weight_bytes=10**9, batches=[1, 4], read_bytes=4 << 20)
    memory = roofline.memory
    assert memory["GBps"] == max(memory["methods_GBps"].values()) > 0
    for rows in (1, 4):
        floor = roofline.floor_ms(rows, kv_bytes=1e6)
        assert floor["ms"] == max(floor["memory_ms"], floor["compute_ms"]) > 0
        assert floor["memory_ms"] == pytest.approx(1e3 * (10**9 + 1e6) / (memory["GBps"] * 1e9))
        assert roofline.compute[rows]["GFLOP"] == pytest.approx(
            2 * rows * sum(n * k * c for (n, k), c in shapes.items()) / 1e9)
    assert roofline.share(2 * roofline.floor_ms(1)["ms"], 1) == pytest.approx(0.5)
    assert roof.share_text(0.5) == "50%" and "suspect" in roof.share_text(1.2)
    assert "GB/s" in roofline.describe() and json.dumps(roofline.to_json())


def test_bench_cpu_step_tables_every_format_and_batch_against_the_roofline(tmp_path):
    out = tmp_path / "step.json"
    run_script("bench_cpu_step.py", "--model=tiny-llama", "--formats=f32,int8", "--batches=1,2", "--rounds=1",
               "--prompt_len=4", "--new_tokens=4", "--roofline_read_mb=4", f"--output_json={out}")
    result = json.loads(out.read_text())
    assert set(result["table"]) == {"f32/1", "f32/2", "int8/1", "int8/2"} and len(result["rounds"]) == 1
    for row in result["table"].values():
        assert row["ms_per_step"] > 0 and row["floor_ms"] > 0 and row["bound"] in ("memory", "compute")
        assert row["share"] == pytest.approx(row["floor_ms"] / row["ms_per_step"], rel=1e-6)
    assert result["table"]["int8/1"]["weight_bytes"] < result["table"]["f32/1"]["weight_bytes"]


def test_bench_cpu_roofline_reports_each_figures_spread(tmp_path):
    out = tmp_path / "roofline.json"
    run_script("bench_cpu_roofline.py", "--model=tiny-llama", "--batches=1,2", "--runs=2", "--repeats=2",
               "--roofline_read_mb=4", f"--output_json={out}")
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 2 and set(result["runs"][0]["compute"]) == {"1", "2"}
    roof = result["summary"]["memory GB/s (the roof)"]
    assert roof["spread"] == pytest.approx(max(roof["values"]) / min(roof["values"]) - 1)
    assert "compute GFLOP/s at 2 rows" in result["summary"]


@slow
def test_bench_engine_reports_its_decode_against_the_roofline(tmp_path):
    out = tmp_path / "engine.json"
    run_script("bench_engine.py", "--shape=tiny", "--num_requests=4", "--num_slots=2", "--max_prompt=16",
               "--max_output=16", "--skip_transformers", "--scheduler_slots=2", "--roofline_read_mb=4",
               f"--output_json={out}")
    roofline = json.loads(out.read_text())["cbjax"]["roofline"]
    assert roofline["floor_s"] > 0 and roofline["share"] == pytest.approx(
        roofline["floor_s"] / json.loads(out.read_text())["cbjax"]["seconds"])


def test_static_bound():
    static_bound = experiments_module("batching_bounds").static_bound
    assert static_bound([4, 4, 4, 4], 2) == pytest.approx(1.0)
    # batches [1, 3] and [2]: static spends 3*2 + 2*1 = 8 slot-steps for 6 tokens.
    assert static_bound([1, 3, 2], 2) == pytest.approx(8 / 6)
    fcfs_bound = experiments_module("batching_bounds").fcfs_bound
    # Static: batches [8, 1] and [1, 8] take 16 steps. Continuous: slot 0 runs 8; slot 1 runs
    # 1, 1, then the last 8 from step 2 to 10.
    assert fcfs_bound([8, 1, 1, 8], 2) == pytest.approx(16 / 10)
    # Every wave's longest at the cap: continuous's tail is static's last batch.
    assert fcfs_bound([8, 8, 8, 8], 2) == pytest.approx(1.0)


@slow
def test_paged_attention_benchmark_smoke_in_interpret_mode(tmp_path):
    out = tmp_path / "bench.json"
    run_script("bench_paged_attention.py", "--interpret", "--batch_sizes=2", "--context_lens=64", "--page_sizes=16",
               "--q_lens=1,5", "--q_heads=4", "--kv_heads=2", "--head_dim=32", "--dtype=float32", "--iters=1",
               "--pages_per_block=2", f"--output_json={out}")
    rows = json.loads(out.read_text())["rows"]
    assert [r["q_len"] for r in rows] == [1, 5]
    assert all("us" in r[n] for r in rows for n in ("ours", "xla_reference", "dense"))


@slow
def test_bench_device_tiny_runs_every_section(tmp_path):
    """The device benchmark's tiny mode on this CPU: every section reports (the kernels
    interpreted, matching their reference; every engine timed at each batch; the peer run in
    its own process). Its times mean nothing here and nothing timed is asserted."""
    out = tmp_path / "device.json"
    # The compiled transformers peer (torch.compile, ~50 s on this CPU) is left to the device runs.
    run_script("bench_device.py", "--tiny", "--peer_compiled=false", f"--output_json={out}")
    result = json.loads(out.read_text())
    assert not [k for k in result if k.endswith("_error")], result
    assert set(result["sections"]) == {"copy", "kernel", "kernel_bw", "decode_8b", "step_135m", "peer", "quant_8b",
                                       "quant_matmul", "moe", "lora"}
    lora = result["lora"]
    assert set(lora["steps"]) == {"1", "4"} and lora["adapters"] == 4
    assert all(s[k] > 0 for s in lora["steps"].values() for k in ("base_ms", "one_ms", "many_ms", "adapter_MB"))
    moe = result["moe"]
    assert set(moe) == {"moe", "dense_active"} and moe["moe"]["expert_imbalance"] >= 1.0
    assert all(set(r["steps"]) == {"1", "4"} and all(s["ms"] > 0 for s in r["steps"].values()) for r in moe.values())
    quant_rows = {r["engine"]: r for r in result["quant_8b"]["rows"]}
    assert "fp8 dots" in quant_rows["fp8"]["refused"]  # this CPU has none
    assert quant_rows["int8"]["weights_GB"] < quant_rows["none"]["weights_GB"]
    assert all(s["ms"] > 0 for s in quant_rows["int8"]["steps"].values())
    assert set(quant_rows) == {"none", "int8", "fp8", "int8 xla", "int8 1-row buckets"}
    matmul = result["quant_matmul"]
    forms = {r["form"] for r in matmul["rows"]}
    assert {"bf16 dot", "int8 xla", "int8 pallas", "int8 pallas default", "int8 pallas form=stream"} <= forms
    assert not [r for r in matmul["rows"] if "error" in r or "skipped" in r]
    assert all(r["rel_error"] < 1e-5 for r in matmul["rows"] if "rel_error" in r)
    assert matmul["best_name"] in matmul["layer_ms"] and result["quant_8b"]["launch"] == matmul["best"]
    assert result["copy"]["GBps"] > 0 and result["kernel"] and all(r["ok"] for r in result["kernel"])
    # The roofline is the best of several methods, the Pallas copy among them (interpreted here, exact).
    copy = result["copy"]
    assert {"xla_scale_new_buffer", "xla_sum_read_only", "xla_scale_donated", "pallas_copy_rows8"} <= set(copy["methods"])
    assert "pallas_copy_error" not in copy["methods"] and copy["GBps"] == max(
        m["GBps"] for m in copy["methods"].values() if "GBps" in m) == copy["methods"][copy["method"]]["GBps"]
    assert all(r["ms"] > 0 for r in result["kernel_bw"])
    decode = result["decode_8b"]
    assert [r["engine"] for r in decode["rows"]] == ["slots/auto", "paged/auto", "slots/reference", "paged/reference"]
    # auto on a CPU is the reference path (and the C++ kernels)
    assert all(r["attention_run"] == "reference" and set(r["steps"]) == {"1", "4"} for r in decode["rows"])
    assert all(s["ms"] > 0 and 0 < s["roofline_ms"] for r in decode["rows"] for s in r["steps"].values())
    assert set(result["peer"]["steps"]) == {"1", "4"}
    # The default (unfused on a CPU) at 1 and 4 steps a call, then fused projections beside it.
    assert [(r["decode_steps"], r["fused"]) for r in result["step_135m"]] == [(1, False), (4, False), (1, True)]
    # ... and again in a process of its own under other XLA flags (command buffers off on a GPU)
    (under_flags,) = result["step_135m_flags"].values()
    assert [r["decode_steps"] for r in under_flags] == [1, 4, 1] and all(r["ms"] > 0 for r in under_flags)


def test_device_trace_summary_counts_busy_idle_and_syncs(tmp_path):
    """The profile summary over a trace like a GPU's: device events on streams (overlapping
    ones counted once), the gaps between them as idle, device-to-host copies as host syncs."""
    import gzip

    bench = experiments_module("device_trace")
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 40, "name": "fusion.1"},
              {"ph": "X", "pid": 1, "tid": 2, "ts": 30, "dur": 20, "name": "cbjax_ragged_paged_attention"},
              {"ph": "X", "pid": 1, "tid": 1, "ts": 80, "dur": 10, "name": "MemcpyDtoH"},
              {"ph": "X", "pid": 1, "tid": 1, "ts": 90, "dur": 10, "name": "fusion.1"},
              {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 500, "name": "PjitFunction(ragged_step)"}]
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = bench.summarise_trace(str(tmp_path))
    assert summary["device_events"] == 4 and summary["wall_us"] == 100 and summary["busy_us"] == 70
    assert abs(summary["idle_share"] - 0.3) < 1e-9 and summary["device_to_host_copies"] == 1
    assert summary["top_kernels_us"][0] == ["fusion.1", 50]


def experiments_module(name: str):
    """A script's or a helper's module, imported as the scripts import each other."""
    from experiments.__main__ import scripts

    return importlib.import_module(scripts().get(name, f"experiments.lib.{name}"))


@pytest.fixture(scope="module")
def forked():
    """Runs that stop at their flags, forked from one process that imported jax and cbjax once."""
    runs = ForkedRuns(ROOT)
    yield runs
    runs.close()


@pytest.mark.parametrize("script,flag", [
    ("compare_batching.py", "--num_slots=0"),
    ("compare_batching.py", "--max_gen_lens=8,-3"),
    ("compare_batching.py", "--policies=static,fastest"),
    ("latency_sweep.py", "--qps=0"),
    ("latency_sweep.py", "--workload=azure_coed"),
    ("compare_batching.py", "--workload=held_out"),
    ("latency_sweep.py", "--length_scale=0"),
    ("latency_sweep.py", "--num_requests=0"),
    ("latency_sweep.py", "--prompt_low=40 --prompt_high=20"),
    ("ablate.py", "--num_slots=-1"),
    ("generate.py", "--top_p=1.5"),
    ("eval_perplexity.py", "--window=1"),
    ("bench_paged_attention.py", "--page_sizes=0"),
    ("bench_device.py", "--sections=copy,warp"),
    ("bench_device.py", "--engines=slots/auto,ring/auto"),
    ("merge_modes.py", "--modes=prefill_first,eager"),
    ("merge_modes.py", "--long_prompt_len=600"),
    ("bench_decode_slots.py", "--slots=0,4"),
    ("bench_moe.py", "--batches=1,0"),
    ("bench_moe.py", "--experts=4 --top_k=6"),
    ("moe_batching.py", "--sections=cpu,gpu"),
    ("moe_batching.py", "--accelerator=gtx-480"),
    ("soak.py", "--num_requests=0"),
    ("serve_bench.py", "--qps=1,0"),
    ("serve_bench.py", "--num_slots=0"),
    ("simulate_study.py", "--accelerator=gtx-480"),
    ("calibrate_simulator.py", "--slots=0,4"),
    ("validate_simulator.py", "--calibration=/nonexistent/cost.json"),
    ("ablate.py", "--simulate=nowhere.json"),
    ("pipeline_bubbles.py", "--micro_batches=3"),
    ("pipeline_bubbles.py", "--cost_shape=gpt-5"),
    ("scale_out.py", "--configs=2x1:random"),
    ("scale_out.py", "--prefix_len=500"),
    ("capacity.py", "--schedulers=prefill_first,chunked"),
    ("capacity.py", "--schedulers=chunked@1"),
    ("capacity.py", "--workloads=azure_coed"),
    ("capacity.py", "--slo_batch=64"),
])
def test_bad_flag_values_are_refused_at_parse_time(forked, script, flag):
    """A one-line message naming the flag, before anything loads (no traceback)."""
    proc = forked.run(script, *flag.split())
    name = flag.split()[-1].split("=")[0]
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "Flags parsing error" in line]
    assert len(errors) == 1 and name.lstrip("-") in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("script", ["latency_sweep.py", "ablate.py", "serve_bench.py", "capacity.py"])
def test_help_lists_the_workload_flags(forked, script):
    proc = forked.run(script, "--help")
    for name in ("--num_requests", "--prompt_low", "--output_cap", "--burstiness", "--workload", "--length_scale",
                 "--trace_start_s", "--time_scale"):
        assert name in proc.stdout, f"{script} --help does not show {name}"


def test_compare_batching_table_columns_line_up():
    cb = experiments_module("compare_batching")
    rows = {"static": {"tokens_per_s": 12.5, "mean_running": 3.0},
            "continuous-paged": {"tokens_per_s": 1234.5, "mean_running": 12.25},
            "hf_generate_batch": {"tokens_per_s": 7.0}}
    columns = [{"max_gen_len": g, "slots": 8, "bound_continuous_over_static": 1.5,
                "fcfs_bound_continuous_over_static": 1.25, "rows": rows} for g in (8, 1536)]
    lines = cb.print_table(columns).splitlines()
    assert len({len(line) for line in lines}) == 1, "every line as wide as the header"
    assert any(line.startswith("continuous-paged mean running ") for line in lines)


@slow
def test_transformers_peers_threads_and_bounded_cache(monkeypatch):
    """The peers run with one thread per core and a generate_batch cache sized to the batch
    (transformers' default takes most of the free memory), and the bounded cache gives the
    same greedy tokens as a generous one."""
    import torch
    from transformers import ContinuousBatchingConfig

    from tests.hf_models import make_hf_model

    peers = experiments_module("hf_peers")
    settings = peers.configure_torch()
    assert settings["torch_threads"] == len(os.sched_getaffinity(0)) == torch.get_num_threads()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 150, size=int(n)).tolist() for n in (5, 9, 12, 20)]
    budgets = [6, 3, 8, 12]
    config = peers.peer_cache_config(prompts, budgets, max_batch=2, page_size=16)
    assert config.num_blocks * config.page_size <= 2 * 32 + 16 and config.max_requests_per_batch == 2
    hf = make_hf_model("llama", seed=1)
    bounded, _ = peers.continuous_generate_batch(hf, prompts, budgets, 2, return_tokens=True)
    generous = ContinuousBatchingConfig(page_size=32, num_blocks=64, max_requests_per_batch=2, max_batch_tokens=256)
    monkeypatch.setattr(peers, "peer_cache_config", lambda *args, **kwargs: generous)
    reference, _ = peers.continuous_generate_batch(hf, prompts, budgets, 2, return_tokens=True)
    assert bounded == reference and [len(t) for t in bounded] == budgets


@slow
def test_eval_perplexity_writes_json_and_png(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    out = tmp_path / "ppl.json"
    run_script("eval_perplexity.py", "--model=smollm2-135m", "--notransformers", "--window=32", f"--text={text}",
               f"--output_json={out}")
    result = json.loads(out.read_text())
    assert result["cbjax_ppl"] > 1 and result["predicted"] > 32 and len(result["per_document_loglikelihood"]["cbjax"]) == 1
    assert (tmp_path / "ppl.png").stat().st_size > 0
    # The file's own blocks and an int8 KV cache: the same predicted tokens, a perplexity near the f32 one.
    run_script("eval_perplexity.py", "--model=smollm2-135m", "--notransformers", "--window=32", f"--text={text}",
               "--quantization=gguf", "--kv_cache_dtype=int8", f"--output_json={out}")
    quantized = json.loads(out.read_text())
    assert quantized["predicted"] == result["predicted"]
    assert abs(quantized["cbjax_ppl"] / result["cbjax_ppl"] - 1) < 0.05


def test_find_capacity_brackets_then_bisects():
    from cbjax.metrics import find_capacity

    threshold = 3.3
    capacity, probed = find_capacity(lambda q: q <= threshold, start=1.0, low=0.1, high=64.0, steps=4)
    assert probed[:3] == [1.0, 2.0, 4.0]  # doubles up to the first failure, then bisects 4 times
    assert len(probed) == 7 and 3.0 <= capacity <= threshold
    capacity, probed = find_capacity(lambda q: q <= 0.3, start=1.0, low=0.1, high=64.0, steps=1)
    assert probed[:3] == [1.0, 0.5, 0.25] and 0.25 <= capacity <= 0.3  # halves down to the first pass
    assert find_capacity(lambda q: False, start=1.0, low=0.1, high=64.0, steps=3)[0] == 0.0
    assert find_capacity(lambda q: True, start=1.0, low=0.1, high=8.0, steps=3) == (8.0, [1.0, 2.0, 4.0, 8.0])


@slow
def test_capacity_simulated_writes_table_json_and_plot(tmp_path):
    run_script("capacity.py", "--simulate=a100-80gb", "--model=llama3.2-1b", "--dtype=bfloat16", "--kv_cache=paged",
               "--attention=pallas", "--num_slots=8", "--max_seq_len=1024", "--slo_batch=4", "--slo_context=256",
               "--workloads=sharegpt,azure_conv", "--schedulers=prefill_first,chunked@128", "--num_requests=24",
               "--search_steps=1", "--qps_start=4", f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "capacity.json").read_text())
    assert set(result["results"]) == {"sharegpt", "azure_conv"} and result["tbt_slo_ms"] > 0
    for rows in result["results"].values():
        assert set(rows) == {"prefill_first", "chunked@128"}
        for row in rows.values():
            passing = [p["qps"] for p in row["probes"] if p["passes"]]
            assert row["capacity"] == max(passing, default=0.0)
            assert all(p["p99_tbt_ms"] <= result["tbt_slo_ms"] for p in row["probes"] if p["passes"])
    assert "2.6x" in result["table"]
    assert (tmp_path / "capacity.png").stat().st_size > 0


@slow
def test_merge_modes_writes_table_json_and_plot(tmp_path):
    run_script("merge_modes.py", "--model=tiny-llama", "--num_decoders=2", "--decoder_output_len=12", "--num_long=2",
               "--long_prompt_len=30", "--long_output_len=3", "--long_qps=50", "--long_start_s=0.02",
               "--num_slots=4", "--max_seq_len=64", "--modes=prefill_first,chunked", "--chunked_budgets=12",
               f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "merge_modes.json").read_text())
    assert [r["name"] for r in result["runs"]] == ["prefill_first", "chunked@12"]
    for r in result["runs"]:
        assert r["completed"] == 4 and r["decoder_max_itl_ms"] >= r["decoder_p99_itl_ms"] > 0
    assert (tmp_path / "merge_modes.png").stat().st_size > 0


@slow
def test_bench_decode_slots_smoke(tmp_path):
    out = tmp_path / "slots.json"
    run_script("bench_decode_slots.py", "--model=tiny-llama", "--slots=2,8", "--steps=3", "--repeats=1",
               "--prompt_len=4", "--max_seq_len=32", f"--output_json={out}")
    result = json.loads(out.read_text())
    assert set(result["seconds_per_step"]) == {"prefill_first", "chunked"}


@slow
def test_bench_moe_smoke(tmp_path):
    out = tmp_path / "moe.json"
    run_script("bench_moe.py", "--batches=1,4", "--hidden=64", "--layers=1", "--expert_width=32", "--vocab=64",
               "--steps=2", "--repeats=1", "--prompt_len=4", f"--output_json={out}")
    result = json.loads(out.read_text())
    assert set(result["seconds_per_step"]) == {"moe", "dense_active", "dense_all"}
    assert all(set(times) == {"1", "4"} for times in result["seconds_per_step"].values())
    assert (tmp_path / "moe.png").stat().st_size > 0


@slow
def test_lora_batching_and_bench_lora_smoke(tmp_path):
    run_script("lora_batching.py", "--sections=cpu,simulated", "--model=tiny-llama", "--adapter_counts=1,4",
               "--num_requests=6", "--prompt_len=4", "--output_len=3", "--num_slots=4", "--max_loras=2",
               "--max_cpu_loras=2", "--accelerators=h100", "--qps=2", "--duration=4", f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "lora_batching.json").read_text())
    assert set(result["cpu"]) == {"1", "4"} and set(result["cpu"]["4"]) == {"batched", "merged", "one at a time",
                                                                           "distinct"}
    assert set(result["simulated"]["h100"]) == {"1", "4"} and (tmp_path / "lora_batching.png").stat().st_size > 0
    out = tmp_path / "bench_lora.json"
    run_script("bench_lora.py", "--model=tiny-llama", "--rows=4", "--rank=4", "--steps=2", "--rounds=1",
               "--prompt_len=4", "--max_seq_len=32", f"--output_json={out}")
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 5 and all(c["ms"] > 0 for c in cells.values()) and cells["base"]["ratio"] == 1.0


@slow
def test_moe_batching_smoke(tmp_path):
    run_script("moe_batching.py", "--sections=cpu,simulated,ep,policies", "--cpu_batches=1,4", "--hidden=64",
               "--layers=1", "--expert_width=32", "--vocab=64", "--steps=2", "--repeats=1", "--batches=1,8,64",
               "--max_gen_lens=16", "--num_requests=40", "--prompt_len=32", f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "moe_batching.json").read_text())
    assert set(result["cpu"]["seconds_per_step"]) == {"moe", "dense_active"}
    assert set(result["simulated"]) == {"mixtral-8x7b", "qwen3-30b-a3b"}
    assert set(result["ep"]["seconds_per_step"]) == {"ep1 (h200)", "ep2 (h100)", "ep4 (h100)", "ep8 (h100)"}
    assert set(result["policies"]) == {"mixtral-8x7b", "dense-12.9b"}
    assert (tmp_path / "moe_batching.png").stat().st_size > 0


@slow
def test_serve_bench_against_a_started_server(tmp_path):
    run_script("serve_bench.py", "--model=tiny-llama", "--qps=40", "--num_requests=6", "--prompt_high=20",
               "--output_cap=6", "--max_seq_len=64", "--num_slots=4", f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "serve_bench.json").read_text())
    assert set(result["results"]) == {"server@40", "in-process@40"}
    for r in result["results"].values():
        assert r["completed"] == 6 and r["median_ttft_ms"] > 0
    served, local = result["results"]["server@40"], result["results"]["in-process@40"]
    assert served["total_output_tokens"] == local["total_output_tokens"]
    assert set(result["ratios"]["40"]) >= {"median_ttft_ms", "output_throughput"}
    assert (tmp_path / "serve_vs_replay_cdf.png").stat().st_size > 0
    assert "cbjax serving" in (tmp_path / "server.log").read_text()


class _FakePeer:
    """A stand-in OpenAI-compatible peer (as llama-server streams): one SSE chunk per token,
    `max_tokens` of them; counts the requests it served."""

    def __init__(self):
        import asyncio
        import threading

        from aiohttp import web

        self.served = 0
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def completions(self, request):
        from aiohttp import web

        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            chunk = {"id": "cmpl-peer", "object": "text_completion", "created": 0, "model": body["model"],
                     "choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        self.served += 1
        return response

    def stop(self):
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@slow
def test_serve_bench_against_a_peer_interleaves_repeats(tmp_path):
    peer = _FakePeer()
    try:
        run_script("serve_bench.py", "--model=tiny-llama", "--qps=40", "--num_requests=4", "--prompt_high=20",
                   "--output_cap=5", "--max_seq_len=64", "--num_slots=4", "--noin_process", "--repeats=2",
                   f"--peer_url={peer.url}", "--peer_model_name=peer", f"--output_dir={tmp_path}")
    finally:
        peer.stop()
    assert peer.served == 2 * 4  # every request of both repeats
    result = json.loads((tmp_path / "serve_bench.json").read_text())
    assert set(result["results"]) == {"server@40", "peer@40"}
    served, other = result["results"]["server@40"], result["results"]["peer@40"]
    assert served["runs"] == other["runs"] == 2 and served["completed"] == other["completed"] == 4
    assert served["total_output_tokens"] == other["total_output_tokens"]  # EOS ignored on both sides
    # Each request of each repeat, both sides alike: [arrival, prompt, output tokens, TTFT, TPOT].
    for side in (served, other):
        assert [len(run) for run in side["requests"]] == [4, 4]
        assert [r[2] for r in side["requests"][0]] == [r[2] for r in other["requests"][0]]
        assert all(r[3] > 0 for run in side["requests"] for r in run)
    assert set(result["peer_ratios"]["40"]) >= {"median_ttft_ms", "median_tpot_ms", "median_e2el_ms"}
    assert result["ratios"] == {}  # no in-process side


@slow
def test_pipeline_bubbles_and_scale_out_write_results(tmp_path):
    run_script("pipeline_bubbles.py", "--micro_batches=1,2", "--decode_steps=2", "--policies=continuous",
               "--num_requests=6", "--num_slots=4", "--max_seq_len=128", "--output_cap=16", f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "pipeline_bubbles.json").read_text())
    bubbles = {r["micro_batches"]: r["bubble_fraction"] for r in result["runs"]}
    assert set(bubbles) == {1, 2} and 0 < bubbles[2] < bubbles[1] < 0.51  # 2 stages: one group idles one of them
    assert (tmp_path / "pipeline_bubbles.png").stat().st_size > 0
    run_script("scale_out.py", "--configs=1x1,2x1:prefix_affinity", "--num_requests=6", "--qps=50",
               "--prefix_len=16", "--num_prefixes=1", "--output_len=4", "--suffix_high=16", "--max_seq_len=48", "--num_slots=2",
               "--page_size=8", f"--output_dir={tmp_path}")
    runs = json.loads((tmp_path / "scale_out.json").read_text())["runs"]
    assert [r["config"] for r in runs] == ["1x1", "2x1 prefix_affinity"]
    assert sum(runs[1]["routed"]) == 6 and len(runs[1]["routed"]) == 2
    assert all(0 <= r["prefix_hit_rate"] <= 1 and r["output_throughput"] > 0 for r in runs)


@slow
def test_bench_cpu_peers_reports_roofline_and_parses_llama_cpp(tmp_path):
    # A stand-in for llama-batched-bench that prints its table, so the parsing is tested without llama.cpp.
    fake = tmp_path / "llama-batched-bench"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'args'}\ncat <<'TABLE'\n"
                    "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
                    "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n"
                    "|     4 |      4 |    1 |      8 |    0.010 |   400.00 |    0.040 |   100.00 |    0.050 |   160.00 |\n"
                    "|     4 |      4 |    2 |     16 |    0.020 |   400.00 |    0.050 |   160.00 |    0.070 |   228.57 |\n"
                    "TABLE\n")
    fake.chmod(0o755)
    gguf = tmp_path / "model-f32.gguf"
    gguf.write_bytes(b"")
    out = tmp_path / "peers.json"
    run_script("bench_cpu_peers.py", "--model=tiny-llama", "--batch_sizes=1,2", "--prompt_len=4", "--new_tokens=4",
               "--rounds=2", f"--llama_cpp_dir={tmp_path}", f"--llama_cpp_gguf={gguf}", f"--output_json={out}",
               "--roofline_read_mb=16")
    result = json.loads(out.read_text())
    assert result["roofline"]["memory"]["GBps"] > 0 and set(result["roofline"]["compute"]) == {"1", "2"}
    assert all(r["fraction_of_roofline"] > 0 and r["floor"]["ms"] > 0 for r in result["cbjax"].values())
    assert set(result["cbjax"]) == {"1", "2"}
    # Both sides hold the KV cache in f16 (llama.cpp's default, cbjax's kv_cache_dtype float16).
    assert result["kv_cache_dtype"] == "float16"
    assert [line.count("-ctk f16 -ctv f16") for line in (tmp_path / "args").read_text().splitlines()] == [1, 1]
    row = {"ms_per_step": 12.5, "tg_tokens_per_s": 160.0, "seconds": 0.07, "tokens_per_s": 228.57}
    assert result["llama_cpp"]["rows"]["2"] == {**row, "rounds": [row, row]}  # two rounds, the median of each key
    for b in ("1", "2"):
        ours, theirs = result["cbjax"][b], result["llama_cpp"]["rows"][b]
        assert ours["ms_per_step"] > 0 and len(ours["rounds"]) == 2
        assert ours["ms_per_step"] == pytest.approx(np.median([r["ms_per_step"] for r in ours["rounds"]]))
        # 3 new tokens after the prefill's: one call of 3 steps (the default 8, capped)
        assert result["multi_step"] == 3 and ours["multi_step_ms_per_step"] > 0
        for prefix in ("", "multi_step_"):
            # Each round's ratio against that round's llama.cpp run, and their median.
            ratios = [r[f"{prefix}tg_tokens_per_s"] / t["tg_tokens_per_s"]
                      for r, t in zip(ours["rounds"], theirs["rounds"])]
            assert ours[f"{prefix}throughput_vs_llama_cpp_rounds"] == pytest.approx(ratios)
            assert ours[f"{prefix}throughput_vs_llama_cpp"] == pytest.approx(np.median(ratios))


@slow
def test_bench_overlap_reports_both_settings_with_equal_tokens(tmp_path):
    out = tmp_path / "overlap.json"
    run_script("bench_overlap.py", "--model=tiny-llama", "--sequences=2,4", "--prompt_len=4", "--new_tokens=6",
               "--repeats=1", f"--output_json={out}")
    rows = json.loads(out.read_text())["rows"]
    assert [r["sequences"] for r in rows] == [2, 4]
    for r in rows:
        assert r["same_tokens"] and r["rounds_off"] > 0 and r["rounds_on"] > 0
        assert r["round_ms_off"] > 0 and r["round_ms_on"] > 0 and r["device_ms_on"] > 0


@slow
def test_bench_layer_loop_times_both_loops(tmp_path):
    out = tmp_path / "layer_loop.json"
    run_script("bench_layer_loop.py", "--model=tiny-llama", "--tokens=1,4", "--repeats=1", f"--output_json={out}")
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 4]
    assert all(r[k] > 0 for r in rows for k in ("unrolled_compile_s", "scanned_compile_s", "unrolled_run_ms",
                                                   "scanned_run_ms"))


@slow
def test_bench_startup_times_a_cold_and_a_cached_launch(tmp_path):
    out = tmp_path / "startup.json"
    run_script("bench_startup.py", "--model=tiny-llama", "--num_slots=2", "--max_seq_len=64",
               f"--compilation_cache={tmp_path / 'cache'}", f"--output_json={out}")
    launches = json.loads(out.read_text())["launches"]
    # buckets 1 ... 128 tokens: two slots of 64 hold no more
    assert len(launches) == 2 and all(run["health_s"] > 0 and run["programs"] == 8 for run in launches)
    assert any((tmp_path / "cache").iterdir()), "the first launch left its programs in the cache"


@slow
def test_host_tier_studies_write_their_tables(tmp_path):
    """multi_turn: Mooncake conversations scaled to the tiny model, each row measured and predicted
    by a cost model profiled on the spot; swap_vs_recompute: one page size measured and simulated."""
    run_script("multi_turn.py", "--model=tiny-llama", "--num_requests=40", "--rate=40", "--length_scale=0.03",
               "--page_size=8", "--num_slots=4", "--max_seq_len=256", "--max_num_batched_tokens=64",
               "--calibration_requests=8", "--rows=device,device+host", f"--output_dir={tmp_path}")
    result = json.loads((tmp_path / "multi_turn_mooncake.json").read_text())
    assert set(result["results"]) == {f"{r}, {w}" for r in ("device", "device+host") for w in ("measured", "simulated")}
    setup = result["setup"]
    assert setup["device_pages"] >= 1 and 0 < setup["reusable_pages"] < setup["prompt_pages"]
    for label, row in result["results"].items():
        assert row["completed"] == 40 and row["prefill_tokens"] <= row["prompt_tokens"]
        if label.startswith("device+host"):
            assert row["host"]["pages_out"] > 0
        else:
            assert row["host_hits"] == 0
    assert "host_copy_bytes_per_s" in setup["calibration"] and (tmp_path / "multi_turn_mooncake.png").exists()
    run_script("swap_vs_recompute.py", "--model=tiny-llama", "--page_sizes=8", "--seq_lens=16,40", "--repeats=1",
               "--sim_seq_lens=256", f"--output_dir={tmp_path}")
    study = json.loads((tmp_path / "swap_vs_recompute.json").read_text())["results"]
    assert set(study) == {"measured, page 8", "h100 llama3-8b simulated, page 8", "h100 per-page copies, page 8"}
    for cells in study.values():
        assert all(c["swap_out_s"] > 0 and c["swap_in_s"] > 0 and c["recompute_s"] > 0 for c in cells.values())


def readme_experiments() -> list[str]:
    """The experiments the README's commands run (`python -m experiments NAME ...`)."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    return sorted(set(re.findall(r"python -m experiments (\w+)", "".join(blocks))))


def test_every_experiment_the_readme_lists_runs_from_the_root_as_shown():
    """Each one's `--help`, with the command the README shows, from the repository's root (no
    PYTHONPATH): its flags and its docstring's first line."""
    from experiments.__main__ import scripts, summary

    names = readme_experiments()
    assert {"compare_batching", "latency_sweep", "bench_device", "generate"} <= set(names)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda name: subprocess.run(experiment(name, "--help"), cwd=ROOT, env=env,
                                                         capture_output=True, text=True, timeout=300), names))
    for name, proc in zip(names, done):  # (absl's --help exits 1)
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, f"{name}: {proc.stderr[-1500:]}"
        assert summary(scripts()[name])[:40] in " ".join(proc.stdout.split()), name
    listing = subprocess.run([sys.executable, "-m", "experiments"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
    assert all(name in listing.stdout for name in scripts())
