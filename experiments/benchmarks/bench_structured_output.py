"""What structured output costs: time per output token of JSON-schema requests against
unconstrained ones at the same batch size and the same token positions, through the server and
the official `openai` client, in one run.

Each round sends two batches of `--batch` concurrent streamed chat requests, in turn: one all
unconstrained (EOS ignored, `--max_tokens` each), one where half carry a random JSON schema
(`response_format` json_schema, `cbjax.workload.random_json_schema`) and half are unconstrained
as before. A constrained answer ends with its JSON, so it is compared with its partner in the
unconstrained batch (same index) over the same number of tokens: both ran in a full batch at the
same positions, and the difference is what the grammar costs (llguidance filling the masks
before each step, the masked program, one token per call and no run-ahead for the batch).
The unconstrained requests beside them are compared the same way. Every constrained answer is
checked against its schema.

    python -m experiments bench_structured_output
    python -m experiments bench_structured_output --batch=32 --num_slots=32 --rounds=3
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time

from absl import app, flags

from experiments.lib import common
from cbjax.experimental import define_engine_flags, engine_argv, engine_options, engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_integer("batch", 16, "Concurrent streams per batch (half constrained in the mixed batch).",
                     lower_bound=2)
flags.DEFINE_integer("rounds", 3, "Rounds; each sends an unconstrained batch and a mixed one, in turn.",
                     lower_bound=1)
flags.DEFINE_integer("max_tokens", 64, "Tokens per unconstrained answer (EOS ignored).", lower_bound=2)
flags.DEFINE_integer("schema_max_tokens", 256, "Budget of a constrained answer (it ends when its JSON does).",
                     lower_bound=2)
flags.DEFINE_integer("schema_seed", 0, "Seed of the random JSON schemas.")
flags.DEFINE_float("startup_timeout_s", 900.0, "How long to wait for the started server's /health.",
                   lower_bound=1.0)
flags.DEFINE_string("output_dir", "results/structured_output", "Where the JSON and the server log go.")
define_engine_flags(num_slots=16, max_seq_len=512)
flags.adopt_module_key_flags(engine_flags)

PARTNER = "grammar's partner alone"
NOUNS = ["cat", "city", "book", "planet", "song", "river", "robot", "garden", "ship", "museum", "recipe", "storm"]


async def _one(client, model: str, i: int, schema: dict | None):
    """A streamed chat request; returns (each output token's arrival time, text)."""
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}} \
        if schema is not None else {}
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Describe a {NOUNS[i % len(NOUNS)]} as JSON."}],
        max_tokens=FLAGS.schema_max_tokens if schema is not None else FLAGS.max_tokens, temperature=0,
        stream=True, extra_body=dict(body, ignore_eos=schema is None))
    times, text = [], ""
    async for chunk in stream:
        now = time.perf_counter()
        for c in chunk.choices:
            text += c.delta.content or ""
            times += [now] * len(getattr(c, "token_ids", None) or [])  # our extension: the chunk's tokens
    return times, text


def tpot_ms(times: list[float], tokens: int) -> float | None:
    """Mean gap between the first `tokens` output tokens, in ms."""
    tokens = min(tokens, len(times))
    return 1000 * (times[tokens - 1] - times[0]) / (tokens - 1) if tokens > 1 else None


async def _batch(url: str, model: str, schemas: list[dict | None]):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="cbjax", max_retries=0, timeout=3600)
    try:
        return await asyncio.gather(*(_one(client, model, i, s) for i, s in enumerate(schemas)))
    finally:
        await client.close()


def main(argv):
    del argv
    import jsonschema

    from cbjax.experimental import random_json_schema, write_json

    os.makedirs(FLAGS.output_dir, exist_ok=True)
    rng = random.Random(FLAGS.schema_seed)
    half = FLAGS.batch // 2
    log_path = os.path.join(FLAGS.output_dir, "server.log")
    process, url, startup_s = common.start_server(FLAGS.model, ["--served_model_name=bench", *engine_argv()],
                                                  log_path, FLAGS.startup_timeout_s)
    tpot = {"grammar": [], "grammar's partner alone": [], "beside grammar": [], "beside's partner alone": []}
    invalid, cut, lengths = 0, 0, []
    try:
        # Warm-up: the masked programs compile, llguidance reads the tokenizer.
        asyncio.run(_batch(url, "bench", [random_json_schema(rng)] + [None] * (FLAGS.batch - 1)))
        for r in range(FLAGS.rounds):
            alone = asyncio.run(_batch(url, "bench", [None] * FLAGS.batch))
            schemas = [random_json_schema(rng) for _ in range(half)] + [None] * (FLAGS.batch - half)
            mixed = asyncio.run(_batch(url, "bench", schemas))
            lengths += [len(t) for (t, _), s in zip(mixed, schemas) if s is not None]
            for (times, text), (partner, _), schema in zip(mixed, alone, schemas):
                # A constrained answer over its length; one beside them up to the shortest of them (where
                # every request of both batches still ran: the same batch size and positions).
                n = len(times) if schema is not None else min(len(t) for (t, _), s in zip(mixed, schemas) if s)
                pair = (tpot_ms(times, n), tpot_ms(partner, n))
                if None not in pair:
                    tpot["grammar" if schema is not None else "beside grammar"].append(pair[0])
                    tpot["grammar's partner alone" if schema is not None else "beside's partner alone"].append(pair[1])
                if schema is None:
                    continue
                try:
                    jsonschema.validate(json.loads(text), schema)
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    invalid += 1
                    cut += len(times) >= FLAGS.schema_max_tokens
            print(f"round {r + 1}: median TPOT grammar {statistics.median(tpot['grammar']):.1f} ms, its partners "
                  f"alone {statistics.median(tpot[PARTNER]):.1f} ms", flush=True)
    finally:
        process.terminate()
        process.wait(60)
    medians = {k: statistics.median(v) for k, v in tpot.items()}
    ratios = {"grammar / partner alone": medians["grammar"] / medians["grammar's partner alone"],
              "beside grammar / partner alone": medians["beside grammar"] / medians["beside's partner alone"]}
    lines = [f"{'requests':<28}{'median TPOT ms':>16}{'n':>6}", "-" * 50]
    lines += [f"{k:<28}{medians[k]:>16.2f}{len(tpot[k]):>6}" for k in tpot]
    lines.append(f"(over the constrained answers' lengths: median {statistics.median(lengths)} tokens)")
    lines += [f"{k}: {v:.3f}x" for k, v in ratios.items()]
    lines.append(f"constrained answers that fail their schema: {invalid} of {FLAGS.rounds * half} "
                 f"({cut} cut by schema_max_tokens)")
    table = "\n".join(lines)
    print("\n" + table)
    write_json(os.path.join(FLAGS.output_dir, "structured_output.json"),
               {"flags": common.script_flags(), "engine": engine_options(), "tpot_ms": tpot, "medians": medians,
                "ratios": ratios, "invalid": invalid, "startup_s": startup_s, "table": table})


if __name__ == "__main__":
    app.run(main)
