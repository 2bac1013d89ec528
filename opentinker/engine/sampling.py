"""Sampling on the device: temperature, top-k and top-p for all rows at once, batch-invariant.

Design. A row draws ``argmax(logits / T + g)`` over its truncated set (Gumbel-max: the
argmax of log-probabilities plus i.i.d. standard Gumbel noise is an exact draw from the
softmax), and reports ``log_softmax(logits / T)[token]`` before truncation, in float32
(../shared/DESIGN.md §6). Truncation follows ``opentinker/sampler.py``'s ``_truncate``: top-k
first (0 = off; ties at the k-th value kept), then top-p on the top-k-renormalised softmax
(1 = off; the smallest set whose mass reaches ``top_p``, including the crossing token).

Randomness. The noise for (row, vocabulary id ``v``) is ``g = -log(-log(u))`` with
``u = U(seed, position, v)``: a counter-based hash, no generator state. ``seed`` (all 64 bits)
and ``position`` (the absolute position of the token being drawn) are absorbed into a 32-bit
row key by four rounds of Wellons' lowbias32 finalizer; the key is XORed with the hashed
vocabulary id and finalized once more. The top 23 bits give ``u = (m + 0.5) / 2**23``, exact
in float32 and strictly inside (0, 1). Nothing depends on the batch, so a seeded row draws
the same tokens alone, among other rows, or after joining a running batch.

Shape of a draw (:func:`draw`). The row keys of the whole batch are hashed once; then the
vocabulary is cut into ``n = ceil(V / _TILE)`` column tiles of equal width (chosen from V
alone). Per tile: the noise, ``x = logits / T``, the tile's log-sum-exp, and ``max(x + g)``
with its index; the tiles are combined by one ``argmax`` over the tiles' maxima (the first
maximum wins, so ties go to the lower vocabulary id, exactly as a full-row ``argmax``) and
one ``logsumexp`` over their log-sum-exps. So the number of ATen ops (kernels) depends on V
and the top-k/top-p flags, never on B, and the tokens are bitwise those of
``argmax(kept + g)`` over the whole row. The plain path (no top-k, no top-p) makes no host
sync and branches on nothing but shapes and host flags: it can be captured in a CUDA graph
(after one eager call, which fills the per-(V, device) caches and compiles the kernel).

Fused CUDA path. On CUDA with Triton, one kernel (:func:`_gumbel_max_kernel`) does hash ->
uniform -> Gumbel -> add -> running argmax and the log-sum-exp for a (row, vocabulary chunk)
per program, reading the logits once in their own dtype; three small torch ops combine the
chunks. It is a function of (seed, position, logits) only, like the torch path, and is
written to draw the torch CUDA path's tokens bit for bit: the integer hash and ``u`` are
exact, the division is ``div_rn`` (IEEE, as torch's), the Gumbel logs are libdevice's
``logf`` without flush-to-zero and without fma contraction (as nvcc builds torch's ``log``).
Whether it is bitwise equal to the torch CUDA path is checked by ``tests/test_sampling_ops.py``
on a GPU (not yet run: written on a CPU machine, tested under ``TRITON_INTERPRET=1``). Its
log-sum-exp (fast ``exp``) matches to ~1e-6, not bitwise. Neither CUDA path is bitwise equal
to the CPU path: the integer hash and ``u`` are, but CPU (Sleef) and CUDA ``log`` may differ
by an ulp on the same float, so a near-tie may resolve differently. ``_FUSED_ON_CUDA = False``
sends CUDA through the torch path.

Overflow. The torch hash runs on int64 tensors holding uint32 values. Multipliers are stored
as signed 32-bit constants (``c - 2**32`` when ``c >= 2**31``), so every product has
magnitude below ``2**32 * 2**31 = 2**63`` and never overflows; masking with ``0xFFFFFFFF``
(two's complement) then yields exactly the uint32 product mod ``2**32``. Shifts act on values
in ``[0, 2**32)`` only, so arithmetic and logical shifts agree. The Triton kernel uses uint32
arithmetic (wrapping multiply, logical shifts): the same values.

Memory. The torch path's scratch is per tile: the int64 hash and one int64 shift buffer (16
bytes an element), then float32 noise, the tempered logits and log-sum-exp's temporary
(12 bytes an element); the plain path never holds a ``[B, V]`` float32 tensor. With
``_TILE = 2**14`` columns that is ``16 * B * 16384`` bytes at most: 64 MiB at B = 256 (62 MB
at V = 151,936, tiles of 15,194), and it grows linearly with B (the price of an op count
independent of B). Top-k/top-p rows add the ``[B, V]`` tempered logits and the truncated copy
(8 bytes an element) and :func:`truncate`'s sorts. The fused kernel's scratch is
``[B, n_chunks]``.

Deviations and hazards.
* Ties. Both cuts are value thresholds: every token equal to the k-th value, or to the token
  that crosses ``top_p``, is kept. On tie-free logits this is ``_truncate``'s set (up to
  float32 rounding of the cumulative mass; tested equal on random logits); on ties,
  ``_truncate``'s nucleus depends on an unstable sort and ours does not (bf16 logits tie).
* Top-p reads the sorted prefix from one ``topk`` of ``_PREFIX`` entries and fully sorts only
  the rows whose nucleus is longer (a full sort of a 32 x 49k batch costs ~50-100 ms on this
  CPU). Finding those rows is a host sync, one per step that has a top-p row; top-k with
  ``max_top_k >= V`` costs another. Those paths are not graph-capturable.
* Resolution. ``u`` has 23 bits, so ``g`` lies in [-2.81, 16.64]: a token ``e**19.45``
  (3e8) times less likely than the row's best is never drawn.
* Batch invariance rests on elementwise kernels giving an element the same bits wherever it
  sits in the batch: tested on this CPU build (vector and scalar tails agree), expected of
  CUDA (every element runs the same code). Per-row reductions (log-sum-exp) may reorder
  with the batch shape, so log-probs are compared to 1e-6, not bitwise; the tiled
  log-sum-exp (a ``logsumexp`` of per-tile ones) differs from a one-pass one by rounding.
* The row key has 32 bits: two (seed, position) pairs share a noise vector with probability
  2**-32 (harmless: their draws are then merely not independent of each other).
* Near-ties in ``logits / T + g`` resolve to the lower id; NaN logits are not checked (a
  check would cost a device sync every step): the torch path draws the first NaN, as
  ``argmax`` does; the fused kernel treats a NaN as ``+inf``. The log-prob is NaN either way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from protocols.messages import SamplingParams

from opentinker.engine.gumbel_kernel import _BLOCK, _CHUNK, _gumbel_max_fused, _interpret, triton  # noqa: F401

_MASK32 = 0xFFFF_FFFF
_M1 = 0x7FEB352D  # lowbias32 multipliers (Wellons, hash-prospector), as signed 32-bit
_M2 = 0x846CA68B - (1 << 32)
_SALTS = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1)  # domain separation
_TILE = 1 << 14
"""Most vocabulary columns per tile of the torch path (tiles: ``ceil(V / _TILE)``)."""
_PREFIX = 1024
"""Sorted entries per row read by ``topk`` before falling back to a full sort for top-p."""
_FUSED_ON_CUDA = True
"""CUDA logits go through the Triton kernel when Triton imports (False: the torch path)."""


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finalizer, in place, on int64 holding values in ``[0, 2**32)``."""
    tmp = torch.empty_like(x)  # one scratch buffer: fresh large tensors cost page faults
    for shift, mult in ((16, _M1), (15, _M2)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))
        x.mul_(mult).bitwise_and_(_MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))


