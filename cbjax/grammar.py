"""Structured output on the host: a request's `StructuredOutput` compiled by llguidance into a
matcher that follows the request's output tokens and, before each step that samples for it,
writes the bitmask of the tokens that may come next (one bit per vocabulary id, 32 ids to an
int32 word). The device applies the masks inside the batched step (runtime/sampling.py); a
step with no constrained row is the program compiled without a mask, so requests without a
constraint pay nothing while none is running.

Why llguidance: measured on SmolLM2's 49,152-token vocabulary with a nested five-property
JSON schema, on a 2-core AMD EPYC beside two busy processes, a mask takes 11.5 us at the median
per token (xgrammar 0.2.8: 2.3 us). Both are far below one decode step (27 ms for one row of
SmolLM2 on that CPU), so the choice fell to packaging: llguidance is one wheel with no
dependencies and a numpy API, where xgrammar requires torch and triton.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from cbjax.request import StructuredOutput

# JSON as the OpenAI and vLLM servers produce it under a schema: compact, no free whitespace
# (a small model left free to emit whitespace can spend its whole budget on it).
JSON_OPTIONS = {"whitespace_flexible": False}


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return (vocab_size + 31) // 32


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint; ValueError when it is malformed."""
    import llguidance

    matcher = llguidance.LLMatcher
    kind = structured.kind
    try:
        if kind == "json":
            return matcher.grammar_from_json_schema(structured.json, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "regex":
            return matcher.grammar_from_regex(structured.regex)
        if kind == "choice":
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                    for c in structured.choice))
        return matcher.grammar_from_lark(structured.grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"structured output ({kind}): {e}") from None


class GrammarState:
    """One request's matcher: it consumes the request's output tokens as they are recorded."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0

    def follow(self, output_token_ids: list[int]) -> None:
        """Advance over the output tokens it has not seen (a masked step samples only tokens
        the matcher allows, so it never refuses one; if it did, it would stay in its error
        state, whose mask allows only EOS)."""
        for token in output_token_ids[self.consumed:]:
            self.matcher.consume_token(token)
        self.consumed = len(output_token_ids)


class Grammars:
    """An engine's grammar compiler: llguidance's view of the tokenizer, built on first use (a
    few seconds for a 50k vocabulary) and shared by every request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        self._lock = threading.Lock()
        self._tokenizer = None
        self._compiled: dict[StructuredOutput, str] = {}  # checked grammars (the server checks, then adds)

    def tokenizer(self):
        if self._hf is None:
            raise ValueError("structured output needs the model's tokenizer (this model has none)")
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                                   eos_token=self._eos_ids or None)
                except ValueError as e:
                    raise ValueError(f"structured output: llguidance cannot read this tokenizer: {e}") from None
        return self._tokenizer

    def compile(self, structured: StructuredOutput) -> str:
        """The checked grammar of a constraint: ValueError naming what llguidance refuses."""
        import llguidance

        if structured in self._compiled:
            return self._compiled[structured]
        text = grammar_text(structured)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer())
        if failed:
            raise ValueError(f"structured output ({structured.kind}): {messages[0]}")
        if len(self._compiled) >= 256:
            self._compiled.clear()
        self._compiled[structured] = text
        return text

    def state(self, grammar: str) -> GrammarState:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output: {matcher.get_error()}")
        return GrammarState(matcher)


_executor = None  # llguidance's thread pool for the masks of one step, made on first use


def fill_masks(rows: list[tuple[int, GrammarState, list[int]]], masks: np.ndarray) -> None:
    """Write each `(row, state, output tokens)`'s next-token bitmask into `masks[row]` (rows
    not named keep theirs), the rows' matchers in parallel on llguidance's threads."""
    import llguidance
    import llguidance.numpy

    global _executor
    for _, state, tokens in rows:
        state.follow(tokens)
    if _executor is None:
        _executor = llguidance.LLExecutor()
    llguidance.numpy.fill_next_token_bitmask_par(_executor, [(s.matcher, i) for i, s, _ in rows], masks)
