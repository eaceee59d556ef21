"""Forks: the samples of one prompt (n > 1) after the first copy its prompt's KV instead of
prefilling it. A fork waits while the sibling it copies is still prefilling their prompt;
once that sibling holds all but the prompt's last token in the cache, the fork takes the
same leading tokens (the paged cache's full pages by reference, the partial one copied;
the slot cache's whole slot copied) and prefills only the last token, which samples its
first output with its own seed."""

from __future__ import annotations

from cbjax.request import Request


def fork_point(r: Request) -> int | None:
    """How many leading tokens `r` copies from its sibling now, or None if it cannot."""
    src, shared = r.fork_of, r.prompt_len - 1
    if src is None or src.slot is None or src.finished or src.num_prefilled < shared or shared < 1:
        return None
    return shared


def fork_gone(r: Request) -> bool:
    """Whether `r` prefills its own prompt: it forks nothing, or its sibling will never hold
    the prompt again (finished), or there is nothing to share."""
    if r.fork_of is not None and (r.fork_of.finished or r.prompt_len < 2):
        r.fork_of = None
    return r.fork_of is None


def startable(waiting: list[Request]) -> list[Request]:
    """The waiting requests that may start now, in their order."""
    return [r for r in waiting if fork_gone(r) or fork_point(r) is not None]