def _row_keys(seed_B: torch.Tensor, position_B: torch.Tensor) -> torch.Tensor:
    """``int64[B]`` 32-bit keys absorbing all 64 bits of each seed and position."""
    k_B = _mix32_((seed_B & _MASK32) ^ _SALTS[0])
    for word_B, salt in (((seed_B >> 32) & _MASK32, _SALTS[1]),
                         (position_B & _MASK32, _SALTS[2]),
                         ((position_B >> 32) & _MASK32, _SALTS[3])):
        k_B = _mix32_(k_B ^ word_B ^ salt)
    return k_B


@functools.lru_cache(maxsize=8)
def _vocab_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``int64[V]`` hashed vocabulary ids (a bijection of ``arange(V)``), cached per device."""
    return _mix32_(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _SALTS[4])


def uniforms(seed_B: torch.Tensor, position_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``float32[B, V]`` uniforms ``U(seed, position, v)`` on a grid of ``2**23``, in (0, 1)."""
    keys_B = _row_keys(seed_B.long(), position_B.long())
    h_B_V = keys_B[:, None] ^ _vocab_keys(vocab_size, seed_B.device)
    return _unit(_mix32_(h_B_V))


def _unit(h: torch.Tensor) -> torch.Tensor:
    """uint32 hashes (int64, overwritten) to float32 ``(m + 0.5) / 2**23``, ``m`` their top 23
    bits: exact, and strictly inside (0, 1)."""
    return h.bitwise_right_shift_(9).to(torch.float32).add_(0.5).mul_(2.0**-23)


