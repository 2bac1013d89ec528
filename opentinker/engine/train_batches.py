"""Bookkeeping of :meth:`ModelHost.forward_backward`: datums in chunks, loss inputs gathered
at the loss positions, and loss diagnostics accumulated over chunks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from protocols.messages import Datum

VALUE_INPUTS = ("value_mask", "value_targets", "old_values")
"""``Datum.loss_inputs`` the value loss reads (positions, targets, values when scored)."""


def gather(
    datums: Sequence[Datum], masks: Sequence[np.ndarray], keys: Iterable[str], device: torch.device
) -> dict[str, torch.Tensor]:
    """``{key: float32[N]}``: each datum's ``loss_inputs[key]`` at the positions where its
    mask is nonzero (position 0 never counts), flat in (datum, position) order, the order
    of :meth:`opentinker.engine.shared_forward.Hidden.at`."""
    positions = [np.nonzero(np.asarray(m)[1:])[0] + 1 for m in masks]
    return {
        k: torch.as_tensor(
            np.concatenate([np.asarray(d.loss_inputs[k])[p] for d, p in zip(datums, positions)]),
            dtype=torch.float32, device=device,
        )
        for k in keys
    }


class MetricSums:
    """Accumulates loss diagnostics over chunks: ``n_*`` counts are summed, other metrics
    averaged weighted by the chunk's ``n_pairs`` (preference losses) or ``n_tokens``."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, prefix: str, metrics: Mapping[str, float], term: tuple[str, torch.Tensor, float]) -> None:
        """Fold in one chunk's ``metrics`` (keys prefixed by ``prefix``) and its term
        ``(name, loss_sum, normalizer)``, reported as ``term/<name>`` = ``loss_sum / normalizer``."""
        weight = float(metrics.get("n_pairs", metrics.get("n_tokens", 1.0)))
        for k, v in metrics.items():
            key = prefix + k
            if k.startswith("n_"):
                self.sums[key] = self.sums.get(key, 0.0) + float(v)
                self.weights[key] = 1.0
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(v) * weight
                self.weights[key] = self.weights.get(key, 0.0) + weight
        name, loss_sum, normalizer = term
        key = f"term/{name}"
        self.sums[key] = self.sums.get(key, 0.0) + float(loss_sum.detach()) / normalizer
        self.weights[key] = 1.0

    def result(self) -> dict[str, float]:
        return {k: v / self.weights[k] if self.weights[k] else 0.0 for k, v in self.sums.items()}


def common_prefix(seqs: Sequence[np.ndarray]) -> int:
    """Length of the longest prefix every one of ``seqs`` (1-D token arrays) shares."""
    n = min(len(s) for s in seqs)
    for s in seqs[1:]:
        neq = np.flatnonzero(s[:n] != seqs[0][:n])
        if len(neq):
            n = int(neq[0])
    return n


def _new_tokens(d: Datum, before: Datum) -> int:
    """Tokens of ``d`` beyond the prefix it shares with the datum ``before`` it (computed once)."""
    a = np.asarray(d.tokens)
    return len(a) - common_prefix([a, np.asarray(before.tokens)])


def computed_tokens(part: Sequence[Datum]) -> int:
    """Tokens a part computes as :func:`chunks` counts them (a prefix shared with the datum
    before counted once)."""
    return sum(len(d.tokens) if i == 0 else _new_tokens(d, part[i - 1]) for i, d in enumerate(part))


def chunks(datums: Sequence[Datum], size: int, max_tokens: int = 0) -> Iterator[Sequence[Datum]]:
    """Consecutive slices of about ``size`` datums, and (``max_tokens`` > 0) of at most that
    many tokens to compute unless one datum alone has more (a datum's prefix shared with the
    one before it, a group's prompt, is computed once and counted once); datums of one preference pair (equal
    ``pair_id``) are never split, since a pair's loss is not a sum over its tokens."""
    def pair(d: Datum) -> float | None:
        if "pair_id" not in d.loss_inputs:
            return None
        ids = np.asarray(d.loss_inputs["pair_id"])[np.asarray(d.loss_inputs["mask"]) != 0]
        return float(ids[0]) if len(ids) else None

    def new_tokens(i: int) -> int:
        return _new_tokens(datums[i], datums[i - 1])

    start = 0
    while start < len(datums):
        end, tokens = start + 1, len(datums[start].tokens)
        while end < min(start + size, len(datums)) and not (
                max_tokens > 0 and tokens + new_tokens(end) > max_tokens):
            tokens += new_tokens(end)
            end += 1
        while end < len(datums) and pair(datums[end]) is not None and pair(datums[end]) == pair(datums[end - 1]):
            end += 1
        yield datums[start:end]
        start = end
