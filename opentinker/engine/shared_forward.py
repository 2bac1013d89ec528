"""Hidden states and log-probs at selected positions, computing every shared piece of the
batch once.

A training batch of dialogue turns is mostly repetition: every sequence starts with the same
system prompt and game header, many turns share the whole prompt (the same information
state) and differ only in the reply, and some sequences are identical. This module runs the
transformer body on a three-level tree, exactly (same values and gradients as running every
row in full; a test checks it):

1. the prefix ``P`` common to all sequences, once (batch 1);
2. each distinct *context* (what lies between the common prefix and the token before the
   first loss token), once, continuing from the prefix's KV cache copied to each context;
3. each distinct sequence's *tail*, continuing from its context's KV cache.

:func:`selected_hidden` returns the final hidden states that predict the selected tokens;
the 49k-row vocabulary projection then runs only on those that predict a loss token
(:func:`project_logprobs`), and a value head only on those at value positions. Cache copies
are ``index_select`` s, so gradients flow back into the shared levels.

With the engine's own decoder (a ``tree`` body) the batch is instead laid out as a whole prefix
tree (:func:`token_tree`): every distinct prefix token once, at any depth (episodes of a group
that made the same first moves share those turns as well), in one flat forward whose attention
reads each token's own path (:class:`~opentinker.engine.model.tree_attention.TreeAttention`).
The three levels remain for PEFT's model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from opentinker.engine.model import DenseCache
from opentinker.engine.model.tree_attention import TreeAttention, query_buckets
from opentinker.engine.train_batches import common_prefix
from protocols.messages import token_order

HiddenFn = Callable[..., tuple[torch.Tensor, Any]]
"""A registry's ``hidden(input_ids_B_L, attention_mask_B_T=None, position_ids_B_L=None,
cache=None, use_cache=False) -> (h_B_L_H, cache)``."""
TreeFn = Callable[[torch.Tensor, torch.Tensor, TreeAttention], torch.Tensor]
"""A registry's ``hidden_tree(ids_N, pos_N, attention) -> h_N_H``: final hidden states of ``N``
flat tokens whose attention :class:`~opentinker.engine.model.tree_attention.TreeAttention`
places in a prefix tree (the engine's own decoder; PEFT's model has none)."""


def _unique(keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
    """Indices of first occurrences, and for every key the index of its first occurrence
    within that list."""
    first: dict[bytes, int] = {}
    reps, inverse = [], []
    for i, k in enumerate(keys):
        if k not in first:
            first[k] = len(reps)
            reps.append(i)
        inverse.append(first[k])
    return reps, inverse


class Selected(NamedTuple):
    """What :func:`selected_logprobs` returns."""

    logp_N: torch.Tensor
    """``float32[N]`` log-probs of the selected tokens, in (row, position) order."""
    taken: list[np.ndarray]
    """Per row, the selected positions."""
    entropy_N: torch.Tensor | None
    """``float32[N]`` entropy of the full next-token distribution at each selected position
    (``H = -sum_v p_v log p_v``), when asked for; else ``None``."""


HEAD_ROWS = 256
"""Rows of the vocabulary projection computed at once: its ``HEAD_ROWS x V`` float32 logits
(50 MB for SmolLM2's 49k vocabulary) are the largest tensor; a long SFT batch never holds
``N x V`` (DESIGN §6)."""


def _head_rows(
    lm_head: torch.nn.Module, h_R_H: torch.Tensor, targets_R: torch.Tensor, entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets_R`` and (if asked, else an empty tensor) entropies, for ``R`` rows."""
    logp_R_V = torch.log_softmax(lm_head(h_R_H).float(), -1)
    logp_R = logp_R_V.gather(-1, targets_R[:, None])[:, 0]
    if not entropy:
        return logp_R, logp_R.new_zeros(0)
    src = logp_R_V if entropy_grad else logp_R_V.detach()
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp_R, -(src.exp() * src).sum(-1)


def _project(
    lm_head: torch.nn.Module, h_N_H: torch.Tensor, targets_N: torch.Tensor, entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_head_rows` over ``HEAD_ROWS`` rows at a time; with gradients, each block runs
    under activation checkpointing, so its logits are recomputed in the backward instead of
    kept (as :func:`learners.preferences.chunked_token_logprobs` does)."""
    grad = torch.is_grad_enabled() and h_N_H.requires_grad
    logps, entropies = [], []
    for start in range(0, h_N_H.shape[0], HEAD_ROWS):
        rows = slice(start, start + HEAD_ROWS)
        if grad and h_N_H.shape[0] > HEAD_ROWS:
            lp, ent = checkpoint(_head_rows, lm_head, h_N_H[rows], targets_N[rows], entropy, entropy_grad,
                                 use_reentrant=False)
        else:
            lp, ent = _head_rows(lm_head, h_N_H[rows], targets_N[rows], entropy, entropy_grad)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), (torch.cat(entropies) if entropy else None)


class Hidden(NamedTuple):
    """What :func:`selected_hidden` returns: the body's hidden states that predict the
    selected tokens, each distinct (sequence, positions) row computed once."""

    h_U_H: torch.Tensor
    """``float[U, H]``: for each selected position ``t`` of each DISTINCT row, the final
    hidden state at ``t - 1`` (it has read tokens ``< t``), in (row, position) order."""
    tokens_U: torch.Tensor
    """``int64[U]``: the token at each of those positions (the vocabulary projection's target)."""
    rows: list[np.ndarray]
    """Per input row, ``int64[n_i]``: the entries of ``h_U_H`` of its selected positions."""
    taken: list[np.ndarray]
    """Per input row, its selected positions (ascending)."""

    def at(self, masks: Sequence[np.ndarray] | None = None) -> torch.Tensor:
        """``int64[N]`` entries of ``h_U_H``, in (row, position) order, of the selected
        positions where ``masks[i]`` is nonzero (``None``: every selected position)."""
        if masks is None:
            parts = self.rows
        else:
            parts = [r[np.asarray(m)[p] != 0] for r, p, m in zip(self.rows, self.taken, masks)]
        index = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return torch.as_tensor(index.astype(np.int64), device=self.h_U_H.device)


def selected_hidden(
    body: HiddenFn,
    seqs: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    pad_id: int,
    device: torch.device,
    share: bool = True,
    tree: TreeFn | None = None,
) -> Hidden:
    """Final hidden states before the positions where ``masks[i]`` is nonzero (position 0
    never counts: nothing precedes it), running the shared prefix, contexts and tails once.

    ``body`` is a registry's ``hidden``: the engine's own decoder called directly
    (:meth:`~opentinker.engine.lora_registry.LoraRegistry.hidden`), or PEFT's model for the
    families it does not run. ``share=False`` runs every row in full. With ``tree`` (and
    ``share``) every distinct prefix token runs once instead, in one forward (:func:`token_tree`).
    """
    taken = [np.nonzero(np.asarray(m)[1:])[0] + 1 for m in masks]
    useqs, upos, row_index = _distinct_rows(seqs, taken, share)
    if len(useqs) == 0 or sum(len(p) for p in upos) == 0:
        return Hidden(torch.zeros((0, 0), device=device), torch.zeros(0, dtype=torch.long, device=device),
                      row_index, taken)
    if share and tree is not None:
        h_N, targets = _tree_hidden(tree, useqs, upos, device)
        return Hidden(h_N, targets, row_index, taken)
    shared = _shared_levels(body, useqs, upos, pad_id, device, share)
    h3 = _tails(body, useqs, shared, pad_id, device)
    h_N, targets = _gather_hidden(useqs, upos, shared, h3, device)
    return Hidden(h_N, targets, row_index, taken)


def _distinct_rows(
    seqs: Sequence[np.ndarray], taken: Sequence[np.ndarray], share: bool
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The distinct rows (a sequence with its selected positions ``taken``; with ``share``
    False, every row): their sequences (``int64[T]``), their selected positions, and per input
    row, ``int64[n_i]``, the entries of the distinct rows' selected positions, flat in (row,
    position) order, that are its own."""
    as64 = [np.asarray(s, dtype=np.int64) for s in seqs]
    if share:
        reps, inverse = _unique([s.tobytes() + b"|" + p.tobytes() for s, p in zip(as64, taken)])
    else:
        reps, inverse = list(range(len(seqs))), list(range(len(seqs)))
    useqs = [as64[i] for i in reps]
    upos = [taken[i] for i in reps]
    starts = np.concatenate([[0], np.cumsum([len(p) for p in upos])]).astype(np.int64)
    row_index = [np.arange(starts[u], starts[u + 1], dtype=np.int64) for u in inverse]
    return useqs, upos, row_index


class TokenTree(NamedTuple):
    """Sequences as a prefix tree: each distinct prefix is one node (its last token)."""

    ids_N: np.ndarray
    """``int64[N]``: each node's token."""
    pos_N: np.ndarray
    """``int64[N]``: each node's position (its depth)."""
    paths: list[np.ndarray]
    """Per sequence, ``int64[T_i]``: the node of each of its positions."""
    blocks: list[tuple[np.ndarray, np.ndarray]]
    """Per sequence that adds nodes: ``(its new nodes, its path)``, the new nodes a contiguous
    run of indices and the last entries of the path (:class:`TreeAttention`'s blocks)."""


def token_tree(seqs: Sequence[np.ndarray]) -> TokenTree:
    """The prefix tree of ``seqs`` (``int[T_i]`` each, non-negative). In lexicographic order a
    sequence's longest prefix shared with any sequence before it is the one it shares with its
    predecessor: it adds the nodes after that, and its path is the predecessor's up to there,
    then its own new nodes."""
    as64 = [np.asarray(s, dtype=np.int64) for s in seqs]
    order = sorted(range(len(as64)), key=lambda i: token_order(as64[i]))
    ids: list[np.ndarray] = []
    paths: list[np.ndarray] = [np.zeros(0, np.int64)] * len(as64)
    blocks: list[tuple[np.ndarray, np.ndarray]] = []
    n, prev = 0, -1
    for i in order:
        s = as64[i]
        shared = common_prefix([as64[prev], s]) if prev >= 0 else 0
        new = np.arange(n, n + len(s) - shared, dtype=np.int64)
        paths[i] = np.concatenate([paths[prev][:shared] if shared else new[:0], new])
        if len(new):
            ids.append(s[shared:])
            blocks.append((new, paths[i]))
        n, prev = n + len(new), i
    ids_N = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    pos_N = np.concatenate([np.arange(len(k) - len(q), len(k)) for q, k in blocks]) if blocks else np.zeros(0)
    return TokenTree(ids_N, pos_N.astype(np.int64), paths, blocks)


def _tree_hidden(tree: TreeFn, useqs: Sequence[np.ndarray], upos: Sequence[np.ndarray],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`_gather_hidden` returns, from one forward of the prefix tree of ``useqs``."""
    t = token_tree(useqs)
    attn = TreeAttention(t.blocks, len(t.ids_N), device)
    h_N_H = tree(torch.as_tensor(t.ids_N, device=device), torch.as_tensor(t.pos_N, device=device), attn)
    node = np.concatenate([t.paths[u][np.asarray(p, np.int64) - 1] for u, p in enumerate(upos)])
    targets = np.concatenate([useqs[u][np.asarray(p, np.int64)] for u, p in enumerate(upos)])
    return (h_N_H.index_select(0, torch.as_tensor(node.astype(np.int64), device=device)),
            torch.as_tensor(targets.astype(np.int64), device=device))


class _Shared(NamedTuple):
    """The shared levels of the tree, run: what every distinct row's tail continues from."""

    P: int
    """Length of the prefix common to all rows (0: none run)."""
    split: list[int]
    """Per distinct row, where its tail starts (its context is ``[P, split)``)."""
    cinv: list[int]
    """Per distinct row, its context's index."""
    att_C_T: torch.Tensor
    """``int64[C, P + Lc]``: each context's attention mask over the prefix and the context."""
    cache: Any
    """The KV cache of the ``C`` contexts (``None`` when nothing was run)."""
    h1_P_H: torch.Tensor | None
    """``float[P, H]``: the prefix's hidden states (``None`` without a prefix)."""


def _padded(rows: Sequence[np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` right-padded with ``pad_id`` to the longest: ``int64[B, L]`` ids and their
    ``int64[B, L]`` mask (1 on real tokens)."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    m = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r)
        m[i, : len(r)] = 1
    return ids, m


def _shared_levels(body: HiddenFn, useqs: Sequence[np.ndarray], upos: Sequence[np.ndarray], pad_id: int,
                   device: torch.device, share: bool) -> _Shared:
    """Level 1, the common prefix, once; level 2, each distinct context (up to the token before
    its first selected position), once, from a copy of the prefix's cache. ``useqs``: the
    distinct rows' ``int64[T]`` sequences; ``upos``: their selected positions."""
    U = len(useqs)
    # The prefix stops one token short of the shortest sequence: a sequence that is a prefix
    # of all the others must keep a non-empty tail of its own.
    P = min(common_prefix(useqs), min(len(s) for s in useqs) - 1) if share and U > 1 else 0
    split = [max(P, int(p.min()) - 1) if len(p) else len(s) for s, p in zip(useqs, upos)]
    if share:
        creps, cinv = _unique([s[P:c].tobytes() for s, c in zip(useqs, split)])
    else:
        creps, cinv = list(range(U)), list(range(U))
    C = len(creps)
    cache = None
    h1 = None
    if P > 0:
        h1, cache = body(torch.as_tensor(useqs[0][:P])[None].to(device), use_cache=True)
        h1 = h1[0]
        if C > 1:
            cache.reorder_cache(torch.zeros(C, dtype=torch.long, device=device))
    ctx = [useqs[r][P : split[r]] for r in creps]
    Lc = max(len(c) for c in ctx)
    att_C = torch.ones((C, P), dtype=torch.long)
    if Lc > 0:
        ids, m = _padded(ctx, pad_id)
        att_C = torch.cat([att_C, m], 1)
        pos = (P + torch.arange(Lc))[None].expand(C, Lc)
        _, cache = body(ids.to(device), att_C.to(device), pos.to(device), cache, use_cache=True)
    return _Shared(P, split, cinv, att_C, cache, h1)


def _tails(body: HiddenFn, useqs: Sequence[np.ndarray], shared: _Shared, pad_id: int,
           device: torch.device) -> list[torch.Tensor]:
    """Level 3: every distinct row's tail (``float[T - split, H]`` each), from its context's
    cache, in buckets of similar length so that short tails are not padded to the longest (a
    two-turn sequence's tail holds a whole turn)."""
    tails = [s[c:] for s, c in zip(useqs, shared.split)]
    h3: list[torch.Tensor] = [torch.empty(0)] * len(useqs)
    for bucket in query_buckets([len(t) for t in tails]):
        ids, m = _padded([tails[u] for u in bucket], pad_id)
        Lt = ids.shape[1]
        ctx_rows = torch.as_tensor([shared.cinv[u] for u in bucket], dtype=torch.long)
        att = torch.cat([shared.att_C_T[ctx_rows], m], 1)
        pos = torch.as_tensor([shared.split[u] for u in bucket])[:, None] + torch.arange(Lt)[None]
        sub = None
        if shared.cache is not None:
            idx = ctx_rows.to(device)
            if isinstance(shared.cache, DenseCache):  # the engine's own forward
                sub = shared.cache.index_select(idx)
            else:
                sub = DynamicCache(ddp_cache_data=[(k.index_select(0, idx), v.index_select(0, idx))
                                                   for k, v, *_ in shared.cache])
        out, _ = body(ids.to(device), att.to(device), pos.to(device), sub)
        for i, u in enumerate(bucket):
            h3[u] = out[i]
    return h3


def _gather_hidden(useqs: Sequence[np.ndarray], upos: Sequence[np.ndarray], shared: _Shared,
                   h3: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden state before each selected position of each distinct row (``float[U, H]``, in
    (row, position) order; from the prefix's states or the row's tail, ``h3``) and the tokens
    there (``int64[U]``)."""
    P, split = shared.P, shared.split
    rows = np.concatenate([np.full(len(p), u) for u, p in enumerate(upos)]).astype(np.int64)
    cols = np.concatenate(upos).astype(np.int64)
    targets = torch.as_tensor(np.asarray([useqs[u][c] for u, c in zip(rows, cols)], dtype=np.int64), device=device)
    before = cols - 1
    splits = np.asarray(split)[rows]
    in_prefix = before < P
    if np.any(~in_prefix & (before < splits)):
        raise AssertionError("a loss position fell inside a shared context")
    sel3 = np.nonzero(~in_prefix)[0]
    h_N = torch.stack([h3[rows[j]][before[j] - splits[j]] for j in sel3]) if len(sel3) else None
    if in_prefix.any():
        h1 = shared.h1_P_H
        assert h1 is not None  # a position before P
        sel1 = np.nonzero(in_prefix)[0]
        H = h1.shape[-1]
        h_all = torch.zeros((len(rows), H), dtype=h1.dtype, device=device)
        if h_N is not None:
            h_all = h_all.index_copy(0, torch.as_tensor(sel3, device=device), h_N)
        h_N = h_all.index_copy(0, torch.as_tensor(sel1, device=device), h1[torch.as_tensor(before[sel1], device=device)])
    assert h_N is not None  # some position is selected
    return h_N, targets


def project_logprobs(
    lm_head: torch.nn.Module, hidden: Hidden, index_N: torch.Tensor, entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies, if asked) of the tokens at the hidden rows ``index_N``
    (``int64[N]``, from :meth:`Hidden.at`): each distinct row goes through the vocabulary
    projection once, in blocks of :data:`HEAD_ROWS`."""
    if index_N.numel() == 0:
        empty = torch.zeros(0, device=hidden.h_U_H.device)
        return empty, (empty if entropy else None)
    distinct, inverse_N = torch.unique(index_N, return_inverse=True)
    if distinct.numel() == hidden.h_U_H.shape[0]:  # every row (unique sorts: distinct == arange)
        h, targets = hidden.h_U_H, hidden.tokens_U
    else:
        h, targets = hidden.h_U_H[distinct], hidden.tokens_U[distinct]
    logp, ent = _project(lm_head, h, targets, entropy, entropy_grad)
    return logp[inverse_N], (None if ent is None else ent[inverse_N])


def project_move_logprobs(lm_head: torch.nn.Module, hidden: Hidden, index_N: torch.Tensor,
                          tokens_N_M: torch.Tensor) -> torch.Tensor:
    """``float32[N, M]``: the log-probs of the tokens ``tokens_N_M`` (ids; -1: none, 0 given
    there) as the next token at the hidden rows ``index_N`` (from :meth:`Hidden.at`), from
    the full vocabulary, differentiable; only rows with a token go through the projection
    (the ``move_values`` term's decisions, a few per sequence)."""
    tokens_N_M = tokens_N_M.to(device=hidden.h_U_H.device).long()
    out = torch.zeros(tokens_N_M.shape, dtype=torch.float32, device=hidden.h_U_H.device)
    valid_N_M = tokens_N_M >= 0
    rows = valid_N_M.any(dim=1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    logp_R_V = torch.log_softmax(lm_head(hidden.h_U_H[index_N[rows]]).float(), dim=-1)
    got_R_M = logp_R_V.gather(1, tokens_N_M[rows].clamp_min(0)) * valid_N_M[rows]
    return out.index_copy(0, rows, got_R_M)


def selected_logprobs(
    body: HiddenFn,
    lm_head: torch.nn.Module,
    seqs: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    pad_id: int,
    device: torch.device,
    share: bool = True,
    entropy: bool = False,
    entropy_grad: bool = False,
    tree: TreeFn | None = None,
) -> Selected:
    """``logp_N`` of the tokens at positions where ``masks[i]`` is nonzero (position 0 never
    counts), in (row, position) order, and each row's positions.

    ``body``, ``share`` and ``tree`` as in :func:`selected_hidden`; ``lm_head`` maps hidden states to
    logits. ``entropy``: also return the full-vocabulary entropy at each selected position; it
    costs one more ``N x V`` elementwise pass over logits that exist anyway (differentiable
    only with ``entropy_grad``, e.g. for an entropy bonus; else a detached diagnostic).
    """
    hidden = selected_hidden(body, seqs, masks, pad_id, device, share, tree)
    logp_N, entropy_N = project_logprobs(lm_head, hidden, hidden.at(), entropy, entropy_grad)
    return Selected(logp_N, hidden.taken, entropy_N)
