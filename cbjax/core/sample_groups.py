"""Parallel sampling: a request with `n` (or `best_of`) samples as one group of requests.

Sample i is its own `Request` with seed `seed + i`, so it draws what a single request
with that seed would. Every sample after the first forks the first one's prompt (the
scheduler copies its KV instead of prefilling it: shared pages on the paged cache, a
slot copy on the slot cache). Outputs carry the group's id and the sample's `index`.
With `best_of > n` nothing streams: when every sample has finished, the `n` with the
highest cumulative log-probability come back, best first.
"""

from __future__ import annotations

import dataclasses

from cbjax.request import RequestOutput, SamplingParams


@dataclasses.dataclass
class _Group:
    children: list[str]  # the samples' request ids, by index
    sampling: SamplingParams  # as the user asked
    finished: dict[int, RequestOutput] = dataclasses.field(default_factory=dict)

    @property
    def holds_back(self) -> bool:
        return self.sampling.num_samples > self.sampling.n


class SampleGroups:
    def __init__(self):
        self.groups: dict[str, _Group] = {}
        self.sample_of: dict[str, tuple[str, int]] = {}  # sample's request id -> (group id, index)

    @staticmethod
    def sample_params(sampling: SamplingParams, seed: int) -> list[SamplingParams]:
        """Each sample's parameters: one sample, seed `seed + i`; best_of needs every sample's
        log-probability even when the user asked for none."""
        logprobs = sampling.logprobs
        if logprobs is None and sampling.num_samples > sampling.n:
            logprobs = 0
        return [dataclasses.replace(sampling, n=1, best_of=None, seed=(seed + i) & 0x7FFFFFFF, logprobs=logprobs)
                for i in range(sampling.num_samples)]

    def add(self, group_id: str, children: list[str], sampling: SamplingParams) -> None:
        self.groups[group_id] = _Group(children, sampling)
        for i, child in enumerate(children):
            self.sample_of[child] = (group_id, i)

    def live(self, group_id: str) -> bool:
        return group_id in self.groups

    def relabel(self, output: RequestOutput) -> RequestOutput:
        """A sample's output under its group's id and its index; logprobs only if asked for."""
        group_id, index = self.sample_of[output.request_id]
        output = dataclasses.replace(output, request_id=group_id, index=index)
        if self.groups[group_id].sampling.logprobs is None:
            output = dataclasses.replace(output, logprobs=None)
        return output

    def on_output(self, sample_id: str, output: RequestOutput) -> list[RequestOutput]:
        """What to hand back now for a sample's (streamed) output: itself, or, with best_of,
        nothing until the group is complete and then its best `n`."""
        group_id, index = self.sample_of[sample_id]
        group = self.groups[group_id]
        output = self.relabel(output)
        if output.finished:
            group.finished[index] = output
        if not group.holds_back:
            if len(group.finished) == len(group.children):
                self._drop(group_id)
            return [output]
        if len(group.finished) < len(group.children):
            return []
        self._drop(group_id)
        return self.best(group)

    def collect(self, group_id: str, output_of) -> RequestOutput:
        """The group's output for `generate`: sample 0's fields, every sample in `samples`.
        `output_of(sample_id)`: a finished sample's output (the front releases it)."""
        group = self.groups[group_id]
        group.finished.update((i, self.relabel(output_of(c))) for i, c in enumerate(group.children))
        self._drop(group_id)
        samples = self.best(group) if group.holds_back else [group.finished[i] for i in range(len(group.children))]
        return dataclasses.replace(samples[0], samples=samples)

    @staticmethod
    def best(group: _Group) -> list[RequestOutput]:
        """The `n` finished samples of highest cumulative log-probability, re-indexed, each whole
        (relabelled outputs: logprobs already left out unless asked for)."""
        ranked = sorted(group.finished.values(), key=lambda o: -(o.cumulative_logprob or 0.0))[:group.sampling.n]
        return [dataclasses.replace(o, index=i, new_token_ids=list(o.token_ids)) for i, o in enumerate(ranked)]

    def _drop(self, group_id: str) -> None:
        for child in self.groups.pop(group_id).children:
            del self.sample_of[child]
