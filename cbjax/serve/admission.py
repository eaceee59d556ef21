"""What one request may cost the server, and what all pending ones may: the limits every
request is admitted against.

A request is counted by the work it brings, not by its HTTP call: `samples` is prompts x
`best_of` (else `n`), each a sequence the engine runs; `prompt_tokens` is what admission must
prefill. A request that alone exceeds a limit can never be admitted: a 400 naming the field
that makes it so. One that would exceed it beside the requests already pending waits its turn
at the client: a 429 with Retry-After. `prompt_logprobs` is priced by the entries it returns
(scored positions x (1 + k)), which also bounds its response.
"""

from __future__ import annotations

import dataclasses

from cbjax.serve.errors import APIError, bad


@dataclasses.dataclass(frozen=True)
class Cost:
    samples: int
    prompt_tokens: int


@dataclasses.dataclass
class Admission:
    max_pending: int | None = None  # samples held at once (waiting or running)
    max_pending_tokens: int | None = None  # prompt tokens held at once
    max_logprob_entries: int | None = 1 << 18  # prompt logprob entries one request may ask for
    samples: int = 0  # pending (touched on the event loop only)
    prompt_tokens: int = 0

    def cost(self, job) -> Cost:
        """A parsed job's cost; a 400 when it alone exceeds a limit."""
        k = job.sampling.prompt_logprobs
        scored = sum(len(p) for p in job.prompts)
        if k is not None and self.max_logprob_entries is not None and scored * (1 + k) > self.max_logprob_entries:
            field = "prompt_logprobs" if job.prompt_logprobs is not None else "echo"
            raise bad(f"prompt logprobs for {scored} prompt tokens with k={k} are {scored * (1 + k)} entries, more "
                      f"than this server returns per request ({self.max_logprob_entries}): fewer prompts, shorter "
                      f"ones or a smaller k", field)
        cost = Cost(len(job.prompts) * job.sampling.num_samples, scored)
        if self.max_pending is not None and cost.samples > self.max_pending:
            field = "best_of" if job.sampling.best_of else ("n" if job.sampling.n > 1 else "prompt")
            raise bad(f"{len(job.prompts)} prompts x {job.sampling.num_samples} samples = {cost.samples} sequences, "
                      f"more than this server holds at once ({self.max_pending})", field)
        if self.max_pending_tokens is not None and cost.prompt_tokens > self.max_pending_tokens:
            raise bad(f"{cost.prompt_tokens} prompt tokens, more than this server holds at once "
                      f"({self.max_pending_tokens})", "prompt")
        return cost

    def admit(self, cost: Cost) -> None:
        """Count `cost` in, or a 429 when the pending requests leave no room for it."""
        full = (self.max_pending is not None and self.samples + cost.samples > self.max_pending) or \
            (self.max_pending_tokens is not None and self.prompt_tokens + cost.prompt_tokens > self.max_pending_tokens)
        if full:
            raise APIError(429, f"the server holds {self.samples} sequences and {self.prompt_tokens} prompt tokens "
                                f"(limits {self.max_pending} and {self.max_pending_tokens}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        self.samples += cost.samples
        self.prompt_tokens += cost.prompt_tokens

    def release(self, cost: Cost) -> None:
        self.samples -= cost.samples
        self.prompt_tokens -= cost.prompt_tokens
