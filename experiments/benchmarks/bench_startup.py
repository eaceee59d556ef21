"""How long `python -m cbjax.serve` takes to answer /health: the first launch (compiling every
program into an empty persistent cache) and the second (reading them back), plus the
engine's program count and where a start's time goes (load, warm-up).

Each launch is its own process with the same flags; the caches start empty (a temporary
CBJAX_CACHE_DIR, as on a new machine: see --fresh_caches) and the compilation cache is a fresh
temporary one unless --compilation_cache names one. The serve defaults are the engine
flags' (8 slots, 512 tokens).

    python -m experiments bench_startup
    python -m experiments bench_startup --model=smollm2-135m --num_slots=64 --max_seq_len=4096 --kv_cache=paged
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from absl import app, flags

from experiments.lib import common
from cbjax.experimental import define_engine_flags, engine_argv, engine_options, engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_integer("launches", 2, "Launches in a row over one cache (the first fills it).", lower_bound=1)
flags.DEFINE_float("startup_timeout_s", 900.0, "How long to wait for /health.", lower_bound=1.0)
flags.DEFINE_bool("fresh_caches", True, "Start from empty cbjax caches as on a new machine: compiled programs, "
                  "converted GGUF weights, the tokenizer, the CPU kernels (a temporary CBJAX_CACHE_DIR). False: "
                  "only the compilation cache starts empty; the rest is ~/.cache/cbjax's.")
flags.DEFINE_string("output_json", "results/bench_startup.json", "Where to write the results.")
define_engine_flags()
flags.adopt_module_key_flags(engine_flags)


def launch(cache_dir: str, log_path: str, cbjax_cache_dir: str | None) -> dict:
    env = {**os.environ, "CBJAX_COMPILATION_CACHE": cache_dir}
    if cbjax_cache_dir:
        env["CBJAX_CACHE_DIR"] = cbjax_cache_dir
    process, _, seconds = common.start_server(FLAGS.model, list(engine_argv()), log_path, FLAGS.startup_timeout_s,
                                              env=env)
    process.terminate()
    process.wait(timeout=60)
    log = open(log_path).read()
    found = re.search(r"compiled (\d+) programs in ([\d.]+)s", log)
    return {"health_s": round(seconds, 2), "programs": int(found[1]) if found else None,
            "warmup_s": float(found[2]) if found else None}


def main(argv):
    del argv
    cbjax_cache_dir = tempfile.mkdtemp(prefix="cbjax-startup-home-") if FLAGS.fresh_caches else None
    cache_dir = FLAGS.compilation_cache or tempfile.mkdtemp(prefix="cbjax-startup-cache-")
    log_dir = tempfile.mkdtemp(prefix="cbjax-startup-logs-")
    runs = []
    for i in range(FLAGS.launches):
        runs.append(launch(cache_dir, os.path.join(log_dir, f"server-{i}.log"), cbjax_cache_dir))
        print(f"launch {i + 1}: /health after {runs[-1]['health_s']:.1f}s ({runs[-1]['programs']} programs, "
              f"warm-up {runs[-1]['warmup_s']}s)", flush=True)
    common.write_json({"model": FLAGS.model, "engine": engine_options(), "cache_dir": cache_dir,
                       "fresh_caches": FLAGS.fresh_caches, "launches": runs}, FLAGS.output_json)
    if cbjax_cache_dir:
        shutil.rmtree(cbjax_cache_dir, ignore_errors=True)  # half a gigabyte of converted weights


if __name__ == "__main__":
    app.run(main)
