"""The KV block pool and the prefix index (opentinker/engine/kv_cache.py): exact block ids,
ref counts, LRU order, and a randomized run that checks the invariants after every op."""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest
import torch

from opentinker.engine.kv_cache import (
    Allocation,
    BlockManager,
    KVPool,
    OutOfBlocks,
    block_hash,
)

NS = ("base", "lora-a", 0)
"""(model copy, adapter, version), as the engine keys the index."""


def _state(m: BlockManager, *allocs: Allocation) -> tuple[object, ...]:
    """Everything a failed call must leave as it was."""
    return (
        m.stats(),
        list(m._ref),
        list(m._free),
        list(m._lru),
        dict(m._index),
        [None if e is None else (e.hash, e.uid) for e in m._entry],
        [(a.block_table.copy(), a.num_tokens, a.num_committed_blocks) for a in allocs],
    )


# ---- the pool ----------------------------------------------------------------------------


def test_pool_shapes_and_bytes() -> None:
    pool = KVPool(2, 3, 8, block_size=4, num_blocks=5, dtype=torch.float32)
    # 20 slots of 5 blocks, and the scratch slot that padding rows of a captured decode step write
    assert pool.k.shape == (2, 21, 3, 8) and pool.v.shape == (2, 21, 3, 8) and pool.scratch_slot == 20
    assert pool.k[1].shape == (21, 3, 8)
    assert pool.bytes_per_block == 2 * 2 * 4 * 3 * 8 * 4 == 1536
    assert pool.nbytes == 5 * 1536 + 2 * 2 * 3 * 8 * 4
    assert KVPool.block_bytes(2, 3, 8, 4, torch.bfloat16) == 768


def test_blocks_for_budget() -> None:
    assert KVPool.blocks_for_budget(1536 * 7 + 1535, 2, 3, 8, 4, torch.float32) == 7
    assert KVPool.blocks_for_budget(1536, 2, 3, 8, 4, torch.float32) == 1
    with pytest.raises(ValueError, match=r"1535 bytes is below one block of 1536 bytes"):
        KVPool.blocks_for_budget(1535, 2, 3, 8, 4, torch.float32)


def test_slots_map_positions_through_the_block_table() -> None:
    m = BlockManager(8, 4)
    m.allocate(NS, [1, 2, 3])  # takes block 0
    a = m.allocate(NS, list(range(10)), reserve=2)
    assert a.block_table == [1, 2, 3] and a.num_tokens == 12
    assert a.slots(2, 9) == [6, 7, 8, 9, 10, 11, 12]
    assert a.slots(0, 12) == list(range(4, 16))
    assert a.slots(3, 3) == []
    assert a.slots_tensor(7, 9).tolist() == [11, 12]
    assert a.slots_tensor(7, 9).dtype == torch.int64
    with pytest.raises(IndexError):
        a.slots(0, 13)


# ---- match, allocate, commit, free -------------------------------------------------------


def test_commit_then_match_and_share_with_ref_counts() -> None:
    m = BlockManager(8, 4, bytes_per_block=100)
    prompt = list(range(10))  # two full blocks + 2
    a = m.allocate(NS, prompt, reserve=3)
    assert a.block_table == [0, 1, 2, 3] and a.num_cached_tokens == 0
    assert m.match(NS, prompt) == ([], 0)  # nothing indexed before commit
    assert m.commit(a, prompt) == 2
    assert m.match(NS, prompt) == ([0, 1], 8)
    assert m.match(NS, prompt[:9]) == ([0, 1], 8)
    assert m.match(NS, prompt[:8]) == ([0], 4)  # never the whole prompt
    assert m.match(NS, [0, 1, 2, 99, 4, 5, 6, 7, 8]) == ([], 0)
    # a second request reuses the prompt of the first while it still decodes
    b = m.allocate(NS, prompt + [50, 51])
    assert b.block_table == [0, 1, 4] and b.num_cached_tokens == 8
    assert [m.ref_count(i) for i in range(5)] == [2, 2, 1, 1, 1]
    s = m.stats()
    assert (s.blocks_free, s.blocks_cached, s.blocks_in_use, s.bytes_in_use) == (3, 0, 5, 500)
    assert (s.prefix_queries, s.prefix_query_tokens, s.prefix_hit_tokens) == (2, 22, 8)
    assert s.hit_rate == 8 / 22
    m.free(a)
    assert [m.ref_count(i) for i in range(5)] == [1, 1, 0, 0, 1]
    assert m.stats().blocks_cached == 0  # 0, 1 still held by b; 2, 3 unindexed -> free
    m.free(b)
    s = m.stats()
    assert (s.blocks_free, s.blocks_cached, s.blocks_in_use) == (6, 2, 0)
    m.check_invariants()


