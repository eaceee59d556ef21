"""The live requests of a front (`RequestBook`), and parallel sampling: a request with `n`
(or `best_of`) samples as one group of requests (`SampleGroups`).

Sample i is its own `Request` with seed `seed + i`, so it draws what a single request
with that seed would. Every sample after the first forks the first one's prompt (the
scheduler copies its KV instead of prefilling it: shared pages on the paged cache, a
slot copy on the slot cache). Outputs carry the group's id and the sample's `index`.
With `best_of > n` nothing streams: when every sample has finished, the `n` with the
highest cumulative log-probability come back, best first.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib

from cbjax.request import Request, RequestOutput, SamplingParams, request_output


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


class RequestBook:
    """A front's live requests: waiting, running, or finished but not yet handed back. A
    finished request is released once an output with its finish has been handed back (step,
    generate, replay, abort), so a long-running front holds only what is in flight."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.seed = seed  # a request's seed, unless it chose one, is drawn from this and its id
        self.requests: dict[str, Request] = {}
        self.unreturned: list[Request] = []  # finished inside another call's loop
        self._emitted: dict[str, int] = {}  # tokens streamed so far, by request id
        self.groups = SampleGroups()  # requests with n > 1 samples
        self._ids = itertools.count()

    def new_id(self, chosen: str | int | None) -> str:
        """A new request's id: `chosen` (refused if live), or the next automatic one that is free
        (automatic ids share the namespace of the ids users choose)."""
        if chosen is not None:
            if self.live(str(chosen)):
                raise ValueError(f"duplicate request id {str(chosen)!r}")
            return str(chosen)
        while (request_id := str(next(self._ids))) in self.requests:
            pass
        return request_id

    def seed_of(self, request_id: str, sampling: SamplingParams) -> int:
        return sampling.seed if sampling.seed is not None else \
            zlib.crc32(f"{self.seed}:{request_id}".encode()) & 0x7FFFFFFF

    def sample_ids(self, request_id: str, n: int) -> list[str]:
        """The request ids of a group's `n` samples."""
        children = [f"{request_id}/{i}" for i in range(n)]
        if any(c in self.requests for c in children):
            raise ValueError(f"request id {request_id!r} clashes with a live request's samples")
        return children

    def live(self, request_id: str) -> bool:
        """Whether `request_id` (a request, or a group of samples) is still live."""
        return request_id in self.requests or self.groups.live(request_id)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._emitted[request.request_id] = 0

    def release(self, request: Request, output: RequestOutput) -> RequestOutput:
        del self.requests[request.request_id]
        del self._emitted[request.request_id]
        return output

    def output(self, r: Request, stream: bool = False) -> RequestOutput:
        since = None
        if stream:
            since, self._emitted[r.request_id] = self._emitted.get(r.request_id, 0), len(r.output_token_ids)
        return request_output(r, self.tokenizer, since)

    def final_output(self, request_id: str) -> RequestOutput:
        """A finished request's (or group's) output, released."""
        if self.groups.live(request_id):
            return self.groups.collect(request_id, self.final_output)
        r = self.requests[request_id]
        return self.release(r, self.output(r))

    def hand_back(self, requests: list[Request], stream: bool) -> list[RequestOutput]:
        """Outputs of `requests` (the finished ones released), a group's samples under its id."""
        outputs = []
        for r in requests:
            output = self.output(r, stream=stream)
            if r.finished:
                self.release(r, output)
            if r.request_id in self.groups.sample_of:
                outputs += self.groups.on_output(r.request_id, output)
            else:
                outputs.append(output)
        return outputs

    def keep_others(self, ids: list[str | None], finished: list[Request]) -> None:
        """Keep for the next `step()` the requests that finished while a call for `ids` drove the
        loop but are not among them (added online meanwhile)."""
        mine = set(ids)
        self.unreturned += [r for r in finished if r.request_id not in mine
                            and self.groups.sample_of.get(r.request_id, ("",))[0] not in mine]

    def take_unreturned(self) -> list[Request]:
        unreturned, self.unreturned = self.unreturned, []
        return unreturned

    def to_abort(self, request_id: str, index: int | None) -> list[Request]:
        """The live requests an abort of `request_id` names (a group's: sample `index`, or all)."""
        group = self.groups.groups.get(request_id)
        if group is not None:
            ids = group.children if index is None else group.children[index:][:1]
            live = [self.requests[c] for c in ids if c in self.requests and not self.requests[c].finished]
            if not live:
                raise ValueError(f"cannot abort unknown or finished sample {index} of {request_id!r}")
            return live
        request = self.requests.get(request_id)
        if request is None or request.finished:
            raise ValueError(f"cannot abort unknown or finished request {request_id!r}")
        return [request]

    def aborted_outputs(self, request_id: str, aborted: list[Request]) -> list[RequestOutput]:
        """The final outputs of the requests `to_abort` named, released (a group's relabelled)."""
        raw = [self.release(r, self.output(r)) for r in aborted]
        if request_id not in self.groups.groups:
            return raw
        outputs = [self.groups.relabel(o) for o in raw]  # before the group's last sample drops it
        for r, o in zip(aborted, raw):
            self.groups.on_output(r.request_id, o)
        return outputs
