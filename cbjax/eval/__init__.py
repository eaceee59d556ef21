"""Evaluation through EleutherAI's lm-evaluation-harness: importing this package registers the
`cbjax` model (backend.py) with lm-eval; `python -m cbjax.eval` is lm-eval's command line with
it registered and `--model cbjax` the default, and the tasks shipped in `TASKS_DIR` (tasks/: a multiple-choice,
a generation and a perplexity task that run offline, tagged `cbjax_local`) on its task path."""

import os

from cbjax.eval.backend import CbjaxLM

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")

__all__ = ["CbjaxLM", "TASKS_DIR"]
