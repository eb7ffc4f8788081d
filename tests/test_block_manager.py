"""BlockManager: ref counts, the free/used partition, prefix caching by content, LRU eviction."""
import hashlib
import struct

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from engram_serve.engine.block_manager import BlockManager, OutOfBlocks, block_hash
from engram_serve.engine.sequence import Sequence

BS = 2


def seq(tokens, rid="r", dead=None) -> Sequence:
    return Sequence(rid, list(tokens), dead=dead)


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    """Pretend a step computed `s`'s first n tokens; register the full blocks."""
    bm.allocate(s, n)
    s.num_computed_tokens = n
    bm.register_full_blocks(s)


def test_fields_are_validated():
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size=-1"):
        BlockManager(4, -1)


def test_block_hash_is_chained_blake2b_of_ints_golden():
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\x00" + struct.pack("<4q", 1, 2, 3, 4) + b"\x00")
    assert block_hash(None, [1, 2, 3, 4]) == h.digest()
    assert block_hash(None, [1, 2, 3, 4]).hex() == "7dd9b380a8a12382c6902f7abd74731a"  # stable across processes
    assert block_hash(b"x" * 16, [1, 2, 3, 4]) != block_hash(None, [1, 2, 3, 4])  # the parent matters
    assert block_hash(None, [1, 2], [False, False]) == block_hash(None, [1, 2])
    assert block_hash(None, [1, 2], [False, True]) != block_hash(None, [1, 2])


def test_allocate_free_roundtrip_and_counts():
    bm = BlockManager(4, BS)
    s = seq(range(5))
    bm.allocate(s, 5)
    assert len(s.block_ids) == 3 and bm.num_used == 3 and bm.num_free == 1 and bm.usage == 0.75
    bm.check_invariants()
    bm.allocate(s, 6)  # still covered: nothing new
    assert len(s.block_ids) == 3
    bm.free(s)
    assert s.block_ids == [] and bm.num_free == 4
    bm.check_invariants()


def test_out_of_blocks_raises_and_changes_nothing():
    bm = BlockManager(2, BS)
    s = seq(range(5))
    assert not bm.can_allocate(s, 5) and bm.capacity(s) == 4
    with pytest.raises(OutOfBlocks, match="num_tokens=5 needs 3 blocks"):
        bm.allocate(s, 5)
    assert s.block_ids == [] and bm.num_free == 2
    bm.check_invariants()


def test_prefix_is_shared_by_reference_and_match_takes_no_refs():
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3, 4, 5], "a")
    computed(bm, a, 5)
    b = seq([1, 2, 3, 4, 9], "b")
    prefix = bm.match_prefix(b.token_ids)
    assert prefix == a.block_ids[:2]
    assert [bm.ref_count[x] for x in prefix] == [1, 1]  # match took no refs
    bm.allocate(b, 5, prefix)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [bm.ref_count[x] for x in prefix] == [2, 2]
    bm.check_invariants()
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free == 8


def test_match_is_chained_and_includes_dead_mask():
    bm = BlockManager(8, BS)
    computed(bm, seq([1, 2, 3, 4], "a"), 4)
    assert len(bm.match_prefix([1, 2, 3, 4])) == 2
    assert bm.match_prefix([9, 9, 3, 4]) == []  # same 2nd block, different parent
    assert len(bm.match_prefix([1, 2, 9, 9])) == 1
    assert bm.match_prefix([1, 2, 3, 4], [False, True, False, False]) == []
    assert len(bm.match_prefix([1, 2, 3, 4], [False] * 4)) == 2


def test_register_is_incremental_and_only_counts_computed_full_blocks():
    bm = BlockManager(8, BS)
    s = seq(range(7))
    bm.allocate(s, 7)
    s.num_computed_tokens = 3
    assert bm.register_full_blocks(s) == 1
    assert bm.register_full_blocks(s) == 0
    s.num_computed_tokens = 7
    assert bm.register_full_blocks(s) == 2  # blocks 1 and 2; block 3 is partial
    assert len(bm.match_prefix(list(range(7)))) == 3


def test_cached_free_blocks_stay_findable_until_reallocated_least_recently_freed_first():
    bm = BlockManager(4, BS)
    a, b = seq([1, 2, 3, 4], "a"), seq([5, 6, 7, 8], "b")
    computed(bm, a, 4)
    computed(bm, b, 4)
    bm.free(a)  # freed first: evicted first
    bm.free(b)
    assert bm.num_free == 4 and len(bm.match_prefix(a.token_ids)) == 2 and len(bm.match_prefix(b.token_ids)) == 2
    c = seq([0, 0], "c")
    bm.allocate(c, 2)
    assert len(bm.match_prefix([1, 2, 3, 4])) == 1  # a's tail went first
    assert len(bm.match_prefix([5, 6, 7, 8])) == 2
    bm.allocate(c, 4)
    assert bm.match_prefix([1, 2, 3, 4]) == [] and len(bm.match_prefix([5, 6, 7, 8])) == 2
    bm.check_invariants()


def test_uncached_blocks_are_handed_out_before_cached_ones():
    bm = BlockManager(3, BS)
    a = seq([1, 2, 3], "a")
    computed(bm, a, 3)  # block 0 cached, block 1 partial
    bm.free(a)
    c = seq([0, 0], "c")
    bm.allocate(c, 2)
    assert len(bm.match_prefix([1, 2])) == 1  # the cached block survived


