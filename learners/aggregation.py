"""Aggregation of per-token losses into the scalar that is back-propagated.

Every aggregator takes its normalizer IN (DESIGN §5): the number of tokens or sequences of
the whole step, counted before the batch is split into micro-batches. A normalizer inferred
from the micro-batch (``loss_N.mean()``) would weight a token by the size of the micro-batch
it happened to land in, so the gradient would depend on how the batch was split.

* :func:`token_sum`: every token weighs the same (``sum / n_tokens``): Dr. GRPO's and DAPO's
  token-level normalisation (Liu et al. 2025, "Understanding R1-Zero-Like Training", §3.2;
  Yu et al. 2025, "DAPO", §3.3, token-level policy-gradient loss).
* :func:`sequence_mean`: every sequence weighs the same, whatever its length (mean over a
  sequence's tokens, then ``sum / n_sequences``): GRPO's ``1/G sum_i 1/|o_i| sum_t`` (Shao et
  al. 2024, "DeepSeekMath", eq. 3). Its per-sequence mean needs all of a sequence's tokens,
  so a sequence must lie wholly inside one micro-batch.
"""

from __future__ import annotations

import torch


def _positive(normalizer: float, name: str) -> float:
    normalizer = float(normalizer)
    if not normalizer > 0:
        raise ValueError(f"{name} must be > 0, got {normalizer}")
    return normalizer


def token_sum(loss_N: torch.Tensor, normalizer: float) -> torch.Tensor:
    """``sum_t l_t / normalizer``.

    Args:
        loss_N: ``float[N]`` per-token losses of this micro-batch.
        normalizer: the step's global loss-token count (``> 0``), the same for every
            micro-batch.

    Returns:
        Scalar; summed over micro-batches it is the step's token-mean loss.
    """
    if loss_N.ndim != 1:
        raise ValueError(f"loss_N must be 1-D, got {tuple(loss_N.shape)}")
    return loss_N.sum() / _positive(normalizer, "normalizer")


def sequence_mean(
    loss_N: torch.Tensor, seq_index_N: torch.Tensor, n_sequences: int
) -> torch.Tensor:
    """``1/n_sequences sum_s (1/|s| sum_{t in s} l_t)``.

    Args:
        loss_N: ``float[N]`` per-token losses of this micro-batch.
        seq_index_N: ``int[N]`` which sequence each token belongs to (any ids; tokens of one
            sequence need not be contiguous). Every sequence present must have ALL its loss
            tokens in this micro-batch, since ``|s|`` is counted here.
        n_sequences: the step's global number of sequences (``> 0``).

    Returns:
        Scalar; summed over micro-batches it is the step's sequence-mean loss.
    """
    if loss_N.ndim != 1 or seq_index_N.shape != loss_N.shape:
        raise ValueError(f"need loss_N [N] and seq_index_N [N], got {tuple(loss_N.shape)} "
                         f"and {tuple(seq_index_N.shape)}")
    n_sequences_f = _positive(n_sequences, "n_sequences")
    if loss_N.numel() == 0:
        return loss_N.sum()
    _, index_N = torch.unique(seq_index_N.to(loss_N.device), return_inverse=True)
    n_present = int(index_N.max().item()) + 1
    sums_S = torch.zeros(n_present, dtype=loss_N.dtype, device=loss_N.device)
    sums_S = sums_S.index_add(0, index_N, loss_N)
    counts_S = torch.bincount(index_N, minlength=n_present).to(loss_N.dtype)
    return (sums_S / counts_S).sum() / n_sequences_f
