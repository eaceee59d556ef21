"""Structured output on the host: a request's `StructuredOutput` compiled by llguidance into a
matcher that follows the request's output tokens and, before each step that samples for it,
writes the bitmask of the tokens that may come next (one bit per vocabulary id, 32 ids to an
int32 word). The device applies the masks inside the batched step (runtime/traced/sampling.py); a
step with no constrained row is the program compiled without a mask, so requests without a
constraint pay nothing while none is running.

Why llguidance: its masks and xgrammar's both cost far less than one decode step
(docs/code_measurements.md), so the choice fell to packaging: llguidance is one wheel with no
dependencies and a numpy API, where xgrammar requires torch and triton.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np

from cbjax.request import StructuredOutput

# JSON as the OpenAI and vLLM servers produce it under a schema: compact, no free whitespace
# (a small model left free to emit whitespace can spend its whole budget on it).
JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance's work bounds, a tenth of its defaults: the lexer's fuel to build a grammar's regex
# ASTs (~50k/ms) and per mask (~14k/ms), Earley items per mask (~20k/ms), lexer states. A
# constraint that needs more fails when it is checked (a 400) or, mid-generation, ends its
# request with an error; it never costs the other rows of a step more than a few ms.
LIMITS = dict(initial_lexer_fuel=100_000, step_lexer_fuel=20_000, step_max_items=5_000, max_lexer_states=25_000)
# A constraint is checked by following it for a few tokens (the first of each mask's allowed
# ones) before the request is accepted: the lexer builds its states lazily, so a regex that
# explodes does so at its first tokens, not when it is parsed ("(a{100}){100}{100}").
PROBE_TOKENS = 4
PROBE_BUDGET_S = 0.5  # the probe's time, all masks together; more is a 400


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
        the matcher allows, so it refuses one only past its work bounds, `LIMITS`; it then
        stays in its error state, whose mask allows only EOS, and `error` says why)."""
        for token in output_token_ids[self.consumed:]:
            self.matcher.consume_token(token)
        self.consumed = len(output_token_ids)

    @property
    def error(self) -> str | None:
        """Why the matcher failed (the request must end with an error), or None."""
        if not self.matcher.is_error():
            return None
        return "structured output: the constraint could not be followed: " + \
            self.matcher.get_error().split("\n")[0]


class Grammars:
    """An engine's grammar compiler: llguidance's view of the tokenizer, built on first use (a
    few seconds for a 50k vocabulary) and shared by every request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        self._lock = threading.Lock()
        self._tokenizer = None
        # Checked grammars, and the refusals (the server checks on its parser threads, then adds).
        self._compiled: dict[StructuredOutput, str | ValueError] = {}

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
        """The checked grammar of a constraint: ValueError naming what llguidance refuses, or
        what it cannot follow within its bounds (`probe`). Seconds at most for a bad one: the
        server calls it on its parser threads, never on the engine's."""
        import llguidance

        known = self._compiled.get(structured)
        if isinstance(known, ValueError):  # refused before: refused again at once (a client may repeat it)
            raise known
        if known is not None:
            return known
        try:
            text = grammar_text(structured)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer(),
                                                                                   limits=_limits())
            if failed:
                raise ValueError(f"structured output ({structured.kind}): {messages[0]}")
            self.probe(text, structured.kind)
        except ValueError as e:
            text = ValueError(str(e))
        if len(self._compiled) >= 256:
            self._compiled.clear()
        self._compiled[structured] = text
        if isinstance(text, ValueError):
            raise text
        return text

    def probe(self, grammar: str, kind: str) -> None:
        """Follow `grammar` for `PROBE_TOKENS` tokens (each mask's first allowed one that is not
        EOS): ValueError if the matcher fails or the masks take more than `PROBE_BUDGET_S`."""
        import llguidance.numpy

        state = self.state(grammar)
        mask = np.zeros((1, mask_words(self.vocab_size)), np.int32)
        start = time.perf_counter()
        for _ in range(PROBE_TOKENS):
            llguidance.numpy.fill_next_token_bitmask(state.matcher, mask, 0)
            if state.error is not None:
                raise ValueError(f"structured output ({kind}): {state.error}")
            if time.perf_counter() - start > PROBE_BUDGET_S:
                raise ValueError(f"structured output ({kind}): the constraint is too costly to follow (its first "
                                 f"tokens' masks took over {PROBE_BUDGET_S:g} s)")
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:self.vocab_size])
            allowed = [t for t in allowed.tolist() if t not in self._eos_ids]
            if not allowed or state.matcher.is_stopped():
                return
            state.matcher.consume_token(allowed[0])
        if state.error is not None:
            raise ValueError(f"structured output ({kind}): {state.error}")

    def state(self, grammar: str) -> GrammarState:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise ValueError(f"structured output: {matcher.get_error()}")
        return GrammarState(matcher)


def _limits():
    import llguidance

    return llguidance.LLParserLimits(**LIMITS)


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
