"""The KV block pool and the prefix index (paged attention's memory, vLLM v1 style).

Two objects, kept apart so the bookkeeping is testable without tensors:

* ``KVPool`` owns the tensors: ``k[layer]`` and ``v[layer]`` are ``[S, Hkv, D]`` views of one
  ``[L, S, Hkv, D]`` tensor each, ``S = num_blocks * block_size`` slots, and slot
  ``block * block_size + offset`` holds the key/value of one token.
* ``BlockManager`` owns which block holds what: ref counts, a free list, an LRU of cached
  blocks nobody uses, and a prefix index. A sequence's ``Allocation`` is its block table.

Prefix index. A FULL block ``i`` of a sequence is indexed under the hash chain
``h_i = hash_fn(namespace, h_{i-1}, tokens of block i)`` (``h_{-1} = None``); the namespace is
whatever hashable key the caller gives (the engine: model copy, adapter, version), so KV is only
ever shared between rows that would compute the same KV. ``match`` walks the chain block by
block and returns the longest indexed prefix, never all of the tokens: the last one is always
left to compute, because the engine needs its logits.

Hazards, and how they are closed:

* Hash collisions. The index maps an int to a block, and an int can collide. Every indexed
  block keeps its namespace, its tokens and the unique id (``uid``, never reused) of the entry
  it extends, and a lookup compares all three. Comparing the parent's *hash* would not be
  enough: if ``h_{i-1}`` of two different prefixes collided, a child written after one of them
  would be reachable from the other. Comparing the parent's uid makes a match exact: its KV
  was computed after exactly the tokens this lookup has verified, block by block from block 0.
* Duplicates. Rows with the same prompt admitted in one step all miss, and all compute it.
  The first to ``commit`` indexes its blocks; the others keep theirs unindexed (they go back
  to the free list when freed) and chain their later blocks onto the indexed entry, which
  holds the same KV. Should that entry be evicted meanwhile, their later blocks are indexed
  under a parent uid no lookup can reach again: dead weight that ages out of the LRU, never
  a wrong match.
* Reuse order. Free blocks form a stack (the last freed is the next taken): a pool mapped
  lazily (CPU) is only touched up to the most blocks in use at once, not cycled through.
* Eviction order. ``free`` puts a sequence's blocks at the LRU tail last block first, so the
  deepest block of a chain is evicted before its parents: a child is useless without them.
* Retirement. ``retire(namespace)`` (an adapter's version bump) unindexes its blocks at once;
  those at ref 0 go to the free list, those in use go there when their rows free them, and
  rows still running under the namespace never index another block.
* Commit only what was written: ``commit(alloc, tokens)`` trusts that the KV of every one of
  ``tokens`` is in the pool. In decode, the token just sampled has no KV until the next
  forward, so the engine commits ``tokens[:num_computed]``.

Cost: every call is O(blocks it touches) with dicts, a deque and an ``OrderedDict``; nothing
scans the pool except ``check_invariants`` (tests and debugging).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

HashFn = Callable[[Hashable, "int | None", tuple[int, ...]], int]


def block_hash(namespace: Hashable, parent_hash: int | None, tokens_B: tuple[int, ...]) -> int:
    """Hash of one full block: ``hash((namespace, h_{i-1}, tokens))``, stable within a process."""
    return hash((namespace, parent_hash, tokens_B))


class OutOfBlocks(RuntimeError):
    """Not enough free or evictable blocks; the call that raised it changed nothing."""

    def __init__(self, needed: int, free: int, cached: int, reused: int = 0) -> None:
        self.needed = needed
        self.available = free + cached - reused
        super().__init__(
            f"need {needed} fresh KV blocks, {self.available} available ({free} free + "
            f"{cached} cached-unused - {reused} cached that this request reuses)"
        )


class KVPool:
    """The K and V tensors of every layer, in blocks of ``block_size`` token slots."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        """Allocate ``k`` and ``v``, each ``[num_layers, num_blocks * block_size + 1, Hkv, D]``
        (the last slot is :attr:`scratch_slot`).

        Allocated empty, so on a CPU the operating system backs only the pages that KV is
        written to (memory grows with the KV in use, not the budget). The only slot ever read
        before being written is slot 0 (attention pads every row's context with it, at weight
        0), and it is zeroed: NaN garbage there would poison the padded rows (0 x NaN = NaN).
        """
        if min(num_layers, num_kv_heads, head_dim, block_size, num_blocks) < 1:
            raise ValueError("every KVPool dimension must be >= 1")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_blocks * block_size
        self.scratch_slot = self.num_slots
        """One slot past the blocks, never read: the padding rows of a captured decode step
        write their keys and values there."""
        shape = (num_layers, self.num_slots + 1, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, 0].zero_()
        self.v[:, 0].zero_()
        self.bytes_per_block = KVPool.block_bytes(
            num_layers, num_kv_heads, head_dim, block_size, dtype
        )

    def copy_slots(self, src_N: torch.Tensor, dst_N: torch.Tensor) -> None:
        """Copy the keys and values in slots ``src_N`` to slots ``dst_N`` (``int64[N]`` each),
        every layer: a row that shares another's prompt takes its KV without computing it."""
        self.k.index_copy_(1, dst_N, self.k.index_select(1, src_N))
        self.v.index_copy_(1, dst_N, self.v.index_select(1, src_N))

    @property
    def nbytes(self) -> int:
        """Bytes of both tensors."""
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def block_bytes(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes of one block: K and V, every layer, ``block_size`` tokens."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @staticmethod
    def blocks_for_budget(
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks fit in ``budget_bytes``; a ``ValueError`` if not even one."""
        per = KVPool.block_bytes(num_layers, num_kv_heads, head_dim, block_size, dtype)
        n = budget_bytes // per
        if n < 1:
            elem = per // (2 * num_layers * block_size * num_kv_heads * head_dim)
            raise ValueError(
                f"KV budget of {budget_bytes} bytes is below one block of {per} bytes "
                f"(2 x {num_layers} layers x {block_size} tokens x {num_kv_heads} kv heads "
                f"x {head_dim} dims x {elem} bytes)"
            )
        return int(n)


@dataclass(slots=True)
class _Entry:
    """What an indexed block holds, compared on every lookup."""

    hash: int
    namespace: Hashable
    parent_uid: int | None
    uid: int
    tokens: tuple[int, ...]

    def holds(self, namespace: Hashable, parent_uid: int | None, tokens: tuple[int, ...]) -> bool:
        """Whether this block's KV is that of ``tokens`` after the entry ``parent_uid``."""
        same_kv_key = self.parent_uid == parent_uid and self.tokens == tokens
        return same_kv_key and self.namespace == namespace


@dataclass(eq=False)
class Allocation:
    """One sequence's blocks (the handle ``BlockManager`` hands out; use it for nothing else)."""

    seq_id: int
    namespace: Hashable
    block_size: int
    block_table: list[int]
    """Block ids, position ``p`` lives in ``block_table[p // block_size]``."""
    num_cached_tokens: int
    """Tokens whose KV was found in the prefix index at allocation (a multiple of block_size)."""
    num_tokens: int
    """Tokens that have a slot: prompt + reserve + appended."""
    num_committed_blocks: int = 0
    """Leading blocks already passed to the index (matched at allocation, or committed)."""
    chain_hash: int | None = None
    """Hash of the last committed block's chain: the parent of the next one."""
    chain_uid: int | None = None
    """Uid of the index entry holding the same KV as the last committed block."""
    indexable: bool = True
    """False once the namespace was retired or the chain hit a colliding hash."""
    freed: bool = False

    def slots(self, start: int, end: int) -> list[int]:
        """Pool slot of each position in ``[start, end)`` (to write KV or gather it), int list."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"positions [{start}, {end}) outside [0, {self.num_tokens})")
        bs, p = self.block_size, start
        out: list[int] = []
        while p < end:
            base = self.block_table[p // bs] * bs
            stop = min(end, (p // bs + 1) * bs)
            out.extend(range(base + p % bs, base + (stop - 1) % bs + 1))
            p = stop
        return out

    def slots_tensor(
        self, start: int, end: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """``slots(start, end)`` as an int64 tensor ``[end - start]``."""
        return torch.tensor(self.slots(start, end), dtype=torch.int64, device=device)


@dataclass(frozen=True)
class KVCacheStats:
    """Counters for metrics (blocks, bytes, prefix-cache hits, evictions)."""

    blocks_total: int
    blocks_free: int
    blocks_cached: int
    """Indexed blocks at ref 0, in the LRU: reusable by a match, evictable."""
    blocks_in_use: int
    blocks_indexed: int
    bytes_in_use: int
    prefix_queries: int
    """Allocations: each looks its prompt up once (a preempted row counts again)."""
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    """Cached blocks taken from the LRU for fresh use (dropped from the index)."""

    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens found cached (0.0 before any query)."""
        q = self.prefix_query_tokens
        return self.prefix_hit_tokens / q if q else 0.0


class BlockManager:
    """Ref-counted KV blocks, a free list, an LRU of cached unused blocks and a prefix index."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        bytes_per_block: int = 0,
        hash_fn: HashFn = block_hash,
    ) -> None:
        """``bytes_per_block`` only feeds ``stats().bytes_in_use``; ``hash_fn`` is for tests."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._hash_fn = hash_fn
        self._ref = [0] * num_blocks
        self._entry: list[_Entry | None] = [None] * num_blocks
        # A stack: the block freed last is taken first, so steady serving keeps reusing the same
        # (resident) blocks and a lazily mapped pool is touched only up to its peak use.
        self._free: deque[int] = deque(range(num_blocks - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._index: dict[int, int] = {}  # chain hash -> block id
        self._by_ns: dict[Hashable, set[int]] = {}  # namespace -> indexed block ids
        self._live: dict[Hashable, dict[int, Allocation]] = {}  # namespace -> seq_id -> handle
        self._next_uid = 0
        self._next_seq = 0
        self._queries = self._query_tokens = self._hit_tokens = self._evictions = 0

    # ---- lookups -------------------------------------------------------------------------

    def _walk(
        self, namespace: Hashable, tokens: Sequence[int]
    ) -> tuple[list[int], int | None, int | None]:
        """Matched blocks and the chain (hash, uid) of the last one."""
        bs = self.block_size
        blocks: list[int] = []
        h: int | None = None
        uid: int | None = None
        for i in range((len(tokens) - 1) // bs if tokens else 0):  # never the whole prompt
            t = tuple(tokens[i * bs : (i + 1) * bs])
            nh = self._hash_fn(namespace, h, t)
            b = self._index.get(nh)
            if b is None:
                break
            e = self._entry[b]
            assert e is not None
            if not e.holds(namespace, uid, t):
                break  # a collision: a different block sits under this hash
            blocks.append(b)
            h, uid = nh, e.uid
        return blocks, h, uid

    def match(self, namespace: Hashable, tokens: Sequence[int]) -> tuple[list[int], int]:
        """Longest indexed prefix of ``tokens`` in whole blocks, leaving >= 1 token: (ids, n)."""
        blocks, _, _ = self._walk(namespace, tokens)
        return blocks, len(blocks) * self.block_size

    def _available(self) -> int:
        return len(self._free) + len(self._lru)

    def _plan(
        self, namespace: Hashable, tokens: Sequence[int], reserve: int
    ) -> tuple[int, int, list[int], int | None, int | None]:
        """(fresh blocks needed, matched blocks now in the LRU, matched, chain hash, chain uid)."""
        blocks, h, uid = self._walk(namespace, tokens)
        total = -(-(len(tokens) + reserve) // self.block_size)
        revived = sum(1 for b in blocks if self._ref[b] == 0)  # they leave the LRU: not evictable
        return total - len(blocks), revived, blocks, h, uid

    def can_allocate(self, namespace: Hashable, tokens: Sequence[int], reserve: int = 0) -> bool:
        """Whether ``allocate`` with these arguments would succeed now."""
        need, revived, _, _, _ = self._plan(namespace, tokens, reserve)
        return need <= self._available() - revived

    def can_append(self, alloc: Allocation, n: int) -> bool:
        """Whether ``append(alloc, n)`` would succeed now."""
        return self._blocks_to_grow(alloc, n) <= self._available()

    # ---- sequence lifecycle --------------------------------------------------------------

    def allocate(self, namespace: Hashable, tokens: Sequence[int], reserve: int = 0) -> Allocation:
        """Blocks for a new sequence: its cached prefix (shared) + fresh ones for the rest and
        ``reserve`` more tokens. ``OutOfBlocks`` and no change if it does not fit."""
        if not tokens:
            raise ValueError("a sequence needs at least one token")
        if reserve < 0:
            raise ValueError(f"reserve={reserve} must be >= 0")
        need, revived, blocks, h, uid = self._plan(namespace, tokens, reserve)
        if need > self._available() - revived:
            raise OutOfBlocks(need, len(self._free), len(self._lru), revived)
        for b in blocks:  # revive before taking fresh ones, so eviction cannot pick them
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1
        table = blocks + [self._take_fresh() for _ in range(need)]
        n_cached = len(blocks) * self.block_size
        self._queries += 1
        self._query_tokens += len(tokens)
        self._hit_tokens += n_cached
        alloc = Allocation(
            seq_id=self._next_seq,
            namespace=namespace,
            block_size=self.block_size,
            block_table=table,
            num_cached_tokens=n_cached,
            num_tokens=len(tokens) + reserve,
            num_committed_blocks=len(blocks),
            chain_hash=h,
            chain_uid=uid,
        )
        self._next_seq += 1
        self._live.setdefault(namespace, {})[alloc.seq_id] = alloc
        return alloc

    def _blocks_to_grow(self, alloc: Allocation, n: int) -> int:
        if alloc.freed:
            raise ValueError(f"sequence {alloc.seq_id} was freed")
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        return -(-(alloc.num_tokens + n) // self.block_size) - len(alloc.block_table)

    def append(self, alloc: Allocation, n: int = 1) -> None:
        """Room for ``n`` more tokens (fresh blocks as needed); ``OutOfBlocks`` changes nothing."""
        need = self._blocks_to_grow(alloc, n)
        if need > self._available():
            raise OutOfBlocks(need, len(self._free), len(self._lru))
        alloc.block_table.extend(self._take_fresh() for _ in range(need))
        alloc.num_tokens += n

    def commit(self, alloc: Allocation, tokens: Sequence[int]) -> int:
        """Index every block that ``tokens`` (whose KV is all written) filled since the last
        commit; returns how many blocks became full. Blocks already indexed by another row with
        the same content stay unindexed duplicates."""
        if alloc.freed:
            raise ValueError(f"sequence {alloc.seq_id} was freed")
        if len(tokens) > alloc.num_tokens:
            raise ValueError(f"{len(tokens)} tokens committed, only {alloc.num_tokens} have slots")
        bs, ns = self.block_size, alloc.namespace
        full = len(tokens) // bs
        start = alloc.num_committed_blocks
        for i in range(start, full if alloc.indexable else start):
            t = tuple(tokens[i * bs : (i + 1) * bs])
            h = self._hash_fn(ns, alloc.chain_hash, t)
            b = self._index.get(h)
            if b is None:
                b = alloc.block_table[i]
                e = _Entry(h, ns, alloc.chain_uid, self._next_uid, t)
                self._next_uid += 1
                self._entry[b] = e
                self._index[h] = b
                self._by_ns.setdefault(ns, set()).add(b)
            else:
                found = self._entry[b]
                assert found is not None
                if not found.holds(ns, alloc.chain_uid, t):
                    alloc.indexable = False  # collision: this chain cannot be reached past here
                    break
                e = found  # a duplicate: chain onto the indexed copy, keep ours unindexed
            alloc.chain_hash, alloc.chain_uid = h, e.uid
        alloc.num_committed_blocks = max(start, full)
        return max(0, full - start)

    def free(self, alloc: Allocation) -> None:
        """Release a finished, cancelled or preempted sequence: ref -1 on each of its blocks;
        at ref 0 an indexed block joins the LRU tail (deepest first), another the free list."""
        if alloc.freed:
            raise ValueError(f"sequence {alloc.seq_id} freed twice")
        alloc.freed = True
        for b in reversed(alloc.block_table):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._entry[b] is not None:
                    self._lru[b] = None
                else:
                    self._free.append(b)
        alloc.block_table = []
        live = self._live[alloc.namespace]
        del live[alloc.seq_id]
        if not live:
            del self._live[alloc.namespace]

    def _take_fresh(self) -> int:
        """A block at ref 1: from the free list, else the LRU head (evicted from the index)."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._lru.popitem(last=False)
            self._unindex(b)
            self._evictions += 1
        self._ref[b] = 1
        return b

    def _unindex(self, b: int) -> None:
        e = self._entry[b]
        assert e is not None
        self._entry[b] = None
        del self._index[e.hash]
        blocks = self._by_ns[e.namespace]
        blocks.discard(b)
        if not blocks:
            del self._by_ns[e.namespace]

    # ---- retirement ----------------------------------------------------------------------

    def retire(self, namespace: Hashable) -> int:
        """Unindex every block of ``namespace`` now (ref-0 ones go free) and stop its running
        rows from indexing more; returns the number of blocks unindexed."""
        blocks = self._by_ns.get(namespace, set())
        n = len(blocks)
        for b in list(blocks):
            self._unindex(b)
            if self._ref[b] == 0:
                del self._lru[b]
                self._free.append(b)
        for alloc in self._live.get(namespace, {}).values():
            alloc.indexable = False
        return n

    def retire_where(self, predicate: Callable[[Hashable], bool]) -> int:
        """``retire`` every namespace (indexed or running) for which ``predicate`` is true."""
        namespaces = set(self._by_ns) | set(self._live)
        return sum(self.retire(ns) for ns in namespaces if predicate(ns))

    def retire_all(self) -> int:
        """``retire`` every namespace (new base weights: no KV in the pool is valid any more)."""
        return self.retire_where(lambda _: True)

    # ---- metrics and checks --------------------------------------------------------------

    def stats(self) -> KVCacheStats:
        """The counters, O(1)."""
        in_use = self.num_blocks - len(self._free) - len(self._lru)
        return KVCacheStats(
            blocks_total=self.num_blocks,
            blocks_free=len(self._free),
            blocks_cached=len(self._lru),
            blocks_in_use=in_use,
            blocks_indexed=len(self._index),
            bytes_in_use=in_use * self.bytes_per_block,
            prefix_queries=self._queries,
            prefix_query_tokens=self._query_tokens,
            prefix_hit_tokens=self._hit_tokens,
            evictions=self._evictions,
        )

    def ref_count(self, block: int) -> int:
        """Live sequences holding ``block``."""
        return self._ref[block]

    def check_invariants(self) -> None:
        """Scan the whole pool and assert the lists and the index agree (O(pool): tests only)."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free) and not free & lru, "a block is listed twice"
        for b in range(self.num_blocks):
            e, r = self._entry[b], self._ref[b]
            assert r >= 0
            assert (b in free) == (r == 0 and e is None), f"block {b}: free list"
            assert (b in lru) == (r == 0 and e is not None), f"block {b}: LRU"
            if e is not None:
                assert self._index.get(e.hash) == b and b in self._by_ns[e.namespace]
        assert len(self._index) == sum(len(s) for s in self._by_ns.values())