def truncate(x_B_V: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor,
             max_top_k: int, any_top_p: bool) -> torch.Tensor:
    """Tempered logits ``x_B_V`` with everything outside each row's top-k / nucleus at -inf.

    ``max_top_k`` bounds ``top_k_B`` (0: no row uses top-k); ``any_top_p``: some row has
    ``top_p < 1``. Rows with ``top_k == 0`` or ``top_k >= V`` and ``top_p == 1`` are untouched.
    Host syncs: one when ``max_top_k >= V`` (to tighten it), one when ``any_top_p`` and
    ``V > _PREFIX`` (to find the rows whose nucleus outruns the prefix).
    """
    B, V = x_B_V.shape
    neg_inf = float("-inf")
    if max_top_k >= V:  # rows with top_k >= V are no-ops: ask the device for a tighter bound
        max_top_k = int(torch.where(top_k_B < V, top_k_B, 0).amax())
    K = min(V, max(max_top_k, _PREFIX if any_top_p else 0))
    vals_B_K = torch.topk(x_B_V, K, dim=-1).values  # sorted, descending
    if max_top_k > 0:
        use_k_B = (top_k_B > 0) & (top_k_B < V)
        kth_B = vals_B_K.gather(1, (top_k_B.long().clamp(1, K) - 1)[:, None])[:, 0]
        kth_B = torch.where(use_k_B, kth_B, neg_inf)
        x_B_V = x_B_V.masked_fill(x_B_V < kth_B[:, None], neg_inf)
        vals_B_K = vals_B_K.masked_fill(vals_B_K < kth_B[:, None], neg_inf)
    if not any_top_p:
        return x_B_V
    use_p_B = top_p_B < 1
    lse_B = torch.logsumexp(x_B_V, dim=-1)
    cut_B, done_B = _nucleus_cut(vals_B_K, lse_B, top_p_B)
    if K < V:  # rows whose nucleus runs past the prefix: sort those rows in full
        late_R = (use_p_B & ~done_B).nonzero()[:, 0]
        if late_R.numel() > 0:
            full_R_V = torch.sort(x_B_V[late_R], dim=-1, descending=True).values
            cut_B[late_R] = _nucleus_cut(full_R_V, lse_B[late_R], top_p_B[late_R])[0]
    cut_B = torch.where(use_p_B, cut_B, neg_inf)
    return x_B_V.masked_fill(x_B_V < cut_B[:, None], neg_inf)


