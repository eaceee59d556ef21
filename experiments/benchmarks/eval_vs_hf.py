"""lm-eval through cbjax against lm-eval's own `hf` model, on the same checkpoint and tasks:
agreement (accuracy, every example's log-likelihood, the greedy generations) and speed
(examples a second per task type, at the backend's defaults and at more slots).

    python -m experiments eval_vs_hf                           # SmolLM2-135M (f32), the offline tasks
    python -m experiments eval_vs_hf --model=/path/hf_dir --tasks=cbjax_cloze --slots=default,64

Each side runs each whole task `--repeats` times through lm-eval's `simple_evaluate`: the first
run is cold (cbjax compiles its step programs in it, a few seconds each on a CPU; JAX's
persistent cache keeps them for the next process), the last warm. The `hf` model gets the same
tokenizer object as cbjax and the same `max_length`.
"""

from __future__ import annotations

import time

from experiments.lib import common

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset with a transformers twin, Hugging Face directory or .gguf file.")
flags.DEFINE_list("tasks", ["cbjax_cloze", "cbjax_recite", "cbjax_prose"],
                  "lm-eval tasks (the offline ones ship in cbjax/eval/tasks).")
flags.DEFINE_list("slots", ["default", "32"], "cbjax's num_slots per run ('default': the backend's defaults).")
flags.DEFINE_integer("max_seq_len", 512, "cbjax's max_seq_len; the hf model's max_length matches it.", lower_bound=8)
flags.DEFINE_integer("hf_batch_size", 8, "The hf model's batch size.", lower_bound=1)
flags.DEFINE_integer("limit", None, "Documents per task (default: all).", lower_bound=1)
flags.DEFINE_integer("repeats", 2, "Timed runs of each task on each side (the first cold, the last warm).",
                     lower_bound=1)
flags.DEFINE_float("tolerance", 1e-3, "Largest log-likelihood difference counted as agreement.")
flags.DEFINE_bool("served", False, "Also run lm-eval's local-completions against `python -m cbjax.serve` (its own "
                  "tokenizer through /tokenize), at the backend's defaults, and compare it the same way.")
flags.DEFINE_integer("concurrency", 8, "local-completions' concurrent requests (--served).", lower_bound=1)
flags.DEFINE_string("output_json", "results/eval_vs_hf.json", "Where the result goes.")


def evaluate(lm, task: str, manager) -> tuple[dict, list[float], float | None]:
    """(lm-eval's output of the last run, with its samples; the seconds of each run; for cbjax,
    the prefix cache's hit rate in the first run, the one that found the cache empty of it)."""
    import lm_eval

    seconds, hit_rate = [], None
    for i in range(FLAGS.repeats):
        before = lm.llm.load() if hasattr(lm, "llm") else None
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True,
                                      limit=FLAGS.limit, bootstrap_iters=0, verbosity="WARNING")
        seconds.append(time.perf_counter() - start)
        if i == 0 and before is not None:
            after = lm.llm.load()
            queries = after.prefix_queries - before.prefix_queries
            hit_rate = (after.prefix_hits - before.prefix_hits) / queries if queries else None
    return out, seconds, hit_rate


def numbers(sample: dict) -> tuple[list[float], list, list[str]]:
    """An example's log-likelihoods, is-greedy flags and generated texts, from its responses."""
    lls, greedy, texts = [], [], []
    for resp in sample["filtered_resps"]:
        resp = resp[0] if isinstance(resp, list) and len(resp) == 1 else resp
        if isinstance(resp, str):
            texts.append(resp)
        elif isinstance(resp, (tuple, list)):
            lls.append(float(resp[0]))
            greedy.append(bool(resp[1]))
        else:
            lls.append(float(resp))
    return lls, greedy, texts


def agreement(ours: dict, theirs: dict, task: str) -> dict:
    """Metrics equal, the largest log-likelihood difference, is-greedy and generations equal."""
    mine = {s["doc_id"]: numbers(s) for s in ours["samples"][task]}
    hers = {s["doc_id"]: numbers(s) for s in theirs["samples"][task]}
    worst, greedy_same, texts_same, over = 0.0, True, True, 0
    for doc, (lls, greedy, texts) in mine.items():
        h_lls, h_greedy, h_texts = hers[doc]
        diffs = [abs(a - b) for a, b in zip(lls, h_lls)]
        worst = max([worst, *diffs])
        over += sum(d > FLAGS.tolerance for d in diffs)
        greedy_same &= greedy == h_greedy
        texts_same &= texts == h_texts
    metrics = {k: v for k, v in ours["results"][task].items() if not k.endswith("stderr,none") and k != "alias"}
    same_metrics = all(theirs["results"][task].get(k) == v for k, v in metrics.items()
                       if not ("perplexity" in k or "bits_per_byte" in k))
    return dict(examples=len(mine), metrics=metrics, hf_metrics={k: theirs["results"][task].get(k) for k in metrics},
                metrics_equal=same_metrics, max_abs_loglikelihood_diff=worst, loglikelihoods_over_tolerance=over,
                greedy_equal=greedy_same, generations_equal=texts_same)


