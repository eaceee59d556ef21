"""Thin helpers over a transformers tokenizer (whose return types vary between versions)."""

from __future__ import annotations


def _ids(encoded) -> list[int]:
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def chat_prompt_ids(tokenizer, user_message: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat, templated with the generation prompt appended."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; pass token ids instead of text")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user_message}]
    if getattr(tokenizer, "chat_template", None):
        return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return encode(tokenizer, user_message)


def encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; pass token ids instead of text")
    return _ids(tokenizer(text))
