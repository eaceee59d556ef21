"""The device benchmark, one command: how close cbjax runs to the memory roofline of the
accelerator it is on, and what limits it.

In one run, each against a figure measured in the same run:
- copy: the device's memory bandwidth (bytes read plus written over time), the best of several
  methods (experiments/lib/device_copy.py: XLA, a Pallas copy, torch's `copy_`) beside the nominal
  figure: the roofline;
- kernel, kernel_bw: the ragged attention kernel against its reference, and its KV bandwidth
  against the copy (experiments/lib/device_kernel.py);
- decode_8b: a Llama-3-8B-shaped bf16 model (weights drawn on the device), decode time per
  step at 1, 16 and 64 sequences for each cache layout and attention (the defaults first),
  against (weights + live KV bytes) / copy bandwidth, and each engine's start-up (build and
  compile every program); a profile of the default engine's decode steps (device time per
  kernel, the device's idle share, host syncs);
- step_135m: a SmolLM2-135M-shaped bf16 step at 64 slots (512-token prompts), where weights
  and KV are ~0.3 ms of traffic on a GPU: the overhead floor; and the same step again in a
  process of its own under each of `--step_xla_flags` (by default XLA's command buffers, CUDA
  graphs, turned off: whether the backend's default of launching through them pays);
- quant_8b, quant_matmul: int8 and fp8 weights against bf16, the engine and its matmuls
  (experiments/lib/device_quant.py);
- moe: a Mixtral-shaped decode (8 of its 32 layers, so that it fits one device) at each batch
  against a dense model of its active parameters (experiments/lib/device_moe.py);
- lora: the 8B shape with rank-16 adapters, 1 and 64 distinct, against no LoRA (device_lora.py);
- peer: transformers `generate` on the same device and shapes, per decode step, eager and with
  a static cache under `torch.compile` (mode "reduce-overhead": CUDA graphs, gpt-fast's recipe),
  run first in a subprocess (before JAX takes the device's memory).

Runs from the tree on a bare GPU machine (`python -m experiments bench_device`)
with the machine's own JAX, torch and transformers; nothing is installed or downloaded.
Prints one table and writes JSON. `--tiny` runs every section at tiny shapes on any machine
(on a CPU the kernels in interpret mode): a smoke test whose times mean nothing.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time

from experiments.lib import common  # noqa: F401  (quiets transformers and matplotlib)
from absl import app, flags

from experiments.lib.device_common import (LLAMA3_8B, TINY, batches, budget, build_engine, decode_ms, decode_shape, decode_steps,
                           device_model, roofline_ms, tuned_launches)
from experiments.lib.device_copy import copy_bandwidth, suspect
from experiments.lib.device_kernel import kernel_bandwidth, kernel_check, kernel_lines
from experiments.lib.device_lora import lora_decode, lora_lines
from experiments.lib.device_moe import moe_decode, moe_lines
from experiments.lib.device_quant import quant_8b, quant_matmul, table_lines
from experiments.lib.device_trace import summarise_trace

FLAGS = flags.FLAGS
# In the order they run (the peer first: see main), the must-have figures before the sweeps.
SECTIONS = ("peer", "copy", "kernel", "quant_matmul", "quant_8b", "step_135m", "decode_8b", "moe", "lora", "kernel_bw")
ENGINES = ("slots/auto", "paged/auto", "slots/reference", "paged/reference")
flags.DEFINE_list("sections", list(SECTIONS), f"Sections to run, of {', '.join(SECTIONS)}.")
flags.DEFINE_list("engines", list(ENGINES), "decode_8b's engines as kv_cache/attention, in order (the defaults, "
                  "slots/auto, first).")
flags.DEFINE_bool("profile", True, "Profile the default engine's decode steps (jax.profiler) and summarise them.")
flags.DEFINE_float("budget_s", 330.0, "Start no further engine or section past this many seconds (the table "
                   "says what was skipped).", lower_bound=1.0)
flags.DEFINE_string("output_json", "results/bench_device.json", "Where the results go.")
flags.DEFINE_string("peer_only", None, "Internal: run only the transformers peer and write its JSON here.")
flags.DEFINE_list("step_xla_flags", ["--xla_gpu_enable_command_buffer="], "step_135m again in a subprocess under "
                  "each of these XLA_FLAGS (on a GPU; the default turns command buffers off), beside the default's.")
flags.DEFINE_bool("peer_compiled", True, "The peer also runs transformers with a static cache under torch.compile "
                  "(mode reduce-overhead), beside eager.")
flags.register_validator("sections", lambda v: set(v) <= set(SECTIONS), f"--sections: of {', '.join(SECTIONS)}")
flags.register_validator("engines", lambda v: all(e in ENGINES for e in v), f"--engines: of {', '.join(ENGINES)}")


# ---------------------------------------------------------------- sections
def decode_8b(copy_GBps: float, deadline: float) -> dict:
    model = device_model(LLAMA3_8B if not FLAGS.tiny else TINY)
    prompt_len, warm, timed = decode_shape()
    max_seq_len = budget(prompt_len, warm, timed, 1)
    rows, skipped, profile = [], [], None
    for name in FLAGS.engines:
        if time.perf_counter() > deadline:
            skipped.append(name)
            continue
        kv_cache, attention = name.split("/")
        llm, startup = build_engine(model, kv_cache, attention, max(batches()), max_seq_len)
        row = {"engine": name, "attention_run": llm.engine_info.attention, "startup_s": startup,
               "fused": llm.engine_info.fused_projections,
               "kernel_launches": tuned_launches(llm), "steps": decode_steps(llm, model, copy_GBps)}
        if FLAGS.profile and profile is None:
            profile = profiled_decode(llm, max(batches()), prompt_len, warm, timed)
        rows.append(row)
        del llm
    import jax

    return {"rows": rows, "skipped": skipped, "profile": profile,
            "weights_GB": sum(a.nbytes for a in jax.tree.leaves(model.params)) / 1e9}


def profiled_decode(llm, batch: int, prompt_len: int, warm: int, timed: int) -> dict:
    """Decode steps under `jax.profiler`, summarised: device time per kernel, the device's idle
    share of the profiled wall time, device-to-host copies per step (host syncs)."""
    import jax

    rounds = max(timed // 4, 2)
    with tempfile.TemporaryDirectory() as trace_dir:
        profiler = functools.partial(jax.profiler.trace, trace_dir, create_perfetto_trace=True)
        ms = decode_ms(llm, batch, prompt_len, warm, rounds, around=profiler)
        summary = summarise_trace(trace_dir)
    per_round = {f"{k}_per_round": summary[k] / rounds for k in ("device_events", "device_to_host_copies")
                 if k in summary}
    return {"batch": batch, "ms_per_step_profiled": ms, "rounds": rounds, **summary, **per_round}


def step_135m(copy_GBps: float) -> list[dict]:
    import dataclasses

    from cbjax.experimental import RANDOM_PRESETS

    shape = dataclasses.asdict(RANDOM_PRESETS["smollm2-135m-random"])
    model = device_model(shape if not FLAGS.tiny else TINY, seed=1)
    slots, prompt_len, warm, timed = (64, 512, 4, FLAGS.timed_steps) if not FLAGS.tiny else (4, 16, 2, 4)
    rows = []
    # The default engine (projections fused on an accelerator, not on a CPU), then one step a call
    # the other way beside it: the fusion's ratio measured in the same run.
    for steps_a_call, fuse in ((1, "auto"), (4, "auto"), (1, "other")):
        if fuse == "other":
            fuse = "off" if rows[0]["fused"] else "on"
        llm, startup = build_engine(model, "slots", "auto", slots, budget(prompt_len, warm, timed, steps_a_call),
                                       decode_steps=steps_a_call, fuse_projections=fuse)
        ms = decode_ms(llm, slots, prompt_len, warm, timed)
        rows.append({"decode_steps": steps_a_call, "slots": slots, "ms": ms, "startup_s": startup,
                     "attention_run": llm.engine_info.attention, "fuse_projections": fuse,
                     "fused": llm.engine_info.fused_projections,
                     "roofline_ms": roofline_ms(model, slots, prompt_len + warm, copy_GBps)})
        if FLAGS.profile and steps_a_call == 1:  # where an overhead-bound step's time goes
            rows[-1]["profile"] = profiled_decode(llm, slots, prompt_len, warm, timed)
        del llm
    return rows


def run_this_script(flags: list[str], json_flag: str, timeout_s: int,
                    env: dict | None = None) -> tuple[dict, str | None]:
    """This script in a subprocess with `flags`, writing its JSON where `json_flag` (a flag name)
    says: (what it wrote, {} if nothing; None or why it failed). Run from the tree this one runs from."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = [sys.executable, "-m", __spec__.name, f"--{json_flag}={path}", *flags]
    argv += ["--tiny"] if FLAGS.tiny else []
    env = {**os.environ, **(env or {})}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=common.ROOT)
        error = None if done.returncode == 0 else (done.stderr or done.stdout)[-600:]
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout_s} s"
    out = {}
    try:
        if os.path.getsize(path):  # what it wrote, also before failing
            with open(path) as f:
                out = json.load(f)
    except (OSError, ValueError):
        pass
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out, error


