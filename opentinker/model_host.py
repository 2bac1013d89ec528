"""One resident base model and every LoRA adapter on it, with each adapter's optimizer.

The :class:`ModelHost` runs the scheduler's primitives synchronously (the scheduler calls it
from its single compute thread): mixed-adapter sampling in one forward pass (PEFT's
``adapter_names``), teacher-forced log-probs, ``forward_backward`` with a loss from
``learners``, AdamW ``optim_step``, and the adapter lifecycle: create, drop, snapshot (a
frozen copy), save and load (PEFT format plus optimizer state, :mod:`opentinker.adapter_io`).

Log-probs for training are computed only at the positions the loss needs: the transformer
body runs on the whole sequence, the 49k-row vocabulary projection only on the hidden states
that predict a loss token. A loss that needs the reference (a KL penalty, DPO) gets the base
model's log-probs at the same positions, computed with the adapter off and no gradient.

An adapter may carry a critic (``LoraSpec.value_head``, :mod:`opentinker.value_head`): its
values are read with :meth:`ModelHost.values` and trained by ``forward_backward`` with the
``value`` loss, from the same hidden states as the policy's log-probs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from learners import (
    LOSSES,
    LossKind,
    compute_loss,
    explained_variance,
    logprob_mismatch,
    split_terms,
)
from opentinker import adapter_io, value_head
from opentinker.sampler import SampledRow, sample_rows, validate_params
from opentinker.shared_forward import (
    Hidden,
    Selected,
    project_logprobs,
    selected_hidden,
    selected_logprobs,
)
from opentinker.train_batches import VALUE_INPUTS, MetricSums, chunks, gather
from protocols.messages import AdamParams, Datum, LoraSpec, SamplingParams

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class UnknownAdapterError(LookupError, ValueError):
    """A request named an adapter the host does not have; the bus answers ``not_found``
    (a ``LookupError``), and callers that expect a ``ValueError`` still catch it."""


@dataclass
class AdapterState:
    spec: LoraSpec
    named: dict[str, torch.nn.Parameter]
    """Portable parameter name (PEFT's saved key, or ``value_head.*``) -> parameter."""
    optimizer: torch.optim.AdamW | None
    """``None`` for a frozen adapter."""
    version: int = 0
    pending_grad: bool = False
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.named.values())

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    def critic(self, name: str, op: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's parameter table, checked to hold a value head (``ValueError`` naming
        ``op`` and the adapter otherwise)."""
        if not self.spec.value_head:
            raise ValueError(f"{op}: adapter {name!r} has no value head (create it with "
                             "LoraSpec.value_head = true)")
        return self.named


class ModelHost:
    """A base model resident on one device, with named LoRA adapters."""

    def __init__(self, model_path: str, device: str = "cpu", threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM

        if threads:
            # Ray sets OMP_NUM_THREADS=1 in actors; the scheduler is the one actor that computes.
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.model_path = model_path
        self.base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.base.to(self.device).eval()
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.model = self.base  # becomes a PeftModel with the first adapter
        self.adapters: dict[str, AdapterState] = {}
        self.share_prefix = True
        """Run shared prefixes and duplicate sequences once in log-prob computations (exact)."""
        self.pad_id = int(self.base.config.pad_token_id if self.base.config.pad_token_id is not None else 0)
        self.base_fingerprint = adapter_io.fingerprint(self.base)
        """Identifies the base weights in saved adapters (:func:`opentinker.adapter_io.fingerprint`)."""

    # ----------------------------------------------------------------------------- adapters

    def create_adapter(self, name: str, spec: LoraSpec) -> int:
        """Add a zero-initialised (B = 0) LoRA adapter; returns its version (0). Creating an
        existing adapter with the same spec returns its version (idempotent)."""
        if name in self.adapters:
            if self.adapters[name].spec != spec:
                raise ValueError(f"adapter {name!r} exists with another spec")
            return self.adapters[name].version
        self._add_peft(name, spec, trainable=True)
        return 0

    def _add_peft(self, name: str, spec: LoraSpec, trainable: bool) -> AdapterState:
        from peft import LoraConfig, get_peft_model

        if not name.isidentifier() or name == BASE or name in "lora_":
            # PEFT keys adapter weights by name inside "lora_A.<name>": a name that is part of
            # "lora_" would be reinitialised when the saved adapter is loaded.
            raise ValueError(f"invalid adapter name {name!r}: use an identifier that is not part of 'lora_'")
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} already exists")
        if spec.rank < 1:
            raise ValueError(f"LoraSpec.rank must be >= 1, got {spec.rank}")
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            lora_dropout=spec.dropout,
            target_modules=list(spec.target_modules),
            task_type="CAUSAL_LM",
        )
        torch.manual_seed(spec.seed)
        try:
            if self.model is self.base:
                self.model = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.model.add_adapter(name, config)
        except ValueError as e:  # PEFT: "Target modules ... not found in the base model"
            raise ValueError(f"LoraSpec.target_modules {spec.target_modules}: {e}") from None
        self.model.eval()
        named = {
            adapter_io.portable_name(n, name): p
            for n, p in self.model.named_parameters()
            if ("lora_A." + name + ".") in n or ("lora_B." + name + ".") in n
        }
        if not named:
            self.model.delete_adapter(name)
            raise ValueError(f"LoraSpec.target_modules {spec.target_modules} matched no module")
        for p in named.values():
            p.requires_grad_(False)
        if spec.value_head:
            named.update(value_head.new_value_head(self.base.config.hidden_size, self.device))
        optimizer = torch.optim.AdamW(list(named.values()), lr=0.0) if trainable else None
        self.adapters[name] = state = AdapterState(spec=spec, named=named, optimizer=optimizer)
        return state

    def drop_adapter(self, name: str) -> None:
        """Free ``name``'s weights, value head and optimizer state. :class:`UnknownAdapterError`
        (a ``ValueError``) naming an unknown adapter."""
        self._adapter(name)
        del self.adapters[name]
        self.model.delete_adapter(name)

    @torch.no_grad()
    def snapshot(self, src: str, new_name: str) -> int:
        """Freeze a copy of ``src`` (its value head too) under ``new_name``, at ``src``'s
        current version (returned).

        The copy samples, scores and values exactly as ``src`` did at this moment, whatever
        ``src`` trains afterwards; ``forward_backward`` and ``optim_step`` on it are refused.
        """
        source = self._adapter(src)
        state = self._add_peft(new_name, source.spec, trainable=False)
        for key, p in state.named.items():
            p.copy_(source.named[key])
        state.version = source.version
        return state.version

    def _adapter(self, name: str) -> AdapterState:
        if name not in self.adapters:
            raise UnknownAdapterError(f"unknown adapter {name!r}; known: {sorted(self.adapters)}")
        return self.adapters[name]

    def _trainable(self, name: str, op: str) -> AdapterState:
        state = self._adapter(name)
        if not state.trainable:
            raise ValueError(f"{op}: adapter {name!r} is frozen (a snapshot, or loaded with "
                             "trainable=False) and cannot be trained")
        return state

    def _check_tokens(self, seqs: Sequence[np.ndarray], where: str) -> None:
        """Raise ``ValueError`` naming ``where`` for an empty sequence or an id outside the vocabulary."""
        vocab = self.base.config.vocab_size
        for i, s in enumerate(seqs):
            if len(s) == 0:
                raise ValueError(f"{where}[{i}] is empty")
            if int(np.min(s)) < 0 or int(np.max(s)) >= vocab:
                raise ValueError(f"{where}[{i}]: token id out of range [0, {vocab})")

    def version(self, name: str | None) -> int:
        return -1 if name is None else self._adapter(name).version

    # ----------------------------------------------------------------------------- sampling

    def sample(
        self,
        adapters: Sequence[str | None],
        prompts: Sequence[np.ndarray],
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
    ) -> list[SampledRow]:
        """One reply per row; each row with its own adapter (``None``: base), in one batch."""
        for p in set(params):
            validate_params(p)
        for a in set(adapters):
            if a is not None:
                self._adapter(a)
        self._check_tokens(prompts, "SampleRequest.prompts")
        names = [BASE if a is None else a for a in adapters]
        # PEFT's mixed batches split every LoRA layer by adapter; one adapter needs no split.
        mixed = self.model is not self.base and len(set(names)) > 1

        def forward(ids, mask, pos, past, rows):
            kwargs = {
                "input_ids": ids, "attention_mask": mask, "position_ids": pos, "cache": past,
                "use_cache": True, "logits_to_keep": 1,
            }
            if mixed:
                kwargs["adapter_names"] = [names[r] for r in rows]
            out = self.model(**kwargs)
            return out.logits[:, -1, :], out.cache

        with (self._select(adapters[0]) if not mixed else contextlib.nullcontext()):
            return sample_rows(forward, prompts, params, seeds, self.pad_id, self.device, keys=names)

    # ----------------------------------------------------------------------------- log-probs

    def _select(self, adapter: str | None):
        """Context in which the model computes with ``adapter`` (``None``: the base)."""
        if self.model is self.base:
            if adapter is not None:
                self._adapter(adapter)
            return contextlib.nullcontext()
        if adapter is None:
            return self.model.disable_adapter()
        self._adapter(adapter)
        self.model.set_adapter(adapter)
        for n, p in self.model.named_parameters():  # set_adapter may flip requires_grad
            p.requires_grad_(False)
        return contextlib.nullcontext()

    def _inner(self) -> torch.nn.Module:
        """The causal LM (``.model`` body, ``.lm_head``): PEFT injects the LoRA layers into
        ``self.base`` in place, so it computes with whichever adapter is active."""
        return self.base

    def _logp_at(
        self, seqs: Sequence[np.ndarray], masks: Sequence[np.ndarray], share: bool = True,
        entropy: bool = False, entropy_grad: bool = False, temperature: float = 1.0,
    ) -> Selected:
        """Log-probs (and optionally entropies) at the masked positions of ``seqs`` with the
        active adapter, of ``softmax(logits / temperature)`` (see
        :func:`opentinker.shared_forward.selected_logprobs`)."""
        inner = self._inner()
        return selected_logprobs(inner.model, _scaled(inner.lm_head, temperature), seqs, masks, self.pad_id,
                                 self.device, share, entropy=entropy, entropy_grad=entropy_grad)

    def _hidden_at(self, seqs: Sequence[np.ndarray], masks: Sequence[np.ndarray]) -> Hidden:
        """Final hidden states before the masked positions, with the active adapter."""
        return selected_hidden(self._inner().model, seqs, masks, self.pad_id, self.device, self.share_prefix)

    @torch.no_grad()
    def _along(
        self, adapter: str | None, seqs: Sequence[np.ndarray], per_row: Callable[[Hidden], torch.Tensor], chunk: int,
    ) -> list[np.ndarray]:
        """``float32[T_i]`` per sequence: ``per_row`` of the hidden state before every token
        (entry 0 is 0), ``chunk`` sequences at a time."""
        out: list[np.ndarray] = []
        with self._select(adapter):
            for start in range(0, len(seqs), chunk):
                part = [np.asarray(s) for s in seqs[start : start + chunk]]
                hidden = self._hidden_at(part, [np.ones(len(s)) for s in part])
                per_U = per_row(hidden).float().cpu().numpy() if len(hidden.tokens_U) else np.zeros(0, np.float32)
                for rows, pos, s in zip(hidden.rows, hidden.taken, part):
                    row = np.zeros(len(s), dtype=np.float32)
                    row[pos] = per_U[rows]
                    out.append(row)
        return out

    def logprobs(self, adapter: str | None, seqs: Sequence[np.ndarray], chunk: int = 64) -> list[np.ndarray]:
        """Teacher-forced ``float32[T_i]`` log-probs of every token (entry 0 is 0)."""
        self._check_tokens(seqs, "LogprobsRequest.sequences")
        head = self._inner().lm_head
        return self._along(adapter, seqs, lambda h: project_logprobs(
            head, h, torch.arange(len(h.tokens_U), device=self.device))[0], chunk)

    def values(self, adapter: str, seqs: Sequence[np.ndarray], chunk: int = 64) -> list[np.ndarray]:
        """The critic's ``float32[T_i]`` values along each sequence: entry ``t`` is the value
        head on the final hidden state at ``t - 1`` (the state before token ``t``, having read
        tokens ``< t``, adapter on); entry 0 is 0. No vocabulary projection runs."""
        named = self._adapter(adapter).critic(adapter, "ValuesRequest")
        self._check_tokens(seqs, "ValuesRequest.sequences")
        return self._along(adapter, seqs, lambda h: value_head.apply(named, h.h_U_H), chunk)

    # ----------------------------------------------------------------------------- training

    def _check_datums(self, datums: Sequence[Datum], needs: Sequence[str] = ("mask",)) -> None:
        self._check_tokens([d.tokens for d in datums], "ForwardBackward.datums.tokens")
        keys = set(datums[0].loss_inputs) if datums else set()
        for i, d in enumerate(datums):
            missing = [k for k in needs if k not in d.loss_inputs]
            if missing:
                raise ValueError(f"ForwardBackward.datums[{i}].loss_inputs needs {missing} "
                                 f"(has {sorted(d.loss_inputs)})")
            if set(d.loss_inputs) != keys:
                raise ValueError(f"ForwardBackward.datums[{i}].loss_inputs has keys "
                                 f"{sorted(d.loss_inputs)}, datums[0] has {sorted(keys)}")
            for k, v in d.loss_inputs.items():
                if len(v) != len(d.tokens):
                    raise ValueError(f"Datum.loss_inputs[{k!r}] has length {len(v)}, tokens {len(d.tokens)}")

    @contextlib.contextmanager
    def _grad(self, state: AdapterState) -> Iterator[None]:
        """Parameters of ``state`` require grad inside (only while its loss is computed, so a
        sample batch never builds a graph)."""
        for p in state.params:
            p.requires_grad_(True)
        try:
            yield
        finally:
            for p in state.params:
                p.requires_grad_(False)

    def forward_backward(
        self,
        adapter: str,
        datums: Sequence[Datum],
        loss: str,
        loss_config: Mapping[str, float],
        normalizer: float,
        chunk: int = 64,
        value_normalizer: float = 0.0,
    ) -> tuple[float, dict[str, float]]:
        """Accumulate gradients of ``sum(loss) / normalizer`` over ``datums`` into ``adapter``.

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
        state = self._trainable(adapter, "forward_backward")
        norms = {LossKind.VALUE: value_normalizer or normalizer}
        # (name, config, metric prefix, normalizer): the main loss, then each term.
        jobs = [(loss, config, "", norms.get(spec.kind, normalizer))] + [
            (t, {**config, "coef": c} if LOSSES[t].kind is LossKind.VALUE else {"coef": c}, f"{t}/",
             norms.get(LOSSES[t].kind, normalizer)) for t, c in terms.items()]
        on_values = [j for j in jobs if LOSSES[j[0]].kind is LossKind.VALUE]
        on_logp = [j for j in jobs if LOSSES[j[0]].kind is not LossKind.VALUE]
        named = state.critic(adapter, "forward_backward with the 'value' loss") if on_values else {}
        self._check_datums(datums, ("mask", *(VALUE_INPUTS if on_values else ())))
        given = set(datums[0].loss_inputs) if datums else set()
        needs = set().union(*(LOSSES[j[0]].needs for j in on_logp))
        want_ref = "ref_logprobs" in needs and "ref_logprobs" not in given
        policy = spec.kind is LossKind.POLICY
        want_entropy = bool(on_logp) and ("entropy" in needs or policy) and "entropy" not in given
        acc = MetricSums()
        seen: dict[str, list[torch.Tensor]] = {"logp": [], "sampler": [], "values": [], "targets": []}
        lm_head = _scaled(self._inner().lm_head, temperature)
        for part in chunks(datums, chunk):
            seqs = [d.tokens for d in part]
            masks = [np.asarray(d.loss_inputs["mask"]) if on_logp else np.zeros(len(d.tokens)) for d in part]
            vmasks = [np.asarray(d.loss_inputs["value_mask"]) if on_values else np.zeros(len(d.tokens))
                      for d in part]
            ref_N = None
            if want_ref:
                with torch.no_grad(), self._select(None):
                    ref_N = self._logp_at(seqs, masks, self.share_prefix, temperature=temperature).logp_N
            with self._select(adapter), self._grad(state):
                hidden = self._hidden_at(seqs, [(m != 0) | (v != 0) for m, v in zip(masks, vmasks)])
                if len(hidden.tokens_U) == 0:
                    continue
                total_loss = torch.zeros((), device=self.device)
                outputs: list[tuple[list, torch.Tensor, dict[str, torch.Tensor]]] = []
                if on_logp:
                    logp_N, entropy_N = project_logprobs(lm_head, hidden, hidden.at(masks), want_entropy,
                                                         "entropy" in terms)
                    inputs = gather(part, masks, given - {"mask", *VALUE_INPUTS}, self.device)
                    if ref_N is not None:
                        inputs["ref_logprobs"] = ref_N
                    if entropy_N is not None:
                        inputs["entropy"] = entropy_N
                    outputs.append((on_logp, logp_N, inputs))
                    if policy:
                        seen["logp"].append(logp_N.detach())
                        seen["sampler"].append(inputs["sampler_logprobs"])
                if on_values:
                    values_N = value_head.apply(named, hidden.h_U_H[hidden.at(vmasks)])
                    vinputs = gather(part, vmasks, ("value_targets", "old_values"), self.device)
                    outputs.append((on_values, values_N, vinputs))
                    seen["values"].append(values_N.detach())
                    seen["targets"].append(vinputs["value_targets"])
                for todo, first_N, inputs in outputs:
                    for name, cfg, prefix, norm in todo:
                        out = compute_loss(name, first_N, inputs, cfg)
                        total_loss = total_loss + out.loss_sum / norm
                        acc.add(prefix, out.metrics, term=(name, out.loss_sum, norm))
                total_loss.backward()
        state.pending_grad = True
        metrics = acc.result()
        if policy and seen["logp"]:
            metrics.update(logprob_mismatch(torch.cat(seen["logp"]), torch.cat(seen["sampler"])))
        for _, _, prefix, _ in on_values:
            if seen["values"]:
                metrics[prefix + "explained_variance"] = explained_variance(
                    torch.cat(seen["values"]), torch.cat(seen["targets"]))
        return sum(v for k, v in metrics.items() if k.startswith("term/")), metrics

    def optim_step(self, adapter: str, hp: AdamParams) -> tuple[int, float]:
        """AdamW on the accumulated gradients; zero them; bump and return the version."""
        state = self._trainable(adapter, "optim_step")
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

    # ----------------------------------------------------------------------------- files

    def save(self, adapter: str, path: str) -> int:
        """Write ``adapter`` to the folder ``path`` atomically (temporary folder, then rename):
        PEFT format, its value head if it has one, its AdamW state, its version and the base
        model's name and fingerprint (:mod:`opentinker.adapter_io`). Returns its version."""
        state = self._adapter(adapter)
        meta = adapter_io.AdapterMeta(
            format=adapter_io.FORMAT, version=state.version, spec=state.spec,
            base_model=self.model_path, base_fingerprint=self.base_fingerprint,
        )
        adapter_io.write_adapter(Path(path), self.model, adapter, state.named, state.optimizer, meta)
        return state.version

    @torch.no_grad()
    def load(self, path: str, name: str, trainable: bool = True) -> int:
        """Load a folder written by :meth:`save` as adapter ``name``: weights (and value head),
        AdamW state (for a trainable adapter) and version (returned).

        Raises:
            ValueError: naming ``path`` and the fault: no such folder, a missing or corrupt
                file, a base model other than this host's, weights that do not fit the spec.
                Nothing is left behind: the host keeps serving as before.
        """
        folder = Path(path)
        meta = adapter_io.read_meta(folder)
        if meta.base_fingerprint != self.base_fingerprint:
            raise ValueError(
                f"{folder}: saved on base model {meta.base_model!r} (fingerprint "
                f"{meta.base_fingerprint}); this host serves {self.model_path!r} "
                f"(fingerprint {self.base_fingerprint})"
            )
        weights, moments = adapter_io.read_adapter(folder, meta.spec, trainable)
        state = self._add_peft(name, meta.spec, trainable=trainable)
        try:
            adapter_io.restore(folder, meta.spec, state.named, state.optimizer, weights, moments)
        except Exception:
            self.drop_adapter(name)
            raise
        state.version = meta.version
        return state.version


def _scaled(lm_head: torch.nn.Module, temperature: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``lm_head``, or ``logits / temperature`` when the sampler drew at another temperature
    (its log-probs are of ``softmax(logits / T)``: the trainer must score the same policy)."""
    if temperature == 1.0:
        return lm_head
    return lambda h: lm_head(h) / temperature