def test_never_whole_match_leaves_the_last_block_to_compute() -> None:
    m = BlockManager(8, 4)
    prompt = list(range(8))
    a = m.allocate(NS, prompt)
    m.commit(a, prompt)
    m.free(a)
    b = m.allocate(NS, prompt)
    assert b.num_cached_tokens == 4 and b.block_table == [0, 2]


def test_free_fills_the_lru_deepest_block_first_and_eviction_follows_it() -> None:
    m = BlockManager(6, 4)
    a = m.allocate(NS, list(range(13)))
    assert a.block_table == [0, 1, 2, 3]
    assert m.commit(a, list(range(12))) == 3
    m.free(a)
    assert list(m._lru) == [2, 1, 0] and list(m._free) == [5, 4, 3]
    other = ("base", "lora-b", 0)
    b = m.allocate(other, list(range(100, 109)))
    # The free list first, as a stack: block 3 (just freed, so resident) before never-used 4, 5.
    assert b.block_table == [3, 4, 5] and m.stats().evictions == 0
    c = m.allocate(other, list(range(200, 205)))
    assert c.block_table == [2, 1]  # then the LRU head: the chain's tail goes first
    assert m.stats().evictions == 2
    assert m.match(NS, list(range(13))) == ([0], 4)  # its head still matches
    m.check_invariants()


def test_lru_order_follows_free_order_and_a_match_revives_a_block() -> None:
    m = BlockManager(4, 4)
    a = m.allocate(NS, [1, 1, 1, 1, 9])
    b = m.allocate(NS, [2, 2, 2, 2, 9])
    m.commit(a, [1, 1, 1, 1])
    m.commit(b, [2, 2, 2, 2])
    m.free(b)
    m.free(a)
    assert list(m._lru) == [2, 0] and list(m._free) == [3, 1]
    c = m.allocate(NS, [2, 2, 2, 2, 7])  # revives block 2 out of the LRU, takes free 1 (freed last)
    assert c.block_table == [2, 1] and c.num_cached_tokens == 4 and list(m._lru) == [0]
    d = m.allocate(NS, [5] * 8)  # free 3, then evicts 0
    assert d.block_table == [3, 0] and m.stats().evictions == 1
    assert m.match(NS, [1, 1, 1, 1, 9]) == ([], 0)
    m.check_invariants()


def test_multi_turn_reuses_prompt_and_reply() -> None:
    m = BlockManager(16, 4)
    prompt1 = list(range(100, 110))  # 10 tokens
    a = m.allocate(NS, prompt1, reserve=6)
    assert m.commit(a, prompt1) == 2  # after the prefill forward
    reply = [7, 8, 9, 10, 11]
    # decode wrote KV for reply[:4]; reply[4] was sampled last and never fed back
    assert m.commit(a, prompt1 + reply[:4]) == 1
    turn1_blocks = a.block_table[:3]
    m.free(a)
    prompt2 = prompt1 + reply + [1, 2, 3, 4, 5, 6]  # 21 tokens
    b = m.allocate(NS, prompt2, reserve=4)
    # cached: 12 tokens; computed: reply[2:] (the partial last block of turn 1) + 6 new ones
    assert b.num_cached_tokens == 12 and b.block_table[:3] == turn1_blocks
    assert len(prompt2) - b.num_cached_tokens == 3 + 6
    assert b.num_committed_blocks == 3
    assert m.commit(b, prompt2) == 2
    assert m.match(NS, prompt2 + [0]) == (b.block_table[:5], 20)