def step_135m_under_flags(extra: str) -> list[dict] | dict:
    """step_135m in a subprocess with `extra` added to XLA_FLAGS (read when the backend starts), its
    memory not preallocated (this process holds most of the device)."""
    out, error = run_this_script(["--sections=step_135m", "--profile=false", "--step_xla_flags=",
                                  f"--timed_steps={FLAGS.timed_steps}"], "output_json", 300,
                                 {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {extra}".strip(),
                                  "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    return out.get("step_135m") or {"error": error or "no step_135m rows"}


# ---------------------------------------------------------------- the transformers peer
def peer_main(path: str) -> None:
    """transformers `generate` (greedy) per decode step: the difference between two output
    lengths over the steps between them, at each batch size; eager, then (`--peer_compiled`)
    with a static cache and the forward under `torch.compile(mode="reduce-overhead")`."""
    import torch
    import transformers

    shape = LLAMA3_8B if not FLAGS.tiny else TINY
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"], rope_theta=shape.get("rope_theta", 1e4),
        max_position_embeddings=shape["max_position_embeddings"], bos_token_id=1, eos_token_id=2)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).eval()
    prompt_len = FLAGS.prompt_len if not FLAGS.tiny else 16
    short, long = (4, 20) if not FLAGS.tiny else (2, 4)

    def per_step(batch: int, **generate_kwargs) -> dict:
        ids = torch.randint(10, shape["vocab_size"] - 10, (batch, prompt_len), device=device)

        def run(n):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0, **generate_kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        run(long)  # the compiled variant compiles (and records its CUDA graphs) here
        warmup = time.perf_counter() - t0
        return {"ms": 1e3 * (run(long) - run(short)) / (long - short), "warmup_s": warmup}

    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "steps": {b: per_step(b) for b in batches()}}
    with open(path, "w") as f:  # eager's figures are kept even if the compiled run fails below
        json.dump(out, f)
    if FLAGS.peer_compiled:
        try:
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            max_len = prompt_len + 2 * long
            out["compiled"] = {"mode": "reduce-overhead", "cache": "static", "steps": {
                b: per_step(b, cache_implementation="static", max_length=max_len) for b in batches()}}
        except Exception as e:  # the eager figures stand; the table says the compiled run failed
            out["compiled"] = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
        with open(path, "w") as f:
            json.dump(out, f)


