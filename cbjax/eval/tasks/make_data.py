"""Writes the local tasks' JSONL files (`python -m cbjax.eval.tasks.make_data`) from texts
already on the machine: the repository's public-domain text (experiments/data, the Gettysburg
Address, the Preamble and the opening of the Declaration of Independence) and the Zen of
Python (the standard library's `this`). Fixed seeds: the files it writes are the ones shipped."""

from __future__ import annotations

import codecs
import json
import os
import random
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "..", "..", "experiments", "data", "public_domain.txt")


def zen() -> list[str]:
    import this  # noqa: F401  (its text is rot13-encoded in `this.s`; importing it prints it)

    return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line]


def sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?:])\s+", " ".join(text.split()))
    return [p for p in parts if len(p.split()) >= 6]


def cloze(lines: list[str], rng: random.Random) -> list[dict]:
    """A sentence's last word among three other words of the texts: multiple choice."""
    words = sorted({w.strip(".,;:!?*-") for line in lines for w in line.split()} - {""})
    docs = []
    for line in lines:
        *head, last = line.split()
        answer = last.strip(".,;:!?*-")
        if not answer:
            continue
        others = rng.sample([w for w in words if w.lower() != answer.lower()], 3)
        choices = others + [answer]
        rng.shuffle(choices)
        docs.append({"context": " ".join(head), "choices": choices, "gold": choices.index(answer)})
    return docs


STOPS = (",", ";", ":", ".", "!", "?")


def recite(lines: list[str]) -> list[dict]:
    """A sentence's first half, and the rest of its clause (to the next punctuation mark):
    generation stopped there, scored by exact match."""
    docs = []
    for line in lines:
        words = line.split()
        half = max(len(words) // 2, 2)
        rest = " ".join(words[half:])
        answer = re.split("|".join(map(re.escape, STOPS)), rest)[0].strip()
        if answer:
            docs.append({"prompt": " ".join(words[:half]), "answer": answer})
    return docs


def main(argv: list[str]) -> None:
    with open(argv[0] if argv else TEXT) as f:
        text = f.read()
    lines = sentences(text) + zen()
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()] + ["\n".join(zen())]
    out = {"cloze": cloze(lines, random.Random(0)), "recite": recite(lines), "prose": [{"text": p} for p in paragraphs]}
    for name, docs in out.items():
        with open(os.path.join(HERE, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
        print(f"{name}.jsonl: {len(docs)} documents")


if __name__ == "__main__":
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        zen()  # (the first import of `this` prints the poem)
    main(sys.argv[1:])
