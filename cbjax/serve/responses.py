"""The OpenAI wire format's response bodies: whole responses, streamed chunks, usage and
logprobs (what protocol.py's jobs come back as)."""

from __future__ import annotations

import time
import uuid

from cbjax.serve.protocol import Job


def new_id(job: Job) -> str:
    return f"{job.id_prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(job: Job, response_id: str, choices: list[dict], usage_body: dict) -> dict:
    """A whole (non-streamed) response; `choices` as from `choice(...)`."""
    kind = "text_completion" if job.kind == "completion" else "chat.completion"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": job.model,
            "choices": choices, "usage": usage_body}


def logprobs_body(job: Job, logprobs, token_text, text_offset: int = 0) -> dict | None:
    """OpenAI's logprobs of a choice's tokens (`TokenLogprob`s, None when not asked for):
    completions' parallel lists, or chat's `content` entries. `token_text(id)` is a token's text."""
    if logprobs is None:
        return None
    if job.kind == "completion":
        tokens = [token_text(t.token_id) for t in logprobs]
        offsets = [text_offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": [{token_text(i): v for i, v in t.top} for t in logprobs], "text_offset": offsets}

    def entry(token_id, logprob):
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [dict(entry(t.token_id, t.logprob), top_logprobs=[entry(i, v) for i, v in t.top])
                        for t in logprobs]}


def prompt_logprobs_body(prompt: list[int], logprobs, k: int, token_text) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` of a choice: per prompt position (null for the first), the prompt
    token and the k likeliest, each `{token id: {logprob, rank, decoded_token}}`."""
    if logprobs is None:
        return None
    out: list[dict | None] = [None]
    for token, t in zip(prompt[1:], logprobs[1:]):
        entry = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": token_text(i)} for r, (i, v) in
                 enumerate(t.top[:k])}
        entry[str(token)] = {"logprob": t.logprob, "rank": t.rank, "decoded_token": token_text(token)}
        out.append(entry)
    return out


def choice(job: Job, index: int, text: str | None, tool_calls: list[dict], reason: str | None,
           token_ids: list[int], logprobs=None) -> dict:
    if job.kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason, "token_ids": token_ids}
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason,
            "token_ids": token_ids}


def chunk(job: Job, response_id: str, index: int, text: str | None, reason: str | None,
          token_ids: list[int], first: bool = False, logprobs=None, tool_calls: list[dict] | None = None) -> dict:
    """One streamed event for one choice (tool calls come whole, each with its `index`)."""
    if job.kind == "completion":
        body = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason,
                "token_ids": token_ids}
        kind = "text_completion"
    else:
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(tool_calls)]
        body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                "token_ids": token_ids}
        kind = "chat.completion.chunk"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": job.model,
            "choices": [body]}


def usage_chunk(job: Job, response_id: str, usage_body: dict) -> dict:
    kind = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": job.model,
            "choices": [], "usage": usage_body}
