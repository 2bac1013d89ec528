"""The inference API: sampling, teacher-forced log-probs and critic values on the registry's
model, in one forward pass per batch (the engine's step loop samples where the own forward
runs; its tensors are :mod:`opentinker.engine.model_runner`'s).

Sampling mixes adapters in one batch through PEFT's ``adapter_names``
(:func:`opentinker.engine.peft_sampler.sample_rows`). Log-probs are computed only at the
positions asked for: the transformer body runs on the whole sequence (shared prefixes once,
:mod:`opentinker.engine.shared_forward`), the vocabulary projection only on the hidden states
that predict a selected token.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np
import torch

from opentinker.engine import value_head
from opentinker.engine.peft_sampler import SampledRow, sample_rows, validate_params
from opentinker.engine.registry import BASE, AdapterRegistry
from opentinker.engine.request_checks import check_forced
from opentinker.engine.sequence import Sequence
from opentinker.engine.shared_forward import (
    Hidden,
    Selected,
    TreeFn,
    project_logprobs,
    selected_hidden,
    selected_logprobs,
)
from protocols.messages import SamplingParams, StopReason

if TYPE_CHECKING:
    from opentinker.engine.lora_registry import LoraRegistry
    from opentinker.engine.step_loop import Engine


class Interrupted(RuntimeError):
    """A call cut short because its process is stopping."""


class Inference:
    """Runs the registry's model: ``sample``, ``logprobs``, ``values`` (no gradients) and the
    hidden-state and log-prob passes the trainer differentiates."""

    def __init__(self, registry: AdapterRegistry | LoraRegistry, engine: Engine | None = None) -> None:
        self.registry = registry
        self.device = registry.device
        self.engine = engine
        """The step loop that samples (the engine's own forward); ``None``: PEFT's mixed batches."""
        self.share_prefix = True
        """Run shared prefixes and duplicate sequences once in log-prob computations (exact)."""
        self.tree: TreeFn | None = getattr(registry, "hidden_tree", None)
        """The engine's own decoder runs a batch as one prefix tree (every distinct prefix token
        once, :func:`~opentinker.engine.shared_forward.token_tree`); ``None`` (PEFT's model, or
        set so): shared prefix, contexts and tails."""
        self.interrupt = threading.Event()
        """Set when the owner stops: a PEFT sampling call then ends at its next token with
        :class:`Interrupted` (the engine's step loop stops between steps on its own)."""

    # ----------------------------------------------------------------------------- sampling

    def sample(
        self,
        adapters: Seq[str | None],
        prompts: Seq[np.ndarray],
        params: Seq[SamplingParams],
        seeds: Seq[int],
        forced: Seq[np.ndarray | None] | None = None,
    ) -> list[SampledRow]:
        """One reply per row; each row with its own adapter (``None``: base), in one batch
        (the engine's step loop when there is one, to completion). A row with a ``forced``
        reply (``int32[F]``) takes it instead of drawing, with its log-probs: in the engine's
        step loop, or, without the engine, teacher-forced (:meth:`logprobs`)."""
        reg = self.registry
        self.check_sample(adapters, prompts, params, forced)
        forced = list(forced) if forced is not None else [None] * len(prompts)
        if self.engine is not None:
            seqs = [self.engine.add(a, p, q, s, forced=f)
                    for a, p, q, s, f in zip(adapters, prompts, params, seeds, forced)]
            self.engine.run_until_done(seqs)
            for s in seqs:
                if s.error is not None:
                    raise s.error
            return [sampled_row(s) for s in seqs]
        if any(f is not None for f in forced):
            free = [i for i, f in enumerate(forced) if f is None]
            drawn = iter(self.sample(*([x[i] for i in free] for x in (adapters, prompts, params, seeds))) if free else [])
            return [next(drawn) if f is None else self._scored_row(a, p, f, q)
                    for a, p, q, f in zip(adapters, prompts, params, forced)]
        names = [BASE if a is None else a for a in adapters]
        # PEFT's mixed batches split every LoRA layer by adapter; one adapter needs no split.
        mixed = reg.model is not reg.base and len(set(names)) > 1

        def forward(ids, mask, pos, past, rows):
            if self.interrupt.is_set():
                raise Interrupted("sampling interrupted: the scheduler is stopping")
            kwargs = {
                "input_ids": ids, "attention_mask": mask, "position_ids": pos, "cache": past,
                "use_cache": True, "logits_to_keep": 1,
            }
            if mixed:
                kwargs["adapter_names"] = [names[r] for r in rows]
            out = reg.model(**kwargs)
            return out.logits[:, -1, :], out.cache

        with (reg.select(adapters[0]) if not mixed else contextlib.nullcontext()):
            return sample_rows(forward, prompts, params, seeds, reg.pad_id, self.device, keys=names)

    def _scored_row(self, adapter: str | None, prompt: np.ndarray, reply: np.ndarray, params: SamplingParams
                    ) -> SampledRow:
        """A forced reply (``int32[F]``) as a sampled row: its teacher-forced log-probs after
        ``prompt`` at ``params``' temperature."""
        reply = np.asarray(reply, dtype=np.int32)
        lp = self.logprobs(adapter, [np.concatenate([np.asarray(prompt, np.int32), reply])],
                           temperature=params.temperature, tail=len(reply))[0]
        stop = StopReason.STOP if int(reply[-1]) in params.stop_token_ids else StopReason.LENGTH
        return SampledRow(tokens=reply, logprobs=lp[-len(reply):], stop_reason=stop)

    def check_sample(self, adapters: Seq[str | None], prompts: Seq[np.ndarray], params: Seq[SamplingParams],
                     forced: Seq[np.ndarray | None] | None = None) -> None:
        """Raise ``ValueError`` (an unknown adapter: ``UnknownAdapterError``) naming what is
        wrong with a sample request: its parameters, adapters, token arrays (1-D integers in
        the vocabulary; forced replies too, one per row at most), or a row the engine can
        never run (longer than the context or the KV budget)."""
        if forced is not None:
            check_forced(forced, len(prompts), params, self.registry.vocab_size)
        for p in set(params):
            validate_params(p)
        for a in set(adapters):
            if a is not None:
                self.registry.get(a)
        self.registry.check_tokens(prompts, "SampleRequest.prompts")
        if self.engine is not None:
            for p, q in zip(prompts, params):
                self.engine.check(np.asarray(p), q)

    # ----------------------------------------------------------------------------- log-probs

    def logp_at(
        self, seqs: Seq[np.ndarray], masks: Seq[np.ndarray], share: bool = True,
        entropy: bool = False, entropy_grad: bool = False, temperature: float = 1.0,
    ) -> Selected:
        """Log-probs (and optionally entropies) at the masked positions of ``seqs`` with the
        active adapter, of ``softmax(logits / temperature)`` (see
        :func:`opentinker.engine.shared_forward.selected_logprobs`)."""
        return selected_logprobs(self.registry.hidden, scaled(self.registry.lm_head, temperature), seqs, masks,
                                 self.registry.pad_id, self.device, share, entropy=entropy,
                                 entropy_grad=entropy_grad, tree=self.tree)

    def hidden_at(self, seqs: Seq[np.ndarray], masks: Seq[np.ndarray]) -> Hidden:
        """Final hidden states before the masked positions, with the active adapter."""
        return selected_hidden(self.registry.hidden, seqs, masks, self.registry.pad_id, self.device,
                               self.share_prefix, self.tree)

    @torch.no_grad()
    def _along(
        self, adapter: str | None, seqs: Seq[np.ndarray], per_row: Callable[[Hidden], torch.Tensor], chunk: int,
        tail: int = 0,
    ) -> list[np.ndarray]:
        """``float32[T_i]`` per sequence: ``per_row`` of the hidden state before every token
        (entry 0 is 0; with ``tail`` > 0 only the last ``tail`` tokens, the rest 0),
        ``chunk`` sequences at a time."""
        out: list[np.ndarray] = []
        with self.registry.select(adapter):
            for start in range(0, len(seqs), chunk):
                part = [np.asarray(s) for s in seqs[start : start + chunk]]
                masks = [np.arange(len(s)) >= len(s) - tail if tail else np.ones(len(s)) for s in part]
                hidden = self.hidden_at(part, masks)
                per_U = per_row(hidden).float().cpu().numpy() if len(hidden.tokens_U) else np.zeros(0, np.float32)
                for rows, pos, s in zip(hidden.rows, hidden.taken, part):
                    row = np.zeros(len(s), dtype=np.float32)
                    row[pos] = per_U[rows]
                    out.append(row)
        return out

    def logprobs(self, adapter: str | None, seqs: Seq[np.ndarray], chunk: int = 64,
                 temperature: float = 1.0, tail: int = 0) -> list[np.ndarray]:
        """Teacher-forced ``float32[T_i]`` log-probs of every token (entry 0 is 0), of
        ``softmax(logits / temperature)``; with ``tail`` > 0 of the last ``tail`` tokens only
        (the others 0): the vocabulary projection runs at those positions alone."""
        self.registry.check_tokens(seqs, "LogprobsRequest.sequences")
        head = scaled(self.registry.lm_head, temperature)
        return self._along(adapter, seqs, lambda h: project_logprobs(
            head, h, torch.arange(len(h.tokens_U), device=self.device))[0], chunk, tail)

    def values(self, adapter: str, seqs: Seq[np.ndarray], chunk: int = 64) -> list[np.ndarray]:
        """The critic's ``float32[T_i]`` values along each sequence: entry ``t`` is the value
        head on the final hidden state at ``t - 1`` (the state before token ``t``, having read
        tokens ``< t``, adapter on); entry 0 is 0. No vocabulary projection runs."""
        named = self.registry.get(adapter).critic(adapter, "ValuesRequest")
        self.registry.check_tokens(seqs, "ValuesRequest.sequences")
        return self._along(adapter, seqs, lambda h: value_head.apply(named, h.h_U_H), chunk)


def scaled(lm_head: torch.nn.Module, temperature: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``lm_head``, or ``logits / temperature`` when the sampler drew at another temperature
    (its log-probs are of ``softmax(logits / T)``: the trainer must score the same policy)."""
    if temperature == 1.0:
        return lm_head
    return lambda h: lm_head(h) / temperature


def sampled_row(seq: Sequence) -> SampledRow:
    """A finished engine row as the sampler's result type."""
    return SampledRow(tokens=np.asarray(seq.out_tokens, dtype=np.int32),
                      logprobs=np.asarray(seq.out_logprobs, dtype=np.float32),
                      stop_reason=seq.stop_reason)
