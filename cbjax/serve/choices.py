"""The choices of one API call: each prompt's `n` samples, each with its text stream, finish
reason and log-probabilities, indexed as OpenAI does (prompt i, sample j -> i * n + j)."""

from __future__ import annotations

import functools

from cbjax.serve import responses, tools
from cbjax.serve.detokenizer import TextStream
from cbjax.serve.protocol import Job


class Choices:
    def __init__(self, job: Job, tokenizer, request_ids: list[str]):
        self.job = job
        self.request_ids = request_ids  # the engine's request per prompt
        count = len(request_ids) * job.n
        self.streams = [TextStream(tokenizer, job.stop) for _ in range(count)]
        self.reasons: list[str | None] = [None] * count
        self.logprobs: list[list] = [[] for _ in range(count)]
        self.live = set(range(count))
        self.prompt_logprobs: list[list | None] = [None] * len(request_ids)  # per prompt, when asked
        self.prompts = [self._echo(tokenizer, p) if job.echo else "" for p in job.prompts]
        self._token_text = functools.lru_cache(maxsize=4096)(
            (lambda i: tokenizer.decode([i])) if tokenizer is not None else str)

    @staticmethod
    def _echo(tokenizer, prompt: list[int]) -> str:
        return tokenizer.decode(prompt, skip_special_tokens=True) if tokenizer is not None else ""

    def index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.job.n + sample_index

    def request_of(self, choice: int) -> tuple[str, int | None]:
        """The engine request of a choice and its sample index (None for a single sample)."""
        return self.request_ids[choice // self.job.n], (choice % self.job.n if self.job.n > 1 else None)

    def live_requests(self) -> set[str]:
        return {self.request_of(c)[0] for c in self.live}

    def prompt_text(self, choice: int) -> str:
        return self.prompts[choice // self.job.n]

    def logprobs_body(self, choice: int, new) -> dict | None:
        """The logprobs of a choice's `new` tokens (None when not asked for), recorded for
        the whole response too."""
        if new is None:
            return None
        offset = len(self.prompt_text(choice)) + sum(len(self._token_text(t.token_id))
                                                     for t in self.logprobs[choice])
        self.logprobs[choice] += new
        return responses.logprobs_body(self.job, new, self._token_text, offset)

    @property
    def calls_tools(self) -> bool:
        """Whether the answers are parsed for tool calls (chat with tools, tool_choice not "none")."""
        return self.job.tools is not None and self.job.tools.choice != "none"

    def message(self, c: int) -> tuple[str | None, list[dict], str | None]:
        """A finished choice's `(content, tool_calls, finish_reason)`: a complete answer that
        calls tools finishes with "tool_calls", as OpenAI's does."""
        text, reason = self.prompt_text(c) + self.streams[c].text, self.reasons[c]
        if not self.calls_tools:
            return text, [], reason
        content, calls = tools.parse_output(self.job.tools, text)
        return content, calls, ("tool_calls" if calls and reason == "stop" else reason)

    def note_prompt_logprobs(self, choice: int, logprobs) -> None:
        if logprobs is not None:
            self.prompt_logprobs[choice // self.job.n] = logprobs

    def _logprobs(self, c: int) -> dict | None:
        """A whole choice's logprobs; with echo, the prompt's tokens first (OpenAI's legacy format:
        the first prompt token's are null)."""
        job = self.job
        if job.sampling.logprobs is None:
            return None
        body = responses.logprobs_body(job, self.logprobs[c], self._token_text, len(self.prompt_text(c)))
        prompt = self.prompt_logprobs[c // job.n]
        if not job.echo or prompt is None:
            return body
        k = job.sampling.logprobs
        tokens = [self._token_text(t) for t in job.prompts[c // job.n]]
        offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        return {"tokens": tokens + body["tokens"],
                "token_logprobs": [None if t is None else t.logprob for t in prompt] + body["token_logprobs"],
                "top_logprobs": [None if t is None else {self._token_text(i): v for i, v in t.top[:k]}
                                 for t in prompt] + body["top_logprobs"],
                "text_offset": offsets + body["text_offset"]}

    def response_choices(self) -> list[dict]:
        out = [responses.choice(self.job, c, *self.message(c), s.token_ids, self._logprobs(c))
               for c, s in enumerate(self.streams)]
        if self.job.prompt_logprobs is not None:
            for c, body in enumerate(out):
                body["prompt_logprobs"] = responses.prompt_logprobs_body(
                    self.job.prompts[c // self.job.n], self.prompt_logprobs[c // self.job.n],
                    self.job.prompt_logprobs, self._token_text)
        return out

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.streams)
