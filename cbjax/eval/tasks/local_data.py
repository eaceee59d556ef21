"""The local tasks' data sets (their YAML's `custom_dataset`): the JSONL files beside this one,
read with no network (make_data.py wrote them), and the perplexity task's results."""

from __future__ import annotations

import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))


def _split(name: str):
    import datasets

    with open(os.path.join(HERE, f"{name}.jsonl")) as f:
        return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(line) for line in f])})


def cloze(**_):
    return _split("cloze")


def recite(**_):
    return _split("recite")


def prose(**_):
    return _split("prose")


def perplexity_results(doc: dict, results) -> dict:
    """wikitext's metrics: the document's log-likelihood over its words and its bytes."""
    (loglikelihood,) = results
    words, size = len(re.split(r"\s+", doc["text"])), len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, size),
            "bits_per_byte": (loglikelihood, size)}
