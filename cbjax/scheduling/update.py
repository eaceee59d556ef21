"""A round's results into the scheduler's requests: the one record path whatever the round's
kind. Each row's tokens (a prompt row's first, a decode row's per step, a verify row's accepted
ones), its logprobs, speculation's outcome per verify row, the stop decisions, and the
requests whose structured-output matcher failed."""

from __future__ import annotations

import dataclasses

import numpy as np

from cbjax.request import FinishReason, Request, RequestState, TokenLogprob
from cbjax.scheduling.plan import Plan, RoundResult, Row


@dataclasses.dataclass
class Outcome:
    requests: list[Request]  # the requests the round touched (got tokens or finished)
    decode_tokens: int = 0  # tokens its decode rows sampled
    decode_steps: int = 0  # decode steps its calls ran


def update_round(sched, plan: Plan, result: RoundResult) -> Outcome:
    """Hand each row's tokens to the scheduler: prompt rows first, so a request whose prompt
    ended this round is running when its decode tokens are recorded."""
    touched: dict[str, Request] = {}
    decoded: list[tuple[Request, list[int], object]] = []
    slots, speculator, now = sched.slots, sched.speculator, result.now
    for call in result.calls:
        for members, out, logprobs in call.pieces:
            tokens = out[:, :, 0].T.tolist()  # each row's tokens: one conversion a call, not a view a row
            for j, i in enumerate(members):
                if i < 0:
                    continue  # a piece of a prompt chunk that continues in a later call
                row = call.rows[i]
                if row.decodes:  # whoever holds the slot now (a row dispatched ahead names no request)
                    holder = slots[row.slot]
                    if holder is not None:
                        decoded.append((holder, tokens[j], None if logprobs is None
                                        or holder.sampling.logprobs is None else logprobs[:, j]))
                        if row.verify:
                            kept = len(tokens[j]) - tokens[j].count(-1) - 1
                            speculator.record(holder, row.num_tokens - 1, kept)
                else:
                    _prefill_row(sched, row, tokens[j][0], bool(out[0, j, 1]), now, touched)
                    if logprobs is not None and row.is_last:
                        add_logprobs(row.request, logprobs[0, j][None])
    outcome = Outcome([])
    if decoded:
        verified = any(r.verify for call in result.calls for r in call.rows)  # a verify call is one step
        _decode_rows(sched, decoded, now, touched, outcome, 1 if verified else None)
    if speculator is not None:  # (a call run ahead: the seconds since the last record, what overlap makes a round)
        speculator.after_round([call.rows for call in plan.calls], None if plan.prefills else now - plan.time,
                               plan.in_flight)
    outcome.requests = list(touched.values())
    end_failed_constraints(sched, outcome.requests, now)
    return outcome


def _prefill_row(sched, chunk: Row, token: int, device_done: bool, now: float, touched: dict[str, Request]) -> None:
    """A prompt chunk's result; the device's and the scheduler's stop decisions must agree."""
    finished = record_prefill(sched, chunk, token if chunk.is_last else -1, now)
    r = chunk.request
    if chunk.is_last and r.prompt_scores is not None and r.prompt_logprobs is None:  # scored by now
        r.prompt_logprobs = r.prompt_scores.entries()
    if chunk.is_last:
        if device_done != finished:
            raise RuntimeError(f"engine and scheduler disagree on whether {chunk.request.request_id!r} finished")
        touched[chunk.request.request_id] = chunk.request


def _decode_rows(sched, decoded, now: float, touched: dict[str, Request], outcome: Outcome,
                 device_steps: int | None) -> None:
    """Decode rows' tokens (`decoded`: (request, `[steps]` tokens, -1 where the row did not
    sample, logprob columns or None)) recorded as the scheduler's `[steps][slots]`.
    `device_steps`: the steps the calls ran, when not one per token (a verify call's rows
    bring up to 1 + k tokens from one step)."""
    steps = max(len(tokens) for _, tokens, _ in decoded)
    per_slot = [[-1] * len(sched.slots) for _ in range(steps)]
    # Rows of requests that finished before this record (their first token was their last,
    # or an earlier call ended them) come back -1 and are skipped.
    running = [d for d in decoded if d[0].state == RequestState.RUNNING]
    for r, tokens, _ in running:
        if tokens[0] < 0:
            raise RuntimeError(f"engine and scheduler out of sync: slot {r.slot} produced no token "
                               f"for running request {r.request_id!r}")
        for step, token in enumerate(tokens):
            per_slot[step][r.slot] = token
        outcome.decode_tokens += len(tokens) - tokens.count(-1)
    record_decode(sched, per_slot, now, device_steps)
    for r, tokens, logprobs in running:
        if logprobs is not None:
            add_logprobs(r, logprobs[np.asarray(tokens) >= 0])
        touched[r.request_id] = r
    outcome.decode_steps += steps if device_steps is None else device_steps


def record_prefill(sched, chunk: Row, token: int, now: float) -> bool:
    """Record a prefill chunk; for the last one, the first token. True if it finished."""
    r = chunk.request
    if r.finished:
        return False
    r.num_prefilled = chunk.start + chunk.length
    if sched.pages is not None:
        sched.pages.register(r.request_id, r.prefill_token_ids, r.num_prefilled)
    if not chunk.is_last:
        return False
    r.state = RequestState.RUNNING
    return _append(sched, r, token, now)


def record_decode(sched, tokens_per_step, now: float, device_steps: int | None = None) -> list[Request]:
    """Record a decode call's tokens, `[steps][slots]` with -1 for idle slots (`device_steps`:
    the steps it ran, when fewer: a verified proposal brings several tokens from one).
    Returns the requests that finished."""
    finished = []
    steps = len(tokens_per_step) if device_steps is None else device_steps
    sched.num_decode_steps += steps
    sched.admission.on_decode(steps, bool(sched.waiting))
    running = RequestState.RUNNING
    for step_tokens in tokens_per_step:
        for r, token in zip(sched.slots, step_tokens):
            if token < 0 or r is None or r.state != running:
                continue
            if _append(sched, r, int(token), now):
                finished.append(r)
    return finished


def _append(sched, r: Request, token: int, now: float) -> bool:
    reason = sched.tokens.append(r, token, now)
    if reason is not None:
        sched.finish(r, reason, now)
    return reason is not None


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


def end_failed_constraints(sched, touched: list[Request], now: float) -> None:
    """End with an error the requests whose structured-output matcher failed this round (past
    its work bounds, cbjax/grammar.py): its mask then allowed only EOS, so the answer would
    otherwise end as a truncated "stop" that breaks its own constraint. One still holding its
    slot is deactivated on the device before the next round's calls."""
    for r in touched:
        error = r.grammar.error if r.grammar is not None and r.finish_reason != FinishReason.ABORT else None
        if error is None:
            continue
        if r.finished:
            r.finish_reason, r.error = FinishReason.ERROR, error
        else:
            sched.preempted_slots.append(r.slot)
            sched.finish(r, FinishReason.ERROR, now, error)