def run_peer() -> dict:
    out, error = run_this_script([f"--prompt_len={FLAGS.prompt_len}", f"--batches={','.join(FLAGS.batches)}",
                                  f"--peer_compiled={FLAGS.peer_compiled}"], "peer_only", 600)
    return out if error is None else {**out, "error": error}


# ---------------------------------------------------------------- main
def table(results: dict) -> list[str]:
    """The printed table: one line per figure."""
    lines = [f"{'section':<11}{'case':<34}{'figure':>44}"]

    def line(section, case, figure):
        lines.append(f"{section:<11}{case:<34}{figure:>44}")

    if "copy" in results:
        c = results["copy"]
        nominal = f", nominal {c['nominal_GBps']:.0f}" if c.get("nominal_GBps") else ""
        line("copy", f"best of {len(c['methods'])} ({c['method']})", f"{c['GBps']:.0f} GB/s{nominal}")
        for name, m in c["methods"].items():
            line("copy", name, f"{m['GBps']:.0f} GB/s" if "GBps" in m else "error (see JSON)")
    kernel_lines(results, line)
    moe_lines(results, line)
    lora_lines(results, line)
    peer = results.get("peer", {}).get("steps", {})
    compiled = results.get("peer", {}).get("compiled", {}).get("steps", {})
    decode = results.get("decode_8b", {})
    for row in decode.get("rows", []):
        fused = ", fused q/k/v and gate/up" if row.get("fused") else ""
        line("decode_8b", f"{row['engine']} ({row['attention_run']}{fused}) start-up", f"{row['startup_s']:.1f} s")
        for kernel, chosen in tuned_summary(row.get("kernel_launches", [])).items():
            line("tuning", f"{row['engine']} {kernel}", chosen)
        for batch, s in row["steps"].items():
            vs, vs_compiled = (p.get(str(batch), p.get(batch)) for p in (peer, compiled))
            ratio = f", {vs['ms'] / s['ms']:.1f}x eager" if vs else ""
            ratio += f", {vs_compiled['ms'] / s['ms']:.2f}x compiled" if vs_compiled else ""
            line("decode_8b", f"{row['engine']} batch {batch}",
                 f"{s['ms']:.2f} ms ({suspect(s['of_roofline'])}{ratio})")
    for name in decode.get("skipped", []):
        line("decode_8b", name, "skipped (past --budget_s)")
    for batch, s in peer.items():
        line("peer", f"transformers eager batch {batch}", f"{s['ms']:.2f} ms")
    for batch, s in compiled.items():
        line("peer", f"transformers compiled batch {batch}", f"{s['ms']:.2f} ms (compile {s['warmup_s']:.0f} s)")
    for where, what in ((results.get("peer", {}), "transformers generate"),
                        (results.get("peer", {}).get("compiled", {}), "transformers compiled")):
        if "error" in where:
            line("peer", what, "error (see JSON)")
    profile = decode.get("profile") or {}
    if "idle_share" in profile:
        line("profile", f"default engine batch {profile['batch']}",
             f"idle {100 * profile['idle_share']:.0f}%, {profile['device_events_per_round']:.0f} kernels, "
             f"{profile['device_to_host_copies_per_round']:.1f} DtoH /round")
    steps = results.get("step_135m", [])
    for r in steps:
        fused = {True: "fused", False: "unfused"}.get(r.get("fused"), "")
        line("step_135m", f"{r['slots']} slots decode_steps={r['decode_steps']} {fused}",
             f"{r['ms']:.2f} ms/step (floor {r['roofline_ms']:.2f}), start-up {r['startup_s']:.1f} s")
    pair = {r.get("fused"): r["ms"] for r in steps if r["decode_steps"] == 1}
    if True in pair and False in pair:
        line("step_135m", "fused projections", f"{pair[False] / pair[True]:.2f}x the unfused step")
    for extra, rows in results.get("step_135m_flags", {}).items():
        for r in rows if isinstance(rows, list) else [{"error": True}]:
            case = f"{r.get('slots', '?')} slots decode_steps={r.get('decode_steps', '?')}, flags"
            line("step_135m", case, f"{r['ms']:.2f} ms/step under {extra}" if "ms" in r else f"{extra}: error (JSON)")
        if "idle_share" in r.get("profile", {}):
            p = r["profile"]
            line("profile", f"135m {r['slots']} slots", f"idle {100 * p['idle_share']:.0f}%, "
                 f"{p['device_events_per_round']:.0f} kernels, {p['device_to_host_copies_per_round']:.1f} DtoH /round")
    table_lines(results, line)
    return lines


