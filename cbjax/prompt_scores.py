"""A request's prompt logprobs as the batched step computes them (`SamplingParams.prompt_logprobs`).

A prompt row of a request that asks for them names the tokens whose next prompt token is still
to be scored (`targets`); the step's program for such calls returns their columns (the
target's log-probability, its rank, the top k), which fill this record (`fill`) until
every position from `first` on is scored. The prompt's earlier tokens, which nothing asks a
score for, are free for the prefix cache to serve (`reusable`): that is how a task's shared
context is computed once. A position scored twice (a preempted request prefilled again, a
fork of a sibling that scored it) keeps its first score.
"""

from __future__ import annotations

import numpy as np

from cbjax.request import TokenLogprob


class PromptScores:
    def __init__(self, prompt: list[int], k: int, first: int = 1):
        """`k`: the likeliest tokens kept per position; `first`: the first position scored
        (position 0 has no score: nothing predicts it)."""
        self.prompt = np.asarray(prompt, np.int32)
        self.k = k
        self.first = min(max(first, 1), len(prompt))
        self.logprob = np.zeros(len(prompt), np.float32)
        self.rank = np.zeros(len(prompt), np.int32)
        self.top_values = np.zeros((len(prompt), k), np.float32)
        self.top_ids = np.zeros((len(prompt), k), np.int32)
        self.scored = np.zeros(len(prompt), bool)
        self.scored[:self.first] = True

    @property
    def done(self) -> bool:
        return bool(self.scored.all())

    @property
    def reusable(self) -> int:
        """Leading prompt tokens the prefix cache may serve: all but the one before the first
        position still to score (whose logits score it)."""
        missing = np.flatnonzero(~self.scored)
        return len(self.prompt) if len(missing) == 0 else int(missing[0]) - 1

    def targets(self, start: int, count: int) -> np.ndarray:
        """`[count]` int32: for the tokens at positions start..start+count-1, the next prompt
        token where its score is still missing, else -1."""
        nexts = np.arange(start + 1, start + count + 1)
        inside = nexts < len(self.prompt)
        wanted = np.zeros(count, bool)
        wanted[inside] = ~self.scored[nexts[inside]]
        return np.where(wanted, self.prompt[np.minimum(nexts, len(self.prompt) - 1)], -1).astype(np.int32)

    def fill(self, positions: np.ndarray, columns: np.ndarray) -> None:
        """The step's columns (`[n, 2 + 2K]`: log-probability, rank, K top values, K top ids,
        K >= k) for the tokens at `positions` (`[n]`): each scores the position after it."""
        width = (columns.shape[1] - 2) // 2
        positions = np.asarray(positions) + 1
        keep = positions < len(self.prompt)
        positions, columns = positions[keep], columns[keep]
        keep = ~self.scored[positions]
        positions, columns = positions[keep], columns[keep]
        self.logprob[positions], self.rank[positions] = columns[:, 0], columns[:, 1].astype(np.int32)
        self.top_values[positions] = columns[:, 2:2 + self.k]
        self.top_ids[positions] = columns[:, 2 + width:2 + width + self.k].astype(np.int32)
        self.scored[positions] = True

    def entries(self) -> list[TokenLogprob | None]:
        """Each prompt position's `TokenLogprob`, None before `first`."""
        if not self.done:
            raise RuntimeError(f"prompt positions {np.flatnonzero(~self.scored)[:8].tolist()} were never scored")
        out: list[TokenLogprob | None] = [None] * self.first
        for p in range(self.first, len(self.prompt)):
            top = tuple(zip(self.top_ids[p].tolist(), self.top_values[p].tolist()))
            out.append(TokenLogprob(int(self.prompt[p]), float(self.logprob[p]), top, rank=int(self.rank[p])))
        return out