def test_preempt_then_reallocate_recomputes_only_the_uncommitted_tail() -> None:
    m = BlockManager(8, 4)
    tokens = list(range(6))
    a = m.allocate(NS, tokens)
    m.commit(a, tokens)  # the prefill forward wrote positions 0..5
    tokens.append(6)  # sampled
    for t in (7, 8):  # a decode step feeds the last token, writes its KV, samples the next
        m.append(a, 1)
        m.commit(a, tokens)
        tokens.append(t)
    assert a.num_tokens == 8 and a.block_table == [0, 1] and a.num_committed_blocks == 2
    m.free(a)  # preempted
    b = m.allocate(NS, tokens)  # 9 tokens: 8 cached, token 8 recomputed
    assert b.num_cached_tokens == 8 and b.block_table == [0, 1, 2]


def test_duplicates_stay_unindexed_and_chain_onto_the_indexed_copy() -> None:
    m = BlockManager(12, 4)
    prompt = list(range(9))
    a = m.allocate(NS, prompt, reserve=4)  # both admitted in one step: both miss
    b = m.allocate(NS, prompt, reserve=4)
    assert a.block_table == [0, 1, 2, 3] and b.block_table == [4, 5, 6, 7]
    m.commit(a, prompt)
    m.commit(b, prompt)
    assert m.stats().blocks_indexed == 2  # b's copies of blocks 0 and 1 are duplicates
    b_tokens = prompt + [40, 41, 42]
    assert m.commit(b, b_tokens) == 1
    assert m.match(NS, b_tokens + [0]) == ([0, 1, 6], 12)
    m.free(b)
    assert list(m._lru) == [6] and list(m._free) == [11, 10, 9, 8, 7, 5, 4]
    m.check_invariants()


# ---- namespaces, retirement, collisions --------------------------------------------------


def test_namespaces_are_isolated() -> None:
    m = BlockManager(8, 4)
    prompt = list(range(9))
    a = m.allocate(NS, prompt)
    m.commit(a, prompt)
    assert m.match(NS, prompt) == ([0, 1], 8)
    for ns in (("base", "lora-a", 1), ("base", "lora-b", 0), ("copy2", "lora-a", 0), None):
        assert m.match(ns, prompt) == ([], 0)


def test_retire_while_in_use() -> None:
    m = BlockManager(8, 4)
    prompt = list(range(9))
    a = m.allocate(NS, prompt, reserve=4)
    m.commit(a, prompt)
    b = m.allocate(NS, prompt + [20])
    assert b.block_table[:2] == [0, 1] and m.ref_count(0) == 2
    assert m.retire(NS) == 2
    assert m.match(NS, prompt) == ([], 0) and m.stats().blocks_indexed == 0
    assert m.ref_count(0) == 2  # still in use
    assert m.commit(a, prompt + [30, 31, 32]) == 1
    assert m.stats().blocks_indexed == 0  # a row of a retired namespace never indexes again
    m.free(a)
    m.free(b)
    s = m.stats()
    assert (s.blocks_free, s.blocks_cached, s.blocks_in_use) == (8, 0, 0)
    c = m.allocate(NS, prompt)  # the same key after retirement starts afresh and indexes
    m.commit(c, prompt)
    assert m.stats().blocks_indexed == 2
    m.check_invariants()


def test_retire_frees_cached_blocks_and_predicates() -> None:
    m = BlockManager(8, 4)
    for ns in [("base", "x", 0), ("base", "x", 1), ("base", "y", 0)]:
        a = m.allocate(ns, list(range(5)))
        m.commit(a, list(range(5)))
        m.free(a)
    assert m.stats().blocks_cached == 3 and m.stats().blocks_free == 5
    assert m.retire_where(lambda ns: isinstance(ns, tuple) and ns[1] == "x") == 2
    assert (m.stats().blocks_cached, m.stats().blocks_free) == (1, 7)
    assert m.match(("base", "y", 0), list(range(5))) == ([2], 4)
    assert m.retire_all() == 1
    assert (m.stats().blocks_cached, m.stats().blocks_free, m.stats().blocks_indexed) == (0, 8, 0)
    m.check_invariants()


