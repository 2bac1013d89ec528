"""Token-in/token-out batched sampling with a KV cache, one seeded generator per row.

Rows are left-padded into one batch; every step is one forward pass over all unfinished
rows' new tokens. Each row draws from ``softmax(logits / T)`` truncated by its own top-k and
top-p, with a ``torch.Generator`` seeded by the row's seed, and reports the log-prob of the
drawn token under ``log_softmax(logits / T)`` (../shared/DESIGN.md §6). The model's
``generation_config`` is never consulted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from opentinker.engine.sampling import check_distribution
from protocols.messages import SamplingParams, StopReason

# forward(input_ids_B_L, attention_mask_B_L, position_ids_B_L, past, rows_B) -> (logits_B_V, past)
# rows_B: which of the caller's rows (hence which adapters) the batch holds, in order.
Forward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, object, list[int]], tuple[torch.Tensor, object]
]


@dataclass(frozen=True)
class SampledRow:
    tokens: np.ndarray
    """``int32[S]`` drawn ids (stop token included when drawn)."""
    logprobs: np.ndarray
    """``float32[S]``."""
    stop_reason: StopReason


def validate_params(p: SamplingParams) -> None:
    """Raise ``ValueError`` naming the bad field of a :class:`SamplingParams`."""
    check_distribution(p)
    if p.max_tokens < 1:
        raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {p.max_tokens}")


def _truncate(logits_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Tempered logits with everything outside the top-k / nucleus set to -inf."""
    if top_k > 0 and top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    if top_p < 1.0:
        sorted_V, idx_V = torch.sort(logits_V, descending=True)
        cum_V = torch.softmax(sorted_V, -1).cumsum(-1)
        drop_V = cum_V - torch.softmax(sorted_V, -1) >= top_p  # keep the token that crosses top_p
        logits_V = logits_V.masked_fill(torch.zeros_like(drop_V).scatter(0, idx_V, drop_V), float("-inf"))
    return logits_V


@torch.no_grad()
def sample_rows(
    forward: Forward,
    prompts: Sequence[np.ndarray],
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    pad_id: int,
    device: torch.device,
    keys: Sequence[object] | None = None,
) -> list[SampledRow]:
    """Sample one reply per prompt. ``prompts[i]`` is ``int32[L_i]``, ``L_i >= 1``.

    Rows with equal ``keys[i]`` (e.g. the same adapter) and equal prompts share one prefill:
    the prompt is run once and its KV cache is copied to each such row before decoding.
    """
    B = len(prompts)
    if B == 0:
        return []
    lens = [len(p) for p in prompts]
    if min(lens) < 1:
        raise ValueError("every prompt needs at least one token")
    L = max(lens)
    keys = list(keys) if keys is not None else [None] * B
    first: dict[tuple[object, bytes], int] = {}
    uniq: list[int] = []  # row index of each distinct (key, prompt)
    expand_B: list[int] = []  # for each row, its position in ``uniq``
    for i, p in enumerate(prompts):
        k = (keys[i], np.asarray(p, dtype=np.int64).tobytes())
        if k not in first:
            first[k] = len(uniq)
            uniq.append(i)
        expand_B.append(first[k])
    U = len(uniq)
    ids_U_L = torch.full((U, L), pad_id, dtype=torch.long)
    mask_U_L = torch.zeros((U, L), dtype=torch.long)
    for u, i in enumerate(uniq):
        p = prompts[i]
        ids_U_L[u, L - len(p):] = torch.as_tensor(np.asarray(p, dtype=np.int64))
        mask_U_L[u, L - len(p):] = 1
    pos_U_L = (mask_U_L.cumsum(-1) - 1).clamp(min=0)
    gens = [torch.Generator().manual_seed(int(s) & 0x7FFF_FFFF_FFFF_FFFF) for s in seeds]
    temps_B = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    stops = [set(p.stop_token_ids) for p in params]
    out_tok: list[list[int]] = [[] for _ in range(B)]
    out_lp: list[list[float]] = [[] for _ in range(B)]
    reasons: list[StopReason | None] = [None] * B
    max_steps = max(p.max_tokens for p in params)

    logits_U_V, past = forward(ids_U_L.to(device), mask_U_L.to(device), pos_U_L.to(device), None, uniq)
    idx_B = torch.as_tensor(expand_B, dtype=torch.long, device=device)
    logits_B_V = logits_U_V[idx_B]
    if U < B:
        past.reorder_cache(idx_B)
    mask_B_L = mask_U_L.to(device)[idx_B]
    next_pos_B = pos_U_L.to(device)[idx_B][:, -1] + 1
    for step in range(max_steps):
        logits_B_V = logits_B_V.float().cpu() / temps_B[:, None]
        logp_B_V = torch.log_softmax(logits_B_V, -1)
        new_B = torch.full((B,), pad_id, dtype=torch.long)
        for i in range(B):
            if reasons[i] is not None:
                continue
            trunc_V = _truncate(logits_B_V[i], params[i].top_k, params[i].top_p)
            tok = int(torch.multinomial(torch.softmax(trunc_V, -1), 1, generator=gens[i]))
            out_tok[i].append(tok)
            out_lp[i].append(float(logp_B_V[i, tok]))
            new_B[i] = tok
            if tok in stops[i]:
                reasons[i] = StopReason.STOP
            elif len(out_tok[i]) >= params[i].max_tokens:
                reasons[i] = StopReason.LENGTH
        if all(r is not None for r in reasons):
            break
        mask_B_L = torch.cat([mask_B_L, torch.ones((B, 1), dtype=mask_B_L.dtype, device=device)], 1)
        logits_B_V, past = forward(new_B[:, None].to(device), mask_B_L, next_pos_B[:, None], past, list(range(B)))
        next_pos_B = next_pos_B + 1
    return [
        SampledRow(
            tokens=np.asarray(out_tok[i], dtype=np.int32),
            logprobs=np.asarray(out_lp[i], dtype=np.float32),
            stop_reason=reasons[i] or StopReason.LENGTH,
        )
        for i in range(B)
    ]