def sides() -> list[str]:
    """The cbjax runs compared with hf: one per `--slots`, and "served"."""
    return [*FLAGS.slots, *(["served"] if FLAGS.served else [])]


def serve_tasks(runs: dict, manager) -> None:
    """Each task through `python -m cbjax.serve` and lm-eval's local-completions (run "served")."""
    import os
    import tempfile

    from lm_eval.models.openai_completions import LocalCompletionsAPI

    log = os.path.join(tempfile.gettempdir(), "eval_vs_hf_server.log")
    process, url, _ = common.start_server(FLAGS.model, [f"--max_seq_len={FLAGS.max_seq_len}", "--kv_cache=paged",
                                                        "--enable_prefix_caching", "--nowarmup"], log, 600)
    try:
        api = LocalCompletionsAPI(model=FLAGS.model, base_url=url + "/v1/completions", tokenizer_backend="remote",
                                  tokenized_requests=True, max_length=FLAGS.max_seq_len - 2,
                                  num_concurrent=FLAGS.concurrency, batch_size=1)
        for task in FLAGS.tasks:
            out, seconds, _ = evaluate(api, task, manager)
            runs[task]["cbjax/served"] = dict(out=out, seconds=seconds, num_slots=None, prefix_hit_rate=None)
    finally:
        process.terminate()
        process.wait(timeout=60)


def main(argv):
    del argv
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from cbjax.eval import TASKS_DIR, CbjaxLM
    from cbjax.experimental import write_json
    from experiments.lib.hf_peers import configure_torch, load_peer

    manager = TaskManager(include_path=TASKS_DIR)
    torch_settings = configure_torch()
    runs: dict[str, dict] = {}
    tokenizer = None
    for slots in FLAGS.slots:
        kwargs = {} if slots == "default" else {"num_slots": int(slots)}
        lm = CbjaxLM(FLAGS.model, max_seq_len=FLAGS.max_seq_len, **kwargs)
        tokenizer = lm.tokenizer
        info = lm.llm.engine_info
        for task in FLAGS.tasks:
            out, seconds, hit_rate = evaluate(lm, task, manager)
            runs.setdefault(task, {})[f"cbjax/{slots}"] = dict(out=out, seconds=seconds, num_slots=info.num_slots,
                                                               prefix_hit_rate=hit_rate)
        del lm
    if FLAGS.served:
        serve_tasks(runs, manager)
    peer = load_peer(FLAGS.model)
    if peer is None:
        raise app.UsageError(f"{FLAGS.model} has no transformers twin to compare with")
    hf = HFLM(pretrained=peer, tokenizer=tokenizer, batch_size=FLAGS.hf_batch_size, max_length=FLAGS.max_seq_len - 2,
              device="cpu", dtype="float32")
    for task in FLAGS.tasks:
        out, seconds, _ = evaluate(hf, task, manager)
        runs[task]["hf"] = dict(out=out, seconds=seconds)

    result = {"model": FLAGS.model, "max_seq_len": FLAGS.max_seq_len, "hf_batch_size": FLAGS.hf_batch_size,
              "repeats": FLAGS.repeats, **torch_settings, "tasks": {}}
    print(f"\n{'task':<14}{'type':<23}{'docs':>5}{'hf ex/s':>9}"
          + "".join(f"{'cbjax ' + s + ' cold':>19}{'warm':>7}{'x hf':>6}" for s in sides())
          + f"{'max |dLL|':>10}{'metrics':>8}{'greedy':>7}{'gens':>6}{'prefix hits':>12}")
    for task, by_run in runs.items():
        hf_run = by_run["hf"]
        kind = hf_run["out"]["configs"][task]["output_type"]
        docs = len(hf_run["out"]["samples"][task])
        hf_rate = docs / hf_run["seconds"][-1]
        row = {"output_type": kind, "documents": docs, "hf_examples_per_s": hf_rate,
               "hf_seconds": hf_run["seconds"], "runs": {}}
        line = f"{task:<14}{kind:<23}{docs:>5}{hf_rate:>9.2f}"
        checks = None
        for slots in sides():
            mine = by_run[f"cbjax/{slots}"]
            cold, warm = docs / mine["seconds"][0], docs / mine["seconds"][-1]
            checks = agreement(mine["out"], hf_run["out"], task)
            row["runs"][slots] = dict(examples_per_s_cold=cold, examples_per_s_warm=warm, warm_vs_hf=warm / hf_rate,
                                      seconds=mine["seconds"], num_slots=mine["num_slots"],
                                      prefix_hit_rate=mine["prefix_hit_rate"], **checks)
            line += f"{cold:>19.2f}{warm:>7.2f}{warm / hf_rate:>6.2f}"
        hits = row["runs"][FLAGS.slots[0]]["prefix_hit_rate"]
        line += (f"{checks['max_abs_loglikelihood_diff']:>10.1e}{str(checks['metrics_equal']):>8}"
                 f"{str(checks['greedy_equal']):>7}{str(checks['generations_equal']):>6}"
                 f"{'' if hits is None else f'{100 * hits:.0f}%':>12}")
        print(line)
        result["tasks"][task] = row
    write_json(FLAGS.output_json, result)
    print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
    app.run(main)
