"""The one way a test reaches behind an `LLM`: the engine, scheduler and page pool of its core
(a disaggregated core: its first prefill instance's). `LLM` and the `Core` contract hand none
of them out; a test of an internal builds the internal where it can, and otherwise reaches
it here."""


def engine_of(llm):
    return llm.core.engine


def scheduler_of(llm):
    return llm.core.scheduler


def pages_of(llm):
    return llm.core.pages
