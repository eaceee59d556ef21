"""The device benchmark, one command: how close cbjax runs to the memory roofline of the
accelerator it is on, and what limits it.

In one run, each against a figure measured in the same run:
- copy: the device-to-device copy bandwidth (bytes read plus written over time): the roofline;
- kernel: the ragged attention kernel against its pure-JAX reference on the real platform
  (head sizes 64/80/96/128, f32 and bf16, decodes beside prefill chunks, sliding windows);
- kernel_bw: the kernel's KV bandwidth (live K/V bytes over its time) on a mixed batch (32
  decodes at 1,000-4,000 tokens beside two 256-token prefill chunks) and on decodes at 2,048
  and 4,096 tokens, for two page sizes and several keys per step, against the copy;
- decode_8b: a Llama-3-8B-shaped bf16 model (weights drawn on the device), decode time per
  step at 1, 16 and 64 sequences for each cache layout and attention (the defaults first),
  against (weights + live KV bytes) / copy bandwidth, and each engine's start-up (build and
  compile every program); a profile of the default engine's decode steps (device time per
  kernel, the device's idle share, host syncs);
- step_135m: a SmolLM2-135M-shaped bf16 step at 64 slots (512-token prompts), where weights
  and KV are ~0.3 ms of traffic on a GPU: the overhead floor;
- quant_8b, quant_matmul: int8 and fp8 weights against bf16, the engine and its matmuls
  (experiments/device_quant.py);
- peer: transformers `generate` (eager) on the same device and shapes, per decode step,
  run first in a subprocess (before JAX takes the device's memory).

Runs from the tree on a bare GPU machine (`PYTHONPATH=. python experiments/bench_device.py`)
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

import common  # noqa: F401  (quiets transformers and matplotlib)
from absl import app, flags

from device_common import (LLAMA3_8B, TINY, batches, budget, build_engine, decode_ms, decode_shape, decode_steps,
                           device_model, roofline_ms, timed_ms)
from device_quant import quant_8b, quant_matmul, table_lines
from device_trace import summarise_trace

FLAGS = flags.FLAGS
# In the order they run (the peer first: see main), the must-have figures before the sweeps.
SECTIONS = ("peer", "copy", "kernel", "quant_matmul", "quant_8b", "step_135m", "decode_8b", "kernel_bw")
ENGINES = ("slots/auto", "paged/auto", "slots/reference", "paged/reference")
flags.DEFINE_list("sections", list(SECTIONS), f"Sections to run, of {', '.join(SECTIONS)}.")
flags.DEFINE_list("engines", list(ENGINES), "decode_8b's engines as kv_cache/attention, in order (the defaults, "
                  "slots/auto, first).")
flags.DEFINE_bool("profile", True, "Profile the default engine's decode steps (jax.profiler) and summarise them.")
flags.DEFINE_float("budget_s", 330.0, "Start no further engine or section past this many seconds (the table "
                   "says what was skipped).", lower_bound=1.0)
flags.DEFINE_string("output_json", "results/bench_device.json", "Where the results go.")
flags.DEFINE_string("peer_only", None, "Internal: run only the transformers peer and write its JSON here.")
flags.register_validator("sections", lambda v: set(v) <= set(SECTIONS), f"--sections: of {', '.join(SECTIONS)}")
flags.register_validator("engines", lambda v: all(e in ENGINES for e in v), f"--engines: of {', '.join(ENGINES)}")


# ---------------------------------------------------------------- sections
def copy_bandwidth() -> dict:
    import jax
    import jax.numpy as jnp

    x = jnp.arange((1 << 28) if not FLAGS.tiny else (1 << 18), dtype=jnp.float32)  # 1 GiB on a device
    ms = timed_ms(jax.jit(lambda a: a * 2.0), x, reps=20)
    return {"bytes": 2 * x.nbytes, "ms": ms, "GBps": 2 * x.nbytes / ms / 1e6}


def kernel_cases() -> list[dict]:
    if FLAGS.tiny:
        return [dict(head_dim=16, dtype="float32", page=8, mix="mixed", window=0),
                dict(head_dim=24, dtype="float32", page=8, mix="mixed", window=20)]
    cases = []
    for head_dim in (64, 80, 96, 128):
        for dtype, page in (("float32", 8), ("bfloat16", 16)):
            cases.append(dict(head_dim=head_dim, dtype=dtype, page=page, mix="decodes", window=0))
            cases.append(dict(head_dim=head_dim, dtype=dtype, page=page, mix="mixed", window=48))
    return cases


def kernel_batch(rng, seqs, q_heads, kv_heads, head_dim, dtype, page):
    """A ragged batch for `seqs` [(q_len, kv_len)]: shuffled pages, random q/k/v on the device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    pages_per_seq = max(-(-kv // page) for _, kv in seqs)
    num_pages = len(seqs) * pages_per_seq
    table = rng.permutation(num_pages).reshape(len(seqs), pages_per_seq).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    q = jax.random.normal(keys[0], (int(cu[-1]), q_heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (kv_heads, num_pages, page, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (kv_heads, num_pages, page, head_dim), jnp.float32).astype(dtype)
    lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    return q, k, v, lens, jnp.asarray(table), jnp.asarray(cu)


def kernel_check() -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference

    interpret = jax.default_backend() == "cpu"
    rng = np.random.default_rng(0)
    rows = []
    for case in kernel_cases():
        seqs = ([(1, int(n)) for n in rng.integers(1, 300 if not FLAGS.tiny else 40, 12)] if case["mix"] == "decodes"
                else [(1, 200), (37, 37), (16, 120), (1, 1), (60, 300), (1, 64)] if not FLAGS.tiny
                else [(1, 30), (7, 7), (5, 21)])
        args = kernel_batch(rng, seqs, 32 if not FLAGS.tiny else 4, 8 if not FLAGS.tiny else 2, case["head_dim"],
                            jnp.dtype(case["dtype"]), case["page"])
        scale = case["head_dim"] ** -0.5
        out = ragged_paged_attention(*args, scale=scale, window=case["window"], interpret=interpret)
        ref = reference(*(a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in args), scale,
                        window=case["window"])
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        error = float(np.abs(out - ref).max() / np.abs(ref).max())
        tolerance = 5e-3 if case["dtype"] == "float32" else 3e-2  # tf32 / bf16 operands
        rows.append({**case, "rel_error": error, "ok": bool(np.isfinite(error) and error < tolerance)})
    return rows


def kernel_variants(group: int) -> list[tuple]:
    """(keys per step, block_q, num_stages) to time, None for the kernel's own choice: the
    default first, then wider steps, the smallest query tile (block_q x group = 16 rows: a
    decode wastes no rows) and deeper pipelining."""
    if FLAGS.tiny:
        return [(None, None, None), (16, max(16 // group, 1), None)]
    least = max(16 // group, 1)
    return [(None, None, None), (128, None, 2), (256, None, 2), (None, least, 2), (None, least, 3), (128, least, 3)]


def kernel_bandwidth(copy_GBps: float) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    interpret = jax.default_backend() == "cpu"
    rng = np.random.default_rng(1)
    heads = (32, 8, 128) if not FLAGS.tiny else (4, 2, 16)
    big = not FLAGS.tiny
    batches_ = {
        "mixed": [(1, int(n)) for n in rng.integers(1000, 4001, 32)] + [(256, 2048), (256, 1280)] if big
        else [(1, 40), (1, 64), (16, 48)],
        "decode-2048": [(1, 2048)] * 64 if big else [(1, 64)] * 4,
        "decode-4096": [(1, 4096)] * 64 if big else [(1, 128)] * 4,
    }
    rows = []
    for name, seqs in batches_.items():
        for page in ((16, 64) if big else (8,)):
            args = kernel_batch(rng, seqs, *heads, jnp.bfloat16 if big else jnp.float32, page)
            live = sum(kv for _, kv in seqs) * heads[1] * heads[2] * args[1].dtype.itemsize * 2
            for keys, block_q, stages in kernel_variants(heads[0] // heads[1]):
                per_block = max(keys // page, 1) if keys else None
                fn = jax.jit(functools.partial(ragged_paged_attention, scale=0.1, pages_per_block=per_block,
                                               block_q=block_q, num_stages=stages, interpret=interpret))
                variant = {"batch": name, "page": page, "keys_per_step": keys or "auto", "block_q": block_q or "auto",
                           "num_stages": stages or "auto"}
                try:
                    ms = timed_ms(fn, *args)
                except Exception as e:  # a tile too large for this device's shared memory, say
                    rows.append({**variant, "error": str(e)[:200]})
                    continue
                rows.append({**variant, "ms": ms, "GBps": live / ms / 1e6, "of_copy": live / ms / 1e6 / copy_GBps})
            del args
    return rows


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
        row = {"engine": name, "attention_run": llm.engine.attention, "startup_s": startup,
               "steps": decode_steps(llm, model, copy_GBps)}
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

    from cbjax.loading.presets import RANDOM_PRESETS

    shape = dataclasses.asdict(RANDOM_PRESETS["smollm2-135m-random"])
    model = device_model(shape if not FLAGS.tiny else TINY, seed=1)
    slots, prompt_len, warm, timed = (64, 512, 4, FLAGS.timed_steps) if not FLAGS.tiny else (4, 16, 2, 4)
    rows = []
    for decode_steps in (1, 4):
        llm, startup = build_engine(model, "slots", "auto", slots, budget(prompt_len, warm, timed, decode_steps),
                                    decode_steps=decode_steps)
        ms = decode_ms(llm, slots, prompt_len, warm, timed)
        rows.append({"decode_steps": decode_steps, "slots": slots, "ms": ms, "startup_s": startup,
                     "attention_run": llm.engine.attention,
                     "roofline_ms": roofline_ms(model, slots, prompt_len + warm, copy_GBps)})
        if FLAGS.profile and decode_steps == 1:  # where an overhead-bound step's time goes
            rows[-1]["profile"] = profiled_decode(llm, slots, prompt_len, warm, timed)
        del llm
    return rows


# ---------------------------------------------------------------- the transformers peer
def peer_main(path: str) -> None:
    """transformers `generate` (eager, greedy) per decode step: the difference between two
    output lengths over the steps between them, at each batch size."""
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
    rows = {}
    for batch in batches():
        ids = torch.randint(10, shape["vocab_size"] - 10, (batch, prompt_len), device=device)

        def run(n):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        run(short)
        rows[batch] = {"ms": 1e3 * (run(long) - run(short)) / (long - short)}
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                   "transformers": transformers.__version__, "steps": rows}, f)


def run_peer() -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = [sys.executable, os.path.abspath(__file__), f"--peer_only={path}", f"--prompt_len={FLAGS.prompt_len}",
            f"--batches={','.join(FLAGS.batches)}"] + (["--tiny"] if FLAGS.tiny else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout)[-600:]}
    with open(path) as f:
        out = json.load(f)
    os.unlink(path)
    return out


# ---------------------------------------------------------------- main
def table(results: dict) -> list[str]:
    """The printed table: one line per figure."""
    lines = [f"{'section':<11}{'case':<34}{'figure':>44}"]

    def line(section, case, figure):
        lines.append(f"{section:<11}{case:<34}{figure:>44}")

    if "copy" in results:
        line("copy", "device to device", f"{results['copy']['GBps']:.0f} GB/s")
    for r in results.get("kernel", []):
        line("kernel", f"hd{r['head_dim']} {r['dtype']} page{r['page']} {r['mix']} w{r['window']}",
             f"rel err {r['rel_error']:.1e} {'ok' if r['ok'] else 'FAIL'}")
    for r in results.get("kernel_bw", []):
        figure = (f"{r['ms']:.3f} ms {r['GBps']:.0f} GB/s ({100 * r['of_copy']:.0f}% of copy)" if "ms" in r
                  else "error")
        line("kernel_bw", f"{r['batch']} p{r['page']} k{r['keys_per_step']} q{r['block_q']} s{r['num_stages']}",
             figure)
    peer = results.get("peer", {}).get("steps", {})
    decode = results.get("decode_8b", {})
    for row in decode.get("rows", []):
        line("decode_8b", f"{row['engine']} ({row['attention_run']}) start-up", f"{row['startup_s']:.1f} s")
        for batch, s in row["steps"].items():
            vs = peer.get(str(batch), peer.get(batch))
            ratio = f", {vs['ms'] / s['ms']:.1f}x transformers" if vs else ""
            line("decode_8b", f"{row['engine']} batch {batch}",
                 f"{s['ms']:.2f} ms ({100 * s['of_roofline']:.0f}% of roofline{ratio})")
    for name in decode.get("skipped", []):
        line("decode_8b", name, "skipped (past --budget_s)")
    for batch, s in peer.items():
        line("peer", f"transformers generate batch {batch}", f"{s['ms']:.2f} ms")
    if "error" in results.get("peer", {}):
        line("peer", "transformers generate", "error (see JSON)")
    profile = decode.get("profile") or {}
    if "idle_share" in profile:
        line("profile", f"default engine batch {profile['batch']}",
             f"idle {100 * profile['idle_share']:.0f}%, {profile['device_events_per_round']:.0f} kernels, "
             f"{profile['device_to_host_copies_per_round']:.1f} DtoH /round")
    for r in results.get("step_135m", []):
        line("step_135m", f"{r['slots']} slots decode_steps={r['decode_steps']}",
             f"{r['ms']:.2f} ms/step (floor {r['roofline_ms']:.2f}), start-up {r['startup_s']:.1f} s")
        if "idle_share" in r.get("profile", {}):
            p = r["profile"]
            line("profile", f"135m {r['slots']} slots", f"idle {100 * p['idle_share']:.0f}%, "
                 f"{p['device_events_per_round']:.0f} kernels, {p['device_to_host_copies_per_round']:.1f} DtoH /round")
    table_lines(results, line)
    return lines


def main(argv):
    del argv
    if FLAGS.peer_only:
        return peer_main(FLAGS.peer_only)
    from tqdm.auto import tqdm

    from cbjax.metrics import write_json

    start = time.perf_counter()
    deadline = start + FLAGS.budget_s
    sections = [s for s in SECTIONS if s in FLAGS.sections]
    results: dict = {"sections": sections, "tiny": FLAGS.tiny, "seconds": {}}
    printed: set = set()
    # The peer first (SECTIONS' order), in its own process: JAX takes most of the device's
    # memory once it starts.
    for section in tqdm(sections, desc="sections"):
        if time.perf_counter() > deadline:
            results.setdefault("skipped", []).append(section)
            continue
        t0 = time.perf_counter()
        copy_GBps = results.get("copy", {}).get("GBps") or (copy_bandwidth()["GBps"] if section != "peer" else 0)
        try:
            if section == "peer":
                results["peer"] = run_peer()
            elif section == "copy":
                results["copy"] = copy_bandwidth()
            elif section == "kernel":
                results["kernel"] = kernel_check()
            elif section == "kernel_bw":
                results["kernel_bw"] = kernel_bandwidth(copy_GBps)
            elif section == "decode_8b":
                results["decode_8b"] = decode_8b(copy_GBps, deadline)
            elif section == "step_135m":
                results["step_135m"] = step_135m(copy_GBps)
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
