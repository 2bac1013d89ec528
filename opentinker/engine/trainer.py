"""The trainer: ``forward_backward`` with a loss from ``learners`` and AdamW ``optim_step``
on one adapter of the registry.

Log-probs for training are computed only at the positions the loss needs: the transformer
body runs on the whole sequence (through the inference API, shared prefixes once), the 49k-row
vocabulary projection only on the hidden states that predict a loss token. A loss that needs
the reference (a KL penalty, DPO) gets the base model's log-probs at the same positions,
computed with the adapter off and no gradient. An adapter's critic
(:mod:`opentinker.engine.value_head`) is trained by the ``value`` loss from the same hidden
states as the policy's log-probs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from learners import (
    LOSSES,
    MOVE_INPUTS,
    LossKind,
    compute_loss,
    explained_variance,
    logprob_mismatch,
    split_terms,
    term_config,
)
from opentinker.engine import value_head
from opentinker.engine.registry import AdapterRegistry, AdapterState
from opentinker.engine.inference import Inference, scaled
from opentinker.engine.shared_forward import HEAD_ROWS, project_logprobs, project_move_logprobs
from opentinker.engine.model import layer_checkpointing
from opentinker.engine.train_batches import VALUE_INPUTS, MetricSums, chunks, computed_tokens, gather
from protocols.messages import AdamParams, Datum, datum_order

T = TypeVar("T")

DEFAULT_TRAIN_MEMORY_BYTES = 1 << 30
"""What one part of a ``forward_backward`` may hold in activations (``model.train_memory_mb``)."""


def activation_bytes_per_token(hidden: int, intermediate: int, layers: int, dtype_bytes: int) -> int:
    """Bytes autograd keeps per token for the backward of one training forward: per layer about
    five ``intermediate``-wide tensors (the MLP's gate, up, activation, product) and eleven
    ``hidden``-wide ones (norms, q/k/v/o, residuals, attention output); attention itself keeps
    O(tokens) (SDPA's flash kernels, on CPU too). Measured on SmolLM2-135M in fp32: 1.67 MB per
    token saved, this formula 1.68 MB (``benchmarks/train_memory.py``)."""
    return layers * (5 * intermediate + 11 * hidden) * dtype_bytes


def head_bytes(vocab: int, loss_tokens: int = HEAD_ROWS) -> int:
    """Bytes autograd keeps for the vocabulary projection of ``loss_tokens`` rows (float32
    logits and their log-softmax); at most :data:`HEAD_ROWS` rows' worth, since larger parts
    run it in checkpointed blocks."""
    return min(loss_tokens, HEAD_ROWS) * vocab * 4 * 2


def part_tokens(registry: AdapterRegistry, budget_bytes: int = DEFAULT_TRAIN_MEMORY_BYTES) -> int:
    """The most tokens one part of a ``forward_backward`` computes so that its activations
    (:func:`activation_bytes_per_token` each, and the vocabulary projection's
    :func:`head_bytes`) fit ``budget_bytes``; at least 1: a datum is never split, so a longer
    one is a part alone."""
    spec = getattr(getattr(registry, "decoder", None), "spec", None)
    if spec is not None:  # the engine's own decoder
        hidden, inter, layers = spec.hidden_size, spec.intermediate_size, spec.num_layers
        dtype_bytes = torch.finfo(registry.dtype).bits // 8
    else:  # PEFT's model (fp32)
        cfg = registry.base.config
        hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
        inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
        dtype_bytes = 4
    room = int(budget_bytes) - head_bytes(registry.vocab_size)
    return max(1, room // activation_bytes_per_token(hidden, inter, layers, max(dtype_bytes, 4)))


class _LossJob(NamedTuple):
    """One loss of a ``forward_backward``: the main loss or a term."""

    name: str
    """A name in ``learners.LOSSES``."""
    config: dict[str, float]
    prefix: str
    """Of its metrics' keys: ``""`` for the main loss, ``"<term>/"`` for a term."""
    norm: float
    """What its loss sum is divided by."""


@dataclass
class _LossPlan:
    """What every part of a ``forward_backward`` computes, decided before the first."""

    adapter: str
    state: AdapterState
    on_logp: list[_LossJob]
    """The losses on the policy's log-probs (main loss first)."""
    on_values: list[_LossJob]
    """The losses on the critic's values."""
    critic: dict[str, torch.nn.Parameter]
    """The adapter's parameter table when a loss is on values (its value head), else empty."""
    given: set[str]
    """The loss inputs the datums carry."""
    want_ref: bool
    """Compute ``ref_logprobs`` (the base model's, adapter off)."""
    want_entropy: bool
    """Compute ``entropy`` (full-vocabulary) at the log-prob positions."""
    entropy_grad: bool
    """The entropy is a term of the loss (differentiable), not only a diagnostic."""
    want_moves: bool
    """Compute ``move_logprobs`` (the ``move_values`` term's) from ``move_tokens``."""
    policy: bool
    """The main loss is a policy loss (the log-prob mismatch is reported)."""
    temperature: float
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    """The vocabulary projection at ``temperature``."""


@dataclass
class _Seen:
    """What the summary of a ``forward_backward`` needs from every part, each ``float32[N]``
    per part: the policy's log-probs and the sampler's at the same positions, the critic's
    values and their targets."""

    logp: list[torch.Tensor] = field(default_factory=list)
    sampler: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)


def _summary(plan: _LossPlan, acc: MetricSums, seen: _Seen) -> tuple[float, dict[str, float]]:
    """The normalised loss (every term's, summed) and the metrics: ``acc``'s, with the log-prob
    mismatch quantiles and the critic's ``explained_variance`` computed exactly over all parts."""
    metrics = acc.result()
    if plan.policy and seen.logp:
        metrics.update(logprob_mismatch(torch.cat(seen.logp), torch.cat(seen.sampler)))
    for job in plan.on_values:
        if seen.values:
            metrics[job.prefix + "explained_variance"] = explained_variance(
                torch.cat(seen.values), torch.cat(seen.targets))
    return sum(v for k, v in metrics.items() if k.startswith("term/")), metrics


class Trainer:
    """Gradients and optimizer steps for the registry's trainable adapters.

    ``memory_bytes``: what one part of a ``forward_backward`` may hold in activations; its
    datums are cut into parts of at most :func:`part_tokens` tokens, so a learning step's peak
    memory is set by this budget, not by the number or length of its episodes."""

    def __init__(self, registry: AdapterRegistry, inference: Inference,
                 memory_bytes: int = DEFAULT_TRAIN_MEMORY_BYTES) -> None:
        if not memory_bytes > 0:
            raise ValueError(f"the training memory budget must be > 0 bytes, got {memory_bytes}")
        self.registry = registry
        self.inference = inference
        self.device = registry.device
        self.part_tokens = part_tokens(registry, memory_bytes)
        """The most tokens one part of a ``forward_backward`` computes."""

    def check_datums(self, datums: Sequence[Datum], needs: Sequence[str] = ("mask",)) -> None:
        self.registry.check_tokens([d.tokens for d in datums], "ForwardBackward.datums.tokens")
        keys = set(datums[0].loss_inputs) if datums else set()
        for i, d in enumerate(datums):
            missing = [k for k in needs if k not in d.loss_inputs]
            if missing:
                raise ValueError(f"ForwardBackward.datums[{i}].loss_inputs needs {missing} "
                                 f"(has {sorted(d.loss_inputs)})")
            if set(d.loss_inputs) != keys:
                raise ValueError(f"ForwardBackward.datums[{i}].loss_inputs has keys "
                                 f"{sorted(d.loss_inputs)}, datums[0] has {sorted(keys)}")
            if np.asarray(d.tokens).ndim != 1:
                raise ValueError(f"ForwardBackward.datums[{i}].tokens must be 1-D, got shape {np.shape(d.tokens)}")
            for k, v in d.loss_inputs.items():
                if len(v) != len(d.tokens):
                    raise ValueError(f"Datum.loss_inputs[{k!r}] has length {len(v)}, tokens {len(d.tokens)}")
                if np.shape(v)[1:] != np.shape(datums[0].loss_inputs[k])[1:]:
                    raise ValueError(f"ForwardBackward.datums[{i}].loss_inputs[{k!r}] has shape {np.shape(v)}, "
                                     f"datums[0]'s {np.shape(datums[0].loss_inputs[k])}: only the length may differ")
                bad = np.nonzero(~np.isfinite(np.asarray(v, dtype=np.float64)))[0]
                if len(bad):
                    raise ValueError(f"ForwardBackward.datums[{i}].loss_inputs[{k!r}] is not finite at "
                                     f"positions {bad[:5].tolist()}")

    def forward_backward_parts(
        self,
        adapter: str,
        datums: Sequence[Datum],
        loss: str,
        loss_config: Mapping[str, float],
        normalizer: float,
        chunk: int = 64,
        value_normalizer: float = 0.0,
        max_tokens: int = 0,
    ) -> Generator[None, None, tuple[float, dict[str, float]]]:
        """Accumulate gradients of ``sum(loss) / normalizer`` over ``datums`` into ``adapter``,
        one part of at most ``chunk`` datums and :attr:`part_tokens` tokens (fewer with
        ``max_tokens`` > 0) at a time:
        a generator that yields between parts (a shared scheduler runs other work there) and
        returns the normalised loss and metrics (:func:`drain` runs it whole). The loss is a sum over the parts, so the
        gradient is the same however the datums are cut; they are cut in token order
        (:func:`protocols.messages.datum_order`), and each part runs as one prefix tree.

        ``loss`` is a name in ``learners.LOSSES``. Terms ride in ``loss_config`` under their
        own names with their coefficients (:func:`learners.losses.split_terms`): penalties
        (``{"kl_k3": 0.05, "entropy": 0.01}``) share the normalizer; ``value`` (the critic's
        clipped loss on the adapter's value head, ``value_clip`` in ``loss_config``) is
        divided by ``value_normalizer`` (0: ``normalizer``). The value loss may also be the
        main loss (a critic-only step). Inputs the losses need and the datums lack are
        computed here: ``ref_logprobs`` (the base model, adapter off, no gradient, at the
        loss positions only) and ``entropy`` (full-vocabulary, from logits that exist anyway).
        Policy losses always get ``entropy`` for their diagnostics.

        Log-probs are taken where ``mask`` is nonzero, values where ``value_mask`` is (with
        ``value_targets`` and ``old_values`` there), from ONE pass of the body over the union
        of those positions; only log-prob positions go through the vocabulary projection.

        Returns the normalised loss (all terms) and metrics: the main loss's diagnostics
        (token-weighted over chunks, or pair-weighted; the log-prob mismatch quantiles and
        the critic's ``explained_variance`` are exact over the whole call), each term's as
        ``<term>/<metric>``, and each term's normalised loss as ``term/<name>``.
        """
        plan = self._plan_losses(adapter, datums, loss, loss_config, normalizer, value_normalizer)
        acc = MetricSums()
        seen = _Seen()
        plan.state.pending_grad = True  # from the first part on: a call cut short leaves gradients to discard
        limit = min(max_tokens, self.part_tokens) if max_tokens > 0 else self.part_tokens
        for i, part in enumerate(chunks(datum_order(datums), chunk, limit)):
            if i:
                yield  # between parts
            self._part_backward(plan, part, acc, seen)
        return _summary(plan, acc, seen)

    def _plan_losses(self, adapter: str, datums: Sequence[Datum], loss: str, loss_config: Mapping[str, float],
                     normalizer: float, value_normalizer: float) -> _LossPlan:
        """Check the call (its arguments, the adapter, the datums) and decide what each part
        computes: the losses on log-probs and on values, and the inputs computed here
        (``ref_logprobs``, ``entropy``); ``ValueError`` naming what is wrong."""
        if not normalizer > 0:
            raise ValueError(f"ForwardBackward.normalizer must be > 0, got {normalizer}")
        if not value_normalizer >= 0:
            raise ValueError(f"ForwardBackward.value_normalizer must be >= 0, got {value_normalizer}")
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; known: {sorted(LOSSES)}")
        spec = LOSSES[loss]
        if spec.kind is LossKind.PENALTY:
            raise ValueError(f"loss {loss!r} ({spec.kind.value}) cannot be the main loss of "
                             "forward_backward (a penalty is added to another loss through loss_config)")
        loss_config = dict(loss_config)
        temperature = float(loss_config.pop("temperature", 1.0))
        if not temperature > 0:
            raise ValueError(f"loss_config temperature must be > 0, got {temperature}")
        config, terms = split_terms(loss_config)
        if loss in terms:
            raise ValueError(f"loss_config names the main loss {loss!r} as a term")
        state = self.registry.trainable(adapter, "forward_backward")
        norms = {LossKind.VALUE: value_normalizer or normalizer}
        # The main loss, then each term.
        jobs = [_LossJob(loss, config, "", norms.get(spec.kind, normalizer))] + [
            _LossJob(t, {**config, "coef": c} if LOSSES[t].kind is LossKind.VALUE else term_config(loss_config, t, c),
                     f"{t}/", norms.get(LOSSES[t].kind, normalizer)) for t, c in terms.items()]
        on_values = [j for j in jobs if LOSSES[j.name].kind is LossKind.VALUE]
        on_logp = [j for j in jobs if LOSSES[j.name].kind is not LossKind.VALUE]
        named = state.critic(adapter, "forward_backward with the 'value' loss") if on_values else {}
        self.check_datums(datums, ("mask", *(VALUE_INPUTS if on_values else ()), *(MOVE_INPUTS if "move_values" in terms else ())))
        given = set(datums[0].loss_inputs) if datums else set()
        needs = set().union(*(LOSSES[j.name].needs for j in on_logp))
        policy = spec.kind is LossKind.POLICY
        return _LossPlan(
            adapter=adapter, state=state, on_logp=on_logp, on_values=on_values, critic=named, given=given,
            want_ref="ref_logprobs" in needs and "ref_logprobs" not in given,
            want_entropy=bool(on_logp) and ("entropy" in needs or policy) and "entropy" not in given,
            entropy_grad="entropy" in terms, want_moves="move_logprobs" in needs and "move_logprobs" not in given,
            policy=policy, temperature=temperature,
            lm_head=scaled(self.registry.lm_head, temperature))

    def _part_backward(self, plan: _LossPlan, part: Sequence[Datum], acc: MetricSums, seen: _Seen) -> None:
        """One part's forward (the reference's log-probs first when wanted, then one pass of the
        body with the adapter on) and the backward of its losses; folds its metrics into
        ``acc`` and what the summary needs into ``seen``."""
        seqs = [d.tokens for d in part]
        masks = [np.asarray(d.loss_inputs["mask"]) if plan.on_logp else np.zeros(len(d.tokens)) for d in part]
        vmasks = [np.asarray(d.loss_inputs["value_mask"]) if plan.on_values else np.zeros(len(d.tokens))
                  for d in part]
        ref_N = None
        if plan.want_ref:
            with torch.no_grad(), self.registry.select(None):
                ref_N = self.inference.logp_at(seqs, masks, self.inference.share_prefix,
                                               temperature=plan.temperature).logp_N
        # A part over the budget is one datum (or pair) longer than it: checkpointing each layer
        # keeps a hidden-wide tensor a token a layer instead of all, for one more forward.
        long = computed_tokens(part) > self.part_tokens
        with self.registry.select(plan.adapter), grad_on(plan.state), layer_checkpointing(long):
            hidden = self.inference.hidden_at(seqs, [(m != 0) | (v != 0) for m, v in zip(masks, vmasks)])
            if len(hidden.tokens_U) == 0:
                return
            total_loss = torch.zeros((), device=self.device)
            outputs: list[tuple[list[_LossJob], torch.Tensor, dict[str, torch.Tensor]]] = []
            if plan.on_logp:
                logp_N, entropy_N = project_logprobs(plan.lm_head, hidden, hidden.at(masks), plan.want_entropy,
                                                     plan.entropy_grad)
                inputs = gather(part, masks, plan.given - {"mask", *VALUE_INPUTS}, self.device)
                if ref_N is not None:
                    inputs["ref_logprobs"] = ref_N
                if entropy_N is not None:
                    inputs["entropy"] = entropy_N
                if plan.want_moves:
                    inputs["move_logprobs"] = project_move_logprobs(plan.lm_head, hidden, hidden.at(masks),
                                                                    inputs["move_tokens"])
                outputs.append((plan.on_logp, logp_N, inputs))
                if plan.policy:
                    seen.logp.append(logp_N.detach())
                    seen.sampler.append(inputs["sampler_logprobs"])
            if plan.on_values:
                values_N = value_head.apply(plan.critic, hidden.h_U_H[hidden.at(vmasks)])
                vinputs = gather(part, vmasks, ("value_targets", "old_values"), self.device)
                outputs.append((plan.on_values, values_N, vinputs))
                seen.values.append(values_N.detach())
                seen.targets.append(vinputs["value_targets"])
            for todo, first_N, inputs in outputs:
                for name, cfg, prefix, norm in todo:
                    out = compute_loss(name, first_N, inputs, cfg)
                    total_loss = total_loss + out.loss_sum / norm
                    acc.add(prefix, out.metrics, term=(name, out.loss_sum, norm))
            total_loss.backward()

    def discard_gradients(self, adapter: str) -> int:
        """Zero the gradients accumulated since the last :meth:`optim_step` (a dead learner's);
        returns the version, unchanged."""
        state = self.registry.trainable(adapter, "discard_gradients")
        if state.pending_grad:
            for p in state.params:
                p.grad = None
            state.pending_grad = False
        return state.version

    def optim_step(self, adapter: str, hp: AdamParams) -> tuple[int, float]:
        """AdamW on the accumulated gradients; zero them; bump and return the version."""
        state = self.registry.trainable(adapter, "optim_step")
        assert state.optimizer is not None
        if not hp.lr >= 0:
            raise ValueError(f"AdamParams.lr must be >= 0, got {hp.lr}")
        grads = [p.grad for p in state.params if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        if hp.grad_clip > 0 and grads:
            torch.nn.utils.clip_grad_norm_(state.params, hp.grad_clip)
        for g in state.optimizer.param_groups:
            g.update(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        state.version += 1
        state.pending_grad = False
        return state.version, grad_norm


def drain(parts: Generator[None, None, T]) -> T:
    """Run a generator of parts to its end; its return value."""
    while True:
        try:
            next(parts)
        except StopIteration as e:
            return e.value


@contextlib.contextmanager
def grad_on(state: AdapterState) -> Iterator[None]:
    """Parameters of ``state`` require grad inside (only while its loss is computed, so a
    sample batch never builds a graph)."""
    for p in state.params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in state.params:
            p.requires_grad_(False)
