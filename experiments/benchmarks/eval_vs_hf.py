"""lm-eval through cbjax against lm-eval's own `hf` model, on the same checkpoint and tasks:
agreement (accuracy, every example's log-likelihood, the greedy generations) and speed
(examples a second per task type, at the backend's defaults and at more slots).

    python -m experiments eval_vs_hf                           # SmolLM2-135M (f32), the offline tasks
    python -m experiments eval_vs_hf --model=/path/hf_dir --tasks=cbjax_cloze --slots=default,64

Each side runs every task once on its first `--warmup` documents before the timed run (cbjax
compiles its step programs there); the timed run is lm-eval's `simple_evaluate` of the whole
task. The `hf` model gets the same tokenizer object as cbjax and the same `max_length`.
"""

from __future__ import annotations

import time

from experiments.lib import common  # noqa: F401  (quiets transformers and matplotlib)

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset with a transformers twin, Hugging Face directory or .gguf file.")
flags.DEFINE_list("tasks", ["cbjax_cloze", "cbjax_recite", "cbjax_prose"],
                  "lm-eval tasks (the offline ones ship in cbjax/eval/tasks).")
flags.DEFINE_list("slots", ["default", "32"], "cbjax's num_slots per run ('default': the backend's defaults).")
flags.DEFINE_integer("max_seq_len", 512, "cbjax's max_seq_len; the hf model's max_length matches it.", lower_bound=8)
flags.DEFINE_integer("hf_batch_size", 8, "The hf model's batch size.", lower_bound=1)
flags.DEFINE_integer("limit", None, "Documents per task (default: all).", lower_bound=1)
flags.DEFINE_integer("warmup", 4, "Documents per task run first, untimed.", lower_bound=0)
flags.DEFINE_float("tolerance", 1e-3, "Largest log-likelihood difference counted as agreement.")
flags.DEFINE_string("output_json", "results/eval_vs_hf.json", "Where the result goes.")


def evaluate(lm, task: str, manager) -> tuple[dict, float]:
    """(lm-eval's output with its samples, seconds) of the task, after an untimed warm-up."""
    import lm_eval

    def run(limit):
        return lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True, limit=limit,
                                       bootstrap_iters=0, verbosity="WARNING")

    if FLAGS.warmup:
        run(FLAGS.warmup)
    start = time.perf_counter()
    out = run(FLAGS.limit)
    return out, time.perf_counter() - start


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
            before = lm.llm.load()
            out, seconds = evaluate(lm, task, manager)
            after = lm.llm.load()
            queries = after.prefix_queries - before.prefix_queries
            runs.setdefault(task, {})[f"cbjax/{slots}"] = dict(
                out=out, seconds=seconds, num_slots=info.num_slots,
                prefix_hit_rate=(after.prefix_hits - before.prefix_hits) / queries if queries else None)
        del lm
    peer = load_peer(FLAGS.model)
    if peer is None:
        raise app.UsageError(f"{FLAGS.model} has no transformers twin to compare with")
    hf = HFLM(pretrained=peer, tokenizer=tokenizer, batch_size=FLAGS.hf_batch_size, max_length=FLAGS.max_seq_len - 2,
              device="cpu", dtype="float32")
    for task in FLAGS.tasks:
        out, seconds = evaluate(hf, task, manager)
        runs[task]["hf"] = dict(out=out, seconds=seconds)

    result = {"model": FLAGS.model, "max_seq_len": FLAGS.max_seq_len, "hf_batch_size": FLAGS.hf_batch_size,
              **torch_settings, "tasks": {}}
    print(f"\n{'task':<14}{'type':<24}{'docs':>5}{'hf ex/s':>9}" + "".join(f"{'cbjax ' + s:>13}{'x hf':>6}"
                                                                      for s in FLAGS.slots)
          + f"{'max |dLL|':>11}{'metrics':>8}{'greedy':>7}{'gens':>5}{'prefix hits':>12}")
    for task, by_run in runs.items():
        hf_run = by_run["hf"]
        kind = hf_run["out"]["configs"][task]["output_type"]
        row = {"output_type": kind, "hf_examples_per_s": None, "runs": {}}
        docs = len(hf_run["out"]["samples"][task])
        row["hf_examples_per_s"] = docs / hf_run["seconds"]
        line = f"{task:<14}{kind:<24}{docs:>5}{row['hf_examples_per_s']:>9.2f}"
        checks = None
        for slots in FLAGS.slots:
            mine = by_run[f"cbjax/{slots}"]
            rate = docs / mine["seconds"]
            checks = agreement(mine["out"], hf_run["out"], task)
            row["runs"][slots] = dict(examples_per_s=rate, vs_hf=rate / row["hf_examples_per_s"],
                                      num_slots=mine["num_slots"], prefix_hit_rate=mine["prefix_hit_rate"], **checks)
            line += f"{rate:>13.2f}{rate / row['hf_examples_per_s']:>6.2f}"
        hits = row["runs"][FLAGS.slots[0]]["prefix_hit_rate"]
        line += (f"{checks['max_abs_loglikelihood_diff']:>11.1e}{str(checks['metrics_equal']):>8}"
                 f"{str(checks['greedy_equal']):>7}{str(checks['generations_equal']):>5}"
                 f"{'' if hits is None else f'{100 * hits:.0f}%':>12}")
        print(line)
        result["tasks"][task] = row
    write_json(FLAGS.output_json, result)
    print(f"wrote {FLAGS.output_json}")


if __name__ == "__main__":
    app.run(main)
