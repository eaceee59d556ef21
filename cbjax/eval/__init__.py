"""Evaluation through EleutherAI's lm-evaluation-harness: importing this package registers the
`cbjax` model (backend.py) with lm-eval; `python -m cbjax.eval` is lm-eval's command line with
it registered and `--model cbjax` the default."""

from cbjax.eval.backend import CbjaxLM

__all__ = ["CbjaxLM"]
