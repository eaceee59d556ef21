"""Property-based tests of the page allocator: no page lost, double-freed or shared without a
reference; everything free after a run; prefix hits return exactly the tokens' pages."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cbjax.scheduling.block_manager import BlockManager

PAGE = 4


def check_invariants(bm: BlockManager):
    refs = [0] * bm.num_pages
    for table in bm.tables.values():
        for page in table:
            refs[page] += 1
    assert refs == bm.ref_counts, "reference counts match the tables"
    free = list(bm.free_pages)
    assert len(set(free)) == len(free), "a page is on the free list twice"
    assert set(free) == {p for p in range(bm.num_pages) if refs[p] == 0}, "free list == unreferenced pages"
    for seq, table in bm.tables.items():
        assert len(table) == bm.pages_needed(bm.lengths[seq])
    for key, page in (bm.prefix.cached.items() if bm.prefix else []):
        assert bm.prefix.page_key[page] == key


ops = st.lists(st.tuples(st.sampled_from(["alloc", "append", "grow", "free"]), st.integers(0, 7),
                         st.lists(st.integers(0, 3), min_size=1, max_size=14)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 24), st.booleans(), ops)
# A prompt whose every page is cached by a running sequence still needs a fresh page for its
# last token: can_allocate once counted the cached page and allocate then found no free one.
@example(1, True, [("alloc", 0, [0, 0, 0, 1]), ("alloc", 1, [0, 0, 0, 1])])
def test_allocator_invariants(num_pages, prefix, operations):
    bm = BlockManager(num_pages, PAGE, enable_prefix_caching=prefix)
    for op, seq, tokens in operations:
        sid = f"s{seq}"
        if op == "alloc" and sid not in bm.tables:
            if bm.can_allocate(tokens):
                cached = bm.allocate(sid, tokens)
                assert cached % PAGE == 0 and cached < len(tokens)
                bm.register(sid, tokens, len(tokens))
            else:
                before = list(bm.free_pages)
                try:
                    bm.allocate(sid, tokens)
                    raise AssertionError("allocate succeeded after can_allocate said no")
                except MemoryError:
                    assert list(bm.free_pages) == before
        elif op == "append" and sid in bm.tables and bm.can_append(sid):
            bm.append(sid)
        elif op == "grow" and sid in bm.tables and bm.can_grow(sid, bm.lengths[sid] + len(tokens)):
            bm.grow(sid, bm.lengths[sid] + len(tokens))
        elif op == "free" and sid in bm.tables:
            bm.free(sid)
        check_invariants(bm)
    for sid in list(bm.tables):
        bm.free(sid)
    check_invariants(bm)
    assert bm.num_free == num_pages and not bm.tables


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=20), st.lists(st.integers(0, 5), max_size=10))
def test_prefix_hits_return_exactly_the_tokens_pages(shared, tail):
    bm = BlockManager(64, PAGE, enable_prefix_caching=True)
    first = shared + tail
    bm.allocate("a", first)
    assert bm.allocate("early", first) == 0  # nothing registered before it is computed
    bm.free("early")
    bm.register("a", first, len(first))
    second = shared + [9] * 5
    cached = bm.allocate("b", second)
    common = 0
    while common < min(len(first), len(second)) and first[common] == second[common]:
        common += 1
    full_common = common // PAGE
    expected_pages = min(full_common, (len(second) - 1) // PAGE)
    assert cached == expected_pages * PAGE
    assert bm.table("b")[:expected_pages] == bm.table("a")[:expected_pages]
    assert not set(bm.table("b")[expected_pages:]) & set(bm.table("a"))
    # After both end, the prefix stays cached until its pages are reused.
    bm.free("a")
    bm.free("b")
    assert bm.allocate("c", first) == min(len(first) // PAGE, (len(first) - 1) // PAGE) * PAGE


def test_pages_are_taken_on_demand_and_released():
    bm = BlockManager(3, PAGE)
    assert bm.allocate("x", [1, 2, 3]) == 0 and bm.num_free == 2
    bm.append("x")  # 4 tokens: still one page
    assert bm.num_free == 2
    bm.append("x")  # 5th token takes a page
    assert bm.num_free == 1 and len(bm.table("x")) == 2
    bm.free("x")
    assert bm.num_free == 3