def test_duplicate_content_keeps_the_first_block_and_a_correct_chain():
    bm = BlockManager(8, BS)
    a, b = seq([1, 2, 3, 4], "a"), seq([1, 2, 3, 4], "b")
    bm.allocate(a, 4)
    bm.allocate(b, 4)  # both computed in the same step: no sharing
    for s in (a, b):
        s.num_computed_tokens = 4
        bm.register_full_blocks(s)
    first = list(a.block_ids)
    assert bm.match_prefix([1, 2, 3, 4]) == first
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    assert bm.match_prefix([1, 2, 3, 4]) == first
    c = Sequence("c", [1, 2, 3, 4, 5, 6])
    bm.allocate(c, 6, first)
    c.num_computed_tokens = 6
    bm.register_full_blocks(c)
    assert bm.match_prefix([1, 2, 3, 4, 5, 6]) == c.block_ids


def test_prefix_caching_off_never_matches():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    computed(bm, seq([1, 2, 3, 4]), 4)
    assert bm.match_prefix([1, 2, 3, 4]) == []


# ---- property test: random operations, invariants and cached content after each -------------

def run_random_ops(data) -> None:
    bm = BlockManager(data.draw(st.integers(2, 6), "num_blocks"), BS)
    content: dict[int, tuple] = {}  # block -> the tokens registered for it (what its KV would hold)
    live: list[Sequence] = []
    for i in range(data.draw(st.integers(1, 25), "num_ops")):
        op = data.draw(st.sampled_from(["new", "grow", "compute", "free"] if live else ["new"]))
        if op == "new":
            toks = [1, 2, 3, 4, 5, 6][:data.draw(st.integers(0, 6))] + data.draw(st.lists(st.integers(0, 2), max_size=3))
            s = Sequence(f"r{i}", toks or [0])
            prefix = bm.match_prefix(s.token_ids)
            for j, b in enumerate(prefix):  # a match must return blocks holding exactly these tokens
                if content.get(b) != tuple(s.token_ids[j * BS:(j + 1) * BS]):
                    raise AssertionError(f"matched block {b} holds {content.get(b)}, not the query's tokens")
            if bm.can_allocate(s, len(prefix) * BS, prefix):
                before = set(b for b in range(bm.num_blocks) if bm.ref_count[b])
                bm.allocate(s, len(prefix) * BS, prefix)
                for b in set(s.block_ids) - before - set(prefix):
                    content.pop(b, None)  # fresh block: old content gone
                s.num_computed_tokens = len(prefix) * BS
                live.append(s)
        elif op == "grow":
            s = data.draw(st.sampled_from(live))
            s.append_token(data.draw(st.integers(0, 2)))
            n = s.num_computed_tokens + 1
            if n <= s.num_tokens and bm.can_allocate(s, n):
                old = list(s.block_ids)
                bm.allocate(s, n)
                for b in s.block_ids[len(old):]:
                    content.pop(b, None)
        elif op == "compute":
            s = data.draw(st.sampled_from(live))
            s.num_computed_tokens = min(s.num_tokens, len(s.block_ids) * BS)
            bm.register_full_blocks(s)
            for j in range(s.num_computed_tokens // BS):
                content.setdefault(s.block_ids[j], tuple(s.token_ids[j * BS:(j + 1) * BS]))
        else:
            s = data.draw(st.sampled_from(live))
            bm.free(s)
            live.remove(s)
        bm.check_invariants()
    for s in live:
        bm.free(s)
    bm.check_invariants()
    if bm.num_free != bm.num_blocks:
        raise AssertionError("blocks leaked after freeing every sequence")


@given(st.data())
def test_random_operations_keep_invariants(data):
    run_random_ops(data)


def run_quickly_until_failure() -> None:
    """The property test, generating only (no shrinking), for the negative controls."""
    @settings(max_examples=300, phases=[Phase.generate], database=None, report_multiple_bugs=False)
    @given(st.data())
    def prop(data):
        run_random_ops(data)
    prop()


def _forgetful_free(self, s):
    """Sabotage: release every block but the last one, which is lost (neither free nor held)."""
    ids, s.block_ids = s.block_ids[:-1], []
    for b in ids:
        self.ref_count[b] -= 1
        if not self.ref_count[b]:
            self._free[b] = None
    self._holders.pop(id(s), None)


def test_negative_control_forgetful_free_breaks_the_partition(monkeypatch):
    monkeypatch.setattr(BlockManager, "free", _forgetful_free)
    bm = BlockManager(4, BS)
    s = seq(range(4))
    bm.allocate(s, 4)
    bm.free(s)
    with pytest.raises(AssertionError, match="ref count 1 != 0 live holders|neither free nor referenced"):
        bm.check_invariants()
    # and the property test above goes red with it
    with pytest.raises(AssertionError):
        run_quickly_until_failure()


def test_negative_control_content_blind_hash_is_caught(monkeypatch):
    import engram_serve.engine.block_manager as mod
    monkeypatch.setattr(mod, "block_hash", lambda parent, toks, dead=None: bytes([len(toks)]) + (parent or b""))
    with pytest.raises(AssertionError, match="matched block"):
        run_quickly_until_failure()
