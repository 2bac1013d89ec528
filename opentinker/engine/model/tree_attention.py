"""Attention over the distinct tokens of a batch laid out as a prefix tree (the trainer's forward).

A training batch of multi-turn episodes shares prefixes at many depths: every sequence starts
with the same system prompt, a group's episodes share their first observation, and episodes
that made the same first moves share those turns too. Laid out as a tree, each distinct prefix
token is one node, computed once: the decoder runs on the ``N`` nodes as one flat batch (its
linear layers see each shared token once), and only attention needs the tree, since a token
reads the keys of its own path (its ancestors and itself) and of nothing else.

The tree comes in *blocks*: block ``r`` is one sequence's nodes that no earlier sequence has
(its queries, a contiguous run of node indices, in position order) and that sequence's whole
path (its keys: the node index of each of its positions). Every node is a query of exactly one
block. Blocks of similar query counts are padded into one batch per
:func:`scaled_dot_product_attention` call; a query at path position ``p`` reads keys ``<= p``.
The result equals running every sequence alone (tests/test_tree_forward.py), with gradients:
gathers are ``index_select`` s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .attention import _sdpa

__all__ = ["TreeAttention", "query_buckets"]


def query_buckets(counts: Sequence[int], waste: float = 0.25) -> list[list[int]]:
    """Indices of ``counts`` grouped (ascending) so that padding a group to its largest count
    adds at most ``waste`` of its real queries."""
    order = sorted(range(len(counts)), key=lambda i: counts[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            if counts[i] * (len(g) + 1) <= (1 + waste) * (sum(counts[j] for j in g) + counts[i]):
                g.append(i)
                continue
        groups.append([i])
    return groups


class _Bucket:
    """One padded batch of blocks: gather indices, the mask and where the real queries go."""

    def __init__(self, blocks: Sequence[tuple[np.ndarray, np.ndarray]], device: torch.device) -> None:
        R = len(blocks)
        nq = max(len(q) for q, _ in blocks)
        nk = max(len(k) for _, k in blocks)
        q_R_Q = np.zeros((R, nq), np.int64)
        k_R_K = np.zeros((R, nk), np.int64)
        real_R_Q = np.zeros((R, nq), bool)
        mask = np.zeros((R, nq, nk), bool)
        causal = True
        for r, (q, k) in enumerate(blocks):
            q_R_Q[r, : len(q)], k_R_K[r, : len(k)], real_R_Q[r, : len(q)] = q, k, True
            first = len(k) - len(q)  # the path position of the block's first query
            causal &= first == 0 and len(q) == nq and len(k) == nk
            at_Q = np.minimum(first + np.arange(nq), len(k) - 1)  # padded queries read real keys (no NaN)
            mask[r] = np.arange(nk)[None, :] <= at_Q[:, None]
        self.shape = (R, nq, nk)
        self.q_index = torch.as_tensor(q_R_Q.reshape(-1), device=device)
        self.k_index = torch.as_tensor(k_R_K.reshape(-1), device=device)
        self.mask_R_1_Q_K = None if causal else torch.as_tensor(mask[:, None], device=device)
        self.real = torch.as_tensor(np.nonzero(real_R_Q.reshape(-1))[0], device=device)
        self.tokens = q_R_Q.reshape(-1)[real_R_Q.reshape(-1)]


class TreeAttention:
    """The :class:`~.attention.Attention` backend for ``n_tokens`` flat tree nodes in
    ``blocks`` (``(queries int64[n_r], path int64[T_r])`` each, the queries the last ``n_r``
    entries of the path); every node must be a query of exactly one block."""

    def __init__(self, blocks: Sequence[tuple[np.ndarray, np.ndarray]], n_tokens: int, device: torch.device) -> None:
        blocks = [(np.asarray(q, np.int64), np.asarray(k, np.int64)) for q, k in blocks if len(q)]
        for q, k in blocks:
            if len(q) > len(k) or not np.array_equal(k[len(k) - len(q):], q):
                raise ValueError("a block's queries must be the last entries of its path")
        self.buckets = [_Bucket([blocks[i] for i in g], device) for g in query_buckets([len(q) for q, _ in blocks])]
        tokens = np.concatenate([b.tokens for b in self.buckets]) if self.buckets else np.zeros(0, np.int64)
        if len(tokens) != n_tokens or not np.array_equal(np.sort(tokens), np.arange(n_tokens)):
            raise ValueError(f"the blocks' queries must cover each of the {n_tokens} tokens once")
        self.inverse = torch.as_tensor(np.argsort(tokens, kind="stable"), device=device)

    def __call__(self, layer_idx: int, q_N_Hq_D: torch.Tensor, k_N_Hkv_D: torch.Tensor,
                 v_N_Hkv_D: torch.Tensor) -> torch.Tensor:
        """Output ``o_N_Hq_D``: each node's attention over its own path."""
        outs = []
        for b in self.buckets:
            R, nq, nk = b.shape
            q = q_N_Hq_D.index_select(0, b.q_index).view(R, nq, *q_N_Hq_D.shape[1:]).transpose(1, 2)
            k = k_N_Hkv_D.index_select(0, b.k_index).view(R, nk, *k_N_Hkv_D.shape[1:]).transpose(1, 2)
            v = v_N_Hkv_D.index_select(0, b.k_index).view(R, nk, *v_N_Hkv_D.shape[1:]).transpose(1, 2)
            o = _sdpa(q, k, v, b.mask_R_1_Q_K, is_causal=b.mask_R_1_Q_K is None)
            outs.append(o.transpose(1, 2).reshape(R * nq, *q_N_Hq_D.shape[1:]).index_select(0, b.real))
        return torch.cat(outs).index_select(0, self.inverse)
