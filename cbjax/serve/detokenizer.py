"""Token ids to streamed text, and stop strings.

Decoding each new token alone breaks multi-byte characters split across byte-level
tokens and drops SentencePiece's leading spaces, so each delta is the difference
between decoding a short window with and without the new tokens (vLLM's offsets): the
window starts at the tokens of the previous delta, and a delta ending in an incomplete
character (U+FFFD) waits for the next token.
"""

from __future__ import annotations


class TextStream:
    """One request's text as its tokens arrive. `push(ids)` returns the text that may be
    sent now; once a stop string appears, `stopped` is set and the text ends before it."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        # Held back while streaming so a stop string split across deltas is never sent.
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far (cut at a stop string)
        self.sent = 0  # characters of `text` already returned
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # a tokenizer-less model serves token ids only
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.token_ids += new_ids
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset:])
        if len(window) > len(prefix) and (final or not window.endswith("\ufffd")):
            searched_from = max(0, len(self.text) - self._hold)
            self.text += window[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            self._find_stop(searched_from)
        ready = len(self.text) if final or self.stopped else len(self.text) - self._hold
        delta = self.text[self.sent:max(ready, self.sent)]
        self.sent += len(delta)
        return delta

    def _find_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
