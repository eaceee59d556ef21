"""Host/device overlap: the host time each decode round leaves exposed, with overlap off and on.

For each number of sequences (default 8 and 64; one slot each, every prompt
admitted in the first round), greedy with EOS ignored, this times the decode-only
rounds of `LLM.step()` with `overlap=False` and `overlap=True` (EngineCore runs the
next decode call ahead while the host records the one in flight), and, on the
same engine, the same decode calls dispatched back to back with no host work
between them: the device's busy time. Exposed host time per round = (round wall
time - device busy time) / rounds. Beside it, the host's own work per decode step
(scheduling and recording, `StepStats.host_ms_per_decode_step`: what the device would
idle for without overlap) and the building of the streamed outputs. Also checks that
both runs produced the same tokens.

    python -m experiments bench_overlap
    python -m experiments bench_overlap --model=tiny-llama --sequences=8,64,256
"""

from __future__ import annotations

import platform
import time

from experiments.lib import common  # noqa: F401  (quiets transformers and matplotlib)

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory or .gguf file.")
flags.DEFINE_list("sequences", ["8", "64"], "Numbers of sequences decoded together (one slot each).")
common.validate_list("sequences", int, 1, "positive integers")
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per sequence.", lower_bound=1)
flags.DEFINE_integer("new_tokens", 64, "Generated tokens per sequence.", lower_bound=3)
flags.DEFINE_integer("repeats", 3, "Timed runs per setting (the median is kept).", lower_bound=1)
flags.DEFINE_string("output_json", "results/bench_overlap.json", "Where to write the results.")


def decode_rounds(llm, prompts, sampling) -> tuple[float, int, list[list[int]], float, float]:
    """Admit every prompt, run the first round (prefills and the first decode), then time
    the remaining rounds. Returns (seconds, rounds timed, token ids per request, host ms per
    decode step, ms per round building outputs)."""
    ids = [llm.add_request(p, sampling) for p in prompts]
    outputs = {o.request_id: o for o in llm.step() if o.finished}
    llm.reset_stats()
    rounds, t0 = 0, time.perf_counter()
    while llm.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)
        rounds += 1
    seconds = time.perf_counter() - t0
    stats = llm.stats
    # What `LLM.step` does past the engine core's round: the streamed outputs.
    outputs_s = seconds - stats.schedule_s - stats.dispatch_s - stats.device_wait_s - stats.process_s
    return (seconds, rounds, [outputs[i].token_ids for i in ids], stats.host_ms_per_decode_step(),
            1000 * outputs_s / rounds)


def device_busy(llm, calls: int) -> float:
    """The same decode calls dispatched back to back, synced once: seconds of device work.
    (Finished slots are inactive, but the step computes every slot all the same.)"""
    import jax

    from cbjax.experimental import profile, Row

    with profile.engine_lent(llm) as engine:
        jax.block_until_ready(engine.state)  # anything still in flight from the last run
        decodes = [Row(s, [], 0) for s in range(engine.num_slots)]
        t0 = time.perf_counter()
        out = None
        for i in range(calls):
            out = engine.run(decodes)
        jax.block_until_ready(out)
        return time.perf_counter() - t0


def measure(model, n: int) -> dict:
    import numpy as np

    from cbjax import LLM, SamplingParams

    rng = np.random.default_rng(n)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, FLAGS.prompt_len).tolist() for _ in range(n)]
    sampling = SamplingParams(max_tokens=FLAGS.new_tokens, ignore_eos=True)
    max_seq_len = FLAGS.prompt_len + FLAGS.new_tokens + 16
    row, tokens = {"sequences": n}, {}
    for overlap in (False, True):
        llm = LLM(model, num_slots=n, max_seq_len=max_seq_len, overlap=overlap)
        decode_rounds(llm, prompts, sampling)  # compiles every bucket
        runs = []
        for _ in range(FLAGS.repeats):
            seconds, rounds, tokens[overlap], host_ms, outputs_ms = decode_rounds(llm, prompts, sampling)
            busy = device_busy(llm, rounds)
            runs.append((seconds, busy, rounds, host_ms, outputs_ms))
        seconds, busy, rounds, host_ms, outputs_ms = sorted(runs)[len(runs) // 2]
        key = "on" if overlap else "off"
        row[f"host_ms_per_step_{key}"] = host_ms
        row[f"outputs_ms_{key}"] = outputs_ms
        row[f"round_ms_{key}"] = 1000 * seconds / rounds
        row[f"device_ms_{key}"] = 1000 * busy / rounds
        row[f"exposed_host_ms_{key}"] = 1000 * (seconds - busy) / rounds
        row[f"rounds_{key}"] = rounds
    row["same_tokens"] = tokens[False] == tokens[True]
    return row


def main(argv):
    del argv
    from cbjax.experimental import load_model

    model = load_model(FLAGS.model, dtype="float32")
    rows = []
    for n in map(int, FLAGS.sequences):
        rows.append(measure(model, n))
        r = rows[-1]
        print(f"{n:4d} sequences: round {r['round_ms_off']:7.2f} -> {r['round_ms_on']:7.2f} ms, device "
              f"{r['device_ms_off']:7.2f} / {r['device_ms_on']:7.2f} ms, exposed host {r['exposed_host_ms_off']:6.2f} "
              f"-> {r['exposed_host_ms_on']:6.2f} ms per round, host work {r['host_ms_per_step_off']:.3f} / "
              f"{r['host_ms_per_step_on']:.3f} ms a step; same tokens: {r['same_tokens']}", flush=True)
    print("\n| sequences | round ms off | round ms on | on / off | device ms off | device ms on "
          "| exposed host ms off | exposed host ms on | host work ms a step off / on | outputs ms a round on |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['sequences']} | {r['round_ms_off']:.2f} | {r['round_ms_on']:.2f} | "
              f"{r['round_ms_on'] / r['round_ms_off']:.2f}x | {r['device_ms_off']:.2f} | {r['device_ms_on']:.2f} | "
              f"{r['exposed_host_ms_off']:.2f} | {r['exposed_host_ms_on']:.2f} | "
              f"{r['host_ms_per_step_off']:.3f} / {r['host_ms_per_step_on']:.3f} | {r['outputs_ms_on']:.2f} |")
    common.write_json({"machine": platform.platform(), "model": FLAGS.model, "prompt_len": FLAGS.prompt_len,
                       "new_tokens": FLAGS.new_tokens, "repeats": FLAGS.repeats, "rows": rows}, FLAGS.output_json)


if __name__ == "__main__":
    app.run(main)
