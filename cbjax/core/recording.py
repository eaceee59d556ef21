"""A round's results into the scheduler, the one record path whatever the round's kind: each
row's tokens (a prompt row's first, a decode row's per step, a verify row's accepted ones),
its logprobs, and speculation's outcome per verify row."""

from __future__ import annotations

import numpy as np

from cbjax.core.step_stats import StepStats
from cbjax.request import Request, RequestState, TokenLogprob
from cbjax.runtime.step import split_logprobs
from cbjax.scheduling import Row


def record_round(scheduler, stats: StepStats, num_slots: int, speculator, calls, host, now: float,
                 touched: dict[str, Request]) -> None:
    """Hand each row's tokens in `host` (every call's result, copied to the host at once) to the
    scheduler: prompt rows first, so a request whose prompt ended this round is running when
    its decode tokens are recorded. `speculator`: the core's, or None."""
    decoded: list[tuple[Request, list[int], object]] = []
    slots = scheduler.slots
    for (dispatched, rows), outs in zip(calls, host):
        for (_, members), out in zip(dispatched, outs):
            out, logprobs = split_logprobs(out)
            tokens = out[:, :, 0].T.tolist()  # each row's tokens: one conversion a call, not a view a row
            for j, i in enumerate(members):
                if i < 0:
                    continue  # a piece of a prompt chunk that continues in a later call
                row = rows[i]
                if row.decodes:  # whoever holds the slot now (a row dispatched ahead names no request)
                    holder = slots[row.slot]
                    if holder is not None:
                        decoded.append((holder, tokens[j], None if logprobs is None
                                        or holder.sampling.logprobs is None else logprobs[:, j]))
                        if row.verify:
                            kept = len(tokens[j]) - tokens[j].count(-1) - 1
                            speculator.record(holder, row.num_tokens - 1, kept)
                else:
                    record_prefill(scheduler, row, tokens[j][0], bool(out[0, j, 1]), now, touched)
                    if logprobs is not None and row.is_last:
                        add_logprobs(row.request, logprobs[0, j][None])
    if decoded:
        verified = any(r.verify for _, rows in calls for r in rows)  # a verify call is one step
        record_decodes(scheduler, stats, num_slots, decoded, now, touched, 1 if verified else None)


def record_prefill(scheduler, chunk: Row, token: int, device_done: bool, now: float,
                   touched: dict[str, Request]) -> None:
    """A prompt chunk's result; the device's and the scheduler's stop decisions must agree."""
    finished = scheduler.on_prefill(chunk, token if chunk.is_last else -1, now)
    if chunk.is_last:
        if device_done != finished:
            raise RuntimeError(f"engine and scheduler disagree on whether {chunk.request.request_id!r} finished")
        touched[chunk.request.request_id] = chunk.request


def add_logprobs(r: Request, columns) -> None:
    """Attach logprob columns (`[n, 1 + 2 max_logprobs]`, one per token the call sampled for
    `r`, in order) to the output tokens that have none yet; a request that asked for none
    gets none."""
    k = r.sampling.logprobs
    if k is None:
        return
    width = (columns.shape[-1] - 1) // 2 if len(columns) else 0
    start = len(r.logprobs)
    for token, row in zip(r.output_token_ids[start:], columns):
        top = tuple((int(i), float(v)) for v, i in zip(row[1:1 + k], row[1 + width:1 + width + k]))
        r.logprobs.append(TokenLogprob(token, float(row[0]), top))


def record_decodes(scheduler, stats: StepStats, num_slots: int, decoded, now: float,
                   touched: dict[str, Request], device_steps: int | None = None) -> None:
    """Decode rows' tokens (`decoded`: (request, `[steps]` tokens, -1 where the row did not
    sample, logprob columns or None)) handed to `scheduler` as its `[steps][slots]`.
    `device_steps`: the steps the calls ran, when not one per token (a verify call's rows
    bring up to 1 + k tokens from one step)."""
    steps = max(len(tokens) for _, tokens, _ in decoded)
    per_slot = [[-1] * num_slots for _ in range(steps)]
    # Rows of requests that finished before this record (their first token was their last,
    # or an earlier call ended them) come back -1 and are skipped.
    running = [d for d in decoded if d[0].state == RequestState.RUNNING]
    sampled = 0
    for r, tokens, _ in running:
        if tokens[0] < 0:
            raise RuntimeError(f"engine and scheduler out of sync: slot {r.slot} produced no token "
                               f"for running request {r.request_id!r}")
        slot = r.slot
        for step, token in enumerate(tokens):
            per_slot[step][slot] = token
        sampled += len(tokens) - tokens.count(-1)
    scheduler.on_decode(per_slot, now, device_steps)
    for r, tokens, logprobs in running:
        if logprobs is not None:
            add_logprobs(r, logprobs[np.asarray(tokens) >= 0])
        touched[r.request_id] = r
    stats.active_slot_steps += sampled
    stats.decode_steps += steps if device_steps is None else device_steps