def tuned_summary(launches: list[dict]) -> dict[str, str]:
    """kernel -> "N shapes: choice x count, ..." (the JSON has each shape's sweep)."""
    import collections

    by_kernel = collections.defaultdict(collections.Counter)
    for launch in launches:
        by_kernel[launch["kernel"]][launch["choice"]] += 1
    return {kernel: f"{sum(c.values())} shapes: " + ", ".join(f"{name} x{n}" for name, n in c.most_common(3))
            for kernel, c in by_kernel.items()}


def jax_platform() -> str:
    import jax

    return jax.default_backend()


def main(argv):
    del argv
    if FLAGS.peer_only:
        return peer_main(FLAGS.peer_only)
    from tqdm.auto import tqdm

    from cbjax.experimental import write_json

    start = time.perf_counter()
    deadline = start + FLAGS.budget_s
    sections = [s for s in SECTIONS if s in FLAGS.sections]
    results: dict = {"sections": sections, "tiny": FLAGS.tiny, "seconds": {}}
    printed: set = set()
    copy_GBps = 0.0
    # The peer first (SECTIONS' order), in its own process: JAX takes most of the device's
    # memory once it starts.
    for section in tqdm(sections, desc="sections"):
        if time.perf_counter() > deadline:
            results.setdefault("skipped", []).append(section)
            continue
        t0 = time.perf_counter()
        if section not in ("peer", "copy") and not copy_GBps:  # measured once, by the copy section if it ran
            copy_GBps = results.get("copy", {}).get("GBps") or copy_bandwidth(FLAGS.tiny)["GBps"]
        try:
            if section == "peer":
                results["peer"] = run_peer()
            elif section == "copy":
                results["copy"] = copy_bandwidth(FLAGS.tiny)
            elif section == "kernel":
                results["kernel"] = kernel_check()
            elif section == "kernel_bw":
                results["kernel_bw"] = kernel_bandwidth(copy_GBps)
            elif section == "decode_8b":
                results["decode_8b"] = decode_8b(copy_GBps, deadline)
            elif section in ("moe", "lora"):
                results[section] = (moe_decode if section == "moe" else lora_decode)(copy_GBps, FLAGS.tiny)
            elif section == "step_135m":
                results["step_135m"] = step_135m(copy_GBps)
                if FLAGS.step_xla_flags and (FLAGS.tiny or jax_platform() == "gpu"):
                    results["step_135m_flags"] = {extra: step_135m_under_flags(extra) for extra in FLAGS.step_xla_flags}
            elif section == "quant_8b":
                results["quant_8b"] = quant_8b(copy_GBps, deadline, results.get("quant_matmul", {}).get("best"))
            elif section == "quant_matmul":
                results["quant_matmul"] = quant_matmul(copy_GBps, deadline)
        except Exception as e:  # one section's failure still reports the others
            import traceback

            results[section + "_error"] = traceback.format_exc()[-2000:]
            print(f"{section} failed: {type(e).__name__}: {e}")
        results["seconds"][section] = time.perf_counter() - t0
        # Each section's lines and the JSON so far as soon as it ends: a run stopped at its time
        # limit (an 8B engine's autotuned compile can take minutes) still reports what it measured.
        fresh = [x for x in table(results) if x not in printed]
        printed.update(fresh)
        tqdm.write("\n".join(fresh))
        if FLAGS.output_json:
            write_json(FLAGS.output_json, results)
    import jax

    results["device"] = {"platform": jax.default_backend(), "kind": jax.devices()[0].device_kind,
                         "jax": jax.__version__, "python": sys.version.split()[0]}
    results["wall_s"] = time.perf_counter() - start
    print(f"{results['device']['kind']} ({results['device']['platform']}), JAX {jax.__version__}, "
          f"{results['wall_s']:.0f} s")
    print("\n".join(table(results)))  # the whole table again, in order
    if FLAGS.output_json:
        print(f"wrote {os.path.abspath(write_json(FLAGS.output_json, results))}")


if __name__ == "__main__":
    app.run(main)