def test_hash_collisions_never_match_wrong_kv() -> None:
    m = BlockManager(8, 4, hash_fn=lambda ns, parent, toks: 0)
    a = m.allocate(NS, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.commit(a, [1, 2, 3, 4, 5, 6, 7, 8])
    assert m.stats().blocks_indexed == 1  # block 1 collides with block 0: left unindexed
    assert not a.indexable
    assert m.match(NS, [9, 9, 9, 9, 5]) == ([], 0)
    assert m.match(("other",), [1, 2, 3, 4, 5]) == ([], 0)
    assert m.match(NS, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == ([0], 4)
    assert m.match(NS, [1, 2, 3, 4, 1, 2, 3, 4, 9]) == ([0], 4)  # same tokens, wrong parent


def test_a_collision_below_the_root_cannot_graft_a_child_onto_another_prefix() -> None:
    def root_collides(ns: Hashable, parent: int | None, toks: tuple[int, ...]) -> int:
        return 7 if parent is None else block_hash(ns, parent, toks)

    m = BlockManager(8, 4, hash_fn=root_collides)
    x, y, z = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    a = m.allocate(NS, x + z + [0])
    m.commit(a, x + z)
    c = m.allocate(NS, y + z + [0])  # block 0 hashes like x's: a miss, and never indexed
    assert c.num_cached_tokens == 0
    m.commit(c, y + z)
    assert m.stats().blocks_indexed == 2
    assert m.match(NS, y + z + [0]) == ([], 0)
    assert m.match(NS, x + z + [0]) == (a.block_table[:2], 8)


# ---- running out -------------------------------------------------------------------------


def test_out_of_blocks_changes_nothing() -> None:
    m = BlockManager(4, 4, bytes_per_block=10)
    a = m.allocate(NS, list(range(9)))
    m.commit(a, list(range(8)))
    m.free(a)
    assert list(m._lru) == [1, 0] and list(m._free) == [3, 2]
    big = list(range(8)) + [50] * 12  # 5 blocks: 2 cached + 3 fresh, only 2 evictable left
    assert not m.can_allocate(NS, big)
    before = _state(m)
    with pytest.raises(OutOfBlocks, match=r"need 3 fresh KV blocks, 2 available") as err:
        m.allocate(NS, big)
    assert (err.value.needed, err.value.available) == (3, 2)
    assert _state(m) == before
    assert m.can_allocate(NS, big[:16])
    b = m.allocate(NS, list(range(8)) + [50, 51], reserve=2)  # [0, 1] + one fresh
    assert b.block_table == [0, 1, 2] and b.num_tokens == 12
    assert not m.can_append(b, 9)
    before = _state(m, b)
    with pytest.raises(OutOfBlocks, match=r"need 3 fresh KV blocks, 1 available"):
        m.append(b, 9)
    assert _state(m, b) == before
    m.append(b, 4)
    assert b.block_table == [0, 1, 2, 3] and b.num_tokens == 16


def test_bad_calls_raise() -> None:
    m = BlockManager(4, 4)
    with pytest.raises(ValueError):
        m.allocate(NS, [])
    a = m.allocate(NS, [1, 2])
    with pytest.raises(ValueError, match="only 2 have slots"):
        m.commit(a, [1, 2, 3])
    m.free(a)
    with pytest.raises(ValueError, match="freed twice"):
        m.free(a)
    with pytest.raises(ValueError, match="was freed"):
        m.append(a, 1)


# ---- randomized invariants ---------------------------------------------------------------


class _Row:
    """A live sequence in the model: its handle, tokens, KV written so far and its epoch."""

    def __init__(self, alloc: Allocation, tokens: list[int], epoch: int) -> None:
        self.alloc, self.tokens, self.epoch = alloc, tokens, epoch
        self.written = alloc.num_cached_tokens


def test_random_operations_keep_the_invariants() -> None:
    rng = random.Random(1234)
    bs, n_blocks = 4, 24
    m = BlockManager(n_blocks, bs)
    namespaces = [("base", "a", 0), ("base", "b", 0), ("copy", "a", 0)]
    epoch: dict[Hashable, int] = {ns: 0 for ns in namespaces}
    docs = [[rng.randrange(3) for _ in range(40)] for _ in range(3)]  # tiny vocab: shared prefixes
    kv: dict[int, tuple[Hashable, int, tuple[int, ...]]] = {}  # block -> what its KV was built from
    rows: list[_Row] = []
    names, weights = ["alloc", "append", "write", "free", "retire"], [4, 3, 5, 3, 0.3]
    ops = dict.fromkeys([*names, "oob"], 0)

    def write(row: _Row, upto: int) -> None:
        a = row.alloc
        for p in range(row.written, upto):
            b = a.block_table[p // bs]
            assert m.ref_count(b) == 1, "writing into a shared block"
            kv[b] = (a.namespace, row.epoch, tuple(row.tokens[: p + 1]))
        row.written = upto

    def check() -> None:
        m.check_invariants()
        held = [0] * n_blocks
        for r in rows:
            for b in r.alloc.block_table:
                held[b] += 1
        assert held == m._ref
        s = m.stats()
        in_use = sum(1 for c in held if c)
        assert s.blocks_in_use == in_use
        assert s.blocks_free + s.blocks_cached + in_use == s.blocks_total == n_blocks
        for e in m._entry:  # every indexed block holds the KV of its own chain, this epoch
            if e is not None:
                b = m._index[e.hash]
                assert kv[b][:2] == (e.namespace, epoch[e.namespace])
                assert len(kv[b][2]) % bs == 0 and kv[b][2][-bs:] == e.tokens

    for _ in range(2000):
        op = rng.choices(names, weights)[0]
        if op == "alloc" or not rows:
            ns = rng.choice(namespaces)
            tokens = docs[rng.randrange(3)][: rng.randint(1, 30)]
            tokens += [rng.randrange(3)] * rng.randint(0, 3)
            reserve = rng.randint(0, 6)
            blocks, n = m.match(ns, tokens)
            if not m.can_allocate(ns, tokens, reserve):
                before = _state(m, *(r.alloc for r in rows))
                with pytest.raises(OutOfBlocks):
                    m.allocate(ns, tokens, reserve)
                assert _state(m, *(r.alloc for r in rows)) == before
                ops["oob"] += 1
            else:
                a = m.allocate(ns, tokens, reserve)
                assert a.block_table[: len(blocks)] == blocks
                assert a.num_cached_tokens == n < len(tokens)
                for i, b in enumerate(blocks):
                    assert kv[b] == (ns, epoch[ns], tuple(tokens[: (i + 1) * bs]))
                rows.append(_Row(a, list(tokens), epoch[ns]))
                op = "alloc"
        elif op == "append":
            r = rng.choice(rows)
            n = rng.randint(1, 5)
            if m.can_append(r.alloc, n):
                m.append(r.alloc, n)
            else:
                before = _state(m, *(x.alloc for x in rows))
                with pytest.raises(OutOfBlocks):
                    m.append(r.alloc, n)
                assert _state(m, *(x.alloc for x in rows)) == before
                ops["oob"] += 1
        elif op == "write":
            r = rng.choice(rows)
            upto = rng.randint(r.written, r.alloc.num_tokens)
            r.tokens += [rng.randrange(3) for _ in range(upto - len(r.tokens))]
            write(r, upto)
            m.commit(r.alloc, r.tokens[:upto])
        elif op == "free":
            m.free(rows.pop(rng.randrange(len(rows))).alloc)
        else:
            ns = rng.choice(namespaces)
            m.retire(ns)
            epoch[ns] += 1
        ops[op] += 1
        check()
    for r in rows:
        m.free(r.alloc)
    rows.clear()
    check()
    s = m.stats()
    assert s.blocks_in_use == 0 and s.blocks_free + s.blocks_cached == n_blocks
    assert min(ops.values()) > 0 and s.prefix_hit_tokens > 0 and s.evictions > 0


def test_steady_reuse_touches_no_more_blocks_than_its_peak() -> None:
    """Free blocks are a stack: rows that come and go, never more than 6 blocks in use at once,
    only ever get blocks 0-5 of a 64-block pool (a lazily mapped pool stays that small)."""
    m = BlockManager(64, 4)
    used: set[int] = set()
    for round_ in range(20):
        allocs = [m.allocate(NS, [round_ * 100 + r] * 6) for r in range(3)]  # 2 blocks each
        used.update(b for a in allocs for b in a.block_table)
        for a in allocs[::-1] if round_ % 2 else allocs:
            m.free(a)
    assert used == set(range(6))
    m.check_invariants()