def _nucleus_cut(sorted_B_K: torch.Tensor, lse_B: torch.Tensor, top_p_B: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept value per row, and whether the prefix reached the crossing token.

    ``sorted_B_K``: the first K tempered, top-k-masked logits in descending order; ``lse_B``:
    their full-row log-sum-exp. A token is dropped when the mass before it is ``>= top_p``.
    """
    p_B_K = torch.exp(sorted_B_K - lse_B[:, None])
    drop_B_K = p_B_K.cumsum(-1) - p_B_K >= top_p_B[:, None]  # float32 compare, as _truncate
    cut_B = sorted_B_K.masked_fill(drop_B_K, float("inf")).amin(-1)
    done_B = drop_B_K[:, -1] | (sorted_B_K[:, -1] == float("-inf"))
    return cut_B, done_B


# ------------------------------------------------------------------ noise + argmax, torch


def _tiles(vocab_size: int) -> list[tuple[int, int]]:
    """Column ranges ``[c0, c1)`` of the torch path: ``ceil(V / _TILE)`` tiles of equal width
    (the last one shorter), a function of V alone."""
    n = -(-vocab_size // _TILE)
    width = -(-vocab_size // n)
    return [(c0, min(vocab_size, c0 + width)) for c0 in range(0, vocab_size, width)]


@functools.lru_cache(maxsize=8)
def _tile_starts(vocab_size: int, tile: int, device: torch.device) -> torch.Tensor:
    """``int64[n]`` first column of each tile, cached per device (``tile`` is ``_TILE``, in the
    key because tests vary it)."""
    return torch.tensor([c0 for c0, _ in _tiles(vocab_size)], dtype=torch.int64, device=device)


def _tempered(logits_B_W: torch.Tensor, temperature_B1: torch.Tensor) -> torch.Tensor:
    """``float32`` ``logits / T``; bf16/fp16 logits are widened inside the division (exact, so
    the same bits as ``logits.float() / T``)."""
    if logits_B_W.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        logits_B_W = logits_B_W.float()
    return torch.div(logits_B_W, temperature_B1)


def _gumbel_max_torch(logits_B_V: torch.Tensor, temperature_B1: torch.Tensor,
                      keys_B1: torch.Tensor, x_B_V: torch.Tensor | None,
                      kept_B_V: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(argmax(kept + g), logsumexp(x))`` per row, in column tiles (see the module docstring).

    ``x_B_V``/``kept_B_V``: the tempered logits and their truncation, when top-k/top-p made
    them; None on the plain path, which tempers each tile of ``logits_B_V`` itself."""
    V = logits_B_V.shape[1]
    vkeys_V = _vocab_keys(V, logits_B_V.device)
    best, arg, lse = [], [], []
    for c0, c1 in _tiles(V):
        # -log(-log(u)) without the last negation: kept + (-t) and kept - t are the same float
        t_B_W = _unit(_mix32_(keys_B1 ^ vkeys_V[c0:c1])).log_().neg_().log_()
        x_B_W = (_tempered(logits_B_V[:, c0:c1], temperature_B1) if x_B_V is None
                 else x_B_V[:, c0:c1])
        lse.append(torch.logsumexp(x_B_W, dim=-1))
        y_B_W = x_B_W if kept_B_V is None else kept_B_V[:, c0:c1]
        best_B, arg_B = torch.sub(y_B_W, t_B_W, out=t_B_W).max(dim=-1)  # first max on ties
        best.append(best_B)
        arg.append(arg_B)
        del t_B_W, x_B_W, y_B_W
    tile_B1 = torch.stack(best, dim=1).argmax(dim=1, keepdim=True)  # first tile on ties
    arg_B_N = torch.stack(arg, dim=1).add_(_tile_starts(V, _TILE, logits_B_V.device))
    return arg_B_N.gather(1, tile_B1)[:, 0], torch.logsumexp(torch.stack(lse, dim=1), dim=1)


# ------------------------------------------------------------------ draw


def draw(logits_B_V: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
         top_p_B: torch.Tensor, seed_B: torch.Tensor, position_B: torch.Tensor,
         max_top_k: int, any_top_p: bool, forced_B: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample` without validation: ``(tokens_B int64, logprobs_B float32)``.

    ``forced_B`` (``int64[B]``, optional): a row's token where ``>= 0`` instead of the drawn
    one, with its log-prob under the same distribution (a reply scored, not sampled).

    ``max_top_k`` (>= every ``top_k_B``; 0: no row uses top-k) and ``any_top_p`` (some
    ``top_p_B < 1``) are host-side flags (see :func:`truncate`). Every row is drawn at once:
    the ATen ops (GPU kernels) launched depend on V, the flags and the device, never on B.
    With ``max_top_k == 0 and not any_top_p`` there is no host sync and no branch on data, so
    the call can be captured in a CUDA graph (warm it up once first, to fill the caches);
    top-k/top-p add :func:`truncate`'s documented syncs.
    """
    B, V = logits_B_V.shape
    if V == 0:
        raise ValueError("logits_B_V has an empty vocabulary")
    temperature_B = temperature_B.float()
    T_B1 = temperature_B[:, None]
    empty = logits_B_V.new_empty(0)
    x_B_V = kept_B_V = empty
    if max_top_k > 0 or any_top_p:
        x_B_V = _tempered(logits_B_V, T_B1)
        kept_B_V = truncate(x_B_V, top_k_B, top_p_B.float(), max_top_k, any_top_p)
    tokens_B, lse_B = gumbel_max(logits_B_V, temperature_B, seed_B, position_B, x_B_V, kept_B_V)
    if forced_B is not None:
        tokens_B = torch.where(forced_B >= 0, forced_B, tokens_B)
    x_tok_B = _tempered(logits_B_V.gather(1, tokens_B[:, None]), T_B1)[:, 0]  # x_B_V's bits
    return tokens_B, x_tok_B - lse_B


def _gumbel_max(logits_B_V: torch.Tensor, temperature_B: torch.Tensor, seed_B: torch.Tensor,
                position_B: torch.Tensor, x_B_V: torch.Tensor, kept_B_V: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(argmax(kept + g), logsumexp(x))`` per row, g the (seed, position) Gumbel noise: the
    rows' keys hashed once, then the fused kernel (CUDA) or the tiles (elsewhere). ``x_B_V`` and
    ``kept_B_V`` are empty on the plain path (the tiles temper the logits themselves)."""
    keys_B = _row_keys(seed_B.long(), position_B.long())
    x = x_B_V if x_B_V.numel() else None
    kept = kept_B_V if kept_B_V.numel() else None
    if logits_B_V.is_cuda and _FUSED_ON_CUDA and triton is not None:
        return _gumbel_max_fused(logits_B_V, temperature_B, keys_B, kept)
    return _gumbel_max_torch(logits_B_V, temperature_B[:, None], keys_B[:, None], x, kept)


# One op to the dispatcher (a decode step's op count is its kernels on CUDA; see
# opentinker/engine/model/ops.py): noise, argmax and log-sum-exp of every row.
_LIB = torch.library.Library("opentinker", "FRAGMENT")
_LIB.define("gumbel_max(Tensor logits, Tensor temperature, Tensor seed, Tensor position, Tensor x, Tensor kept) "
            "-> (Tensor, Tensor)")
for _key in ("CPU", "CUDA"):
    _LIB.impl("gumbel_max", _gumbel_max, _key)
gumbel_max = torch.ops.opentinker.gumbel_max.default




def sample(logits_B_V: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
           top_p_B: torch.Tensor, seed_B: torch.Tensor, position_B: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row: ``(tokens_B int64, logprobs_B float32)`` on the logits' device.

    ``logits_B_V`` (any float dtype; computed in float32), ``temperature_B`` (> 0),
    ``top_k_B`` (int, >= 0), ``top_p_B`` (in (0, 1]), ``seed_B`` (int64), ``position_B``
    (int64, >= 0: absolute position of the token being drawn). Validates, which reads one
    small tensor back to the host; :meth:`SamplingBatch.sample` skips that.
    """
    if logits_B_V.dim() != 2 or not logits_B_V.is_floating_point():
        raise ValueError(f"logits_B_V must be a 2-D float tensor, got {tuple(logits_B_V.shape)}")
    B = logits_B_V.shape[0]
    rows = {"temperature_B": temperature_B, "top_k_B": top_k_B, "top_p_B": top_p_B,
            "seed_B": seed_B, "position_B": position_B}
    for name, t in rows.items():
        if t.shape != (B,) or t.device != logits_B_V.device:
            raise ValueError(f"{name} must have shape ({B},) on {logits_B_V.device}, "
                             f"got {tuple(t.shape)} on {t.device}")
        if t.is_floating_point() != (name in ("temperature_B", "top_p_B")):
            raise ValueError(f"{name} has the wrong dtype {t.dtype}")
    zero = torch.zeros((), dtype=torch.int64, device=logits_B_V.device)
    bad = torch.stack([(~(temperature_B > 0)).any(), (~((top_p_B > 0) & (top_p_B <= 1))).any(),
                       (top_k_B < 0).any(), (position_B < 0).any()]).long()
    stats = torch.cat([bad, top_k_B.amax()[None] if B else zero[None],
                       (top_p_B.float() < 1).any()[None].long()]).tolist()
    for flag, msg in zip(stats[:4], ("temperature_B must be > 0", "top_p_B must be in (0, 1]",
                                     "top_k_B must be >= 0", "position_B must be >= 0")):
        if flag:
            raise ValueError(msg)
    return draw(logits_B_V, temperature_B, top_k_B, top_p_B, seed_B, position_B,
                 int(stats[4]), bool(stats[5]))


def check_distribution(p: SamplingParams) -> None:
    """Raise ``ValueError`` naming the bad field of the distribution ``p`` defines
    (temperature, top-p, top-k)."""
    if not p.temperature > 0:
        raise ValueError(f"SamplingParams.temperature must be > 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise ValueError(f"SamplingParams.top_k must be >= 0, got {p.top_k}")


def _int64(n: int) -> int:
    """A Python int taken mod ``2**64`` as a signed int64 (so ``seed + row`` never overflows)."""
    return (int(n) + (1 << 63)) % (1 << 64) - (1 << 63)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling tensors on one device, built once, plus host-side dispatch flags."""

    temperature_B: torch.Tensor
    """``float32[B]``, > 0."""
    top_k_B: torch.Tensor
    """``int64[B]``; 0 disables."""
    top_p_B: torch.Tensor
    """``float32[B]`` in (0, 1]; 1 disables."""
    seed_B: torch.Tensor
    """``int64[B]``: Python seeds taken mod ``2**64``."""
    position_B: torch.Tensor
    """``int64[B]``: absolute position of the token each row draws next."""
    max_top_k: int
    """Largest ``top_k`` of any row (0: no top-k work)."""
    any_top_p: bool
    """Some row has ``top_p < 1`` (False: no top-p work)."""

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
                    positions: Sequence[int], device: torch.device | str) -> SamplingBatch:
        """Validate on the host (``ValueError`` naming the field) and build the tensors."""
        for p in params:
            check_distribution(p)
        if len(seeds) != len(params) or len(positions) != len(params):
            raise ValueError(f"seeds ({len(seeds)}) and positions ({len(positions)}) must have "
                             f"one entry per params ({len(params)})")
        if any(q < 0 for q in positions):
            raise ValueError("positions must be >= 0")
        return cls(
            temperature_B=torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                       device=device),
            top_k_B=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p_B=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seed_B=torch.tensor([_int64(s) for s in seeds], dtype=torch.int64, device=device),
            position_B=torch.tensor(list(positions), dtype=torch.int64, device=device),
            max_top_k=max((p.top_k for p in params), default=0),
            any_top_p=any(p.top_p < 1 for p in params),
        )

    def advance(self, n: int = 1) -> SamplingBatch:
        """The same rows ``n`` positions later (after each decode step)."""
        return replace(self, position_B=self.position_B + n)

    def sample(self, logits_B_V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`sample` with this batch's rows: no validation of values (done on the host in
        :meth:`from_params`), so no host sync beyond :func:`truncate`'s."""
        if logits_B_V.dim() != 2 or logits_B_V.shape[0] != self.seed_B.shape[0]:
            raise ValueError(f"logits_B_V must have shape ({self.seed_B.shape[0]}, V), "
                             f"got {tuple(logits_B_V.shape)}")
        return draw(logits_B_V, self.temperature_B, self.top_k_B, self.top_p_B, self.seed_B,
                     self.position_B, self.max_top_k, self.any_top_p)
