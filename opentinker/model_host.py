"""One resident base model and every LoRA adapter on it, with each adapter's optimizer.

The :class:`ModelHost` runs the scheduler's primitives synchronously (the scheduler calls it
from its single compute thread): mixed-adapter sampling in one forward pass (PEFT's
``adapter_names``), teacher-forced log-probs, ``forward_backward`` with a loss from
``learners``, AdamW ``optim_step``, and saving an adapter in PEFT format.

Log-probs for training are computed only at the positions the loss needs: the transformer
body runs on the whole sequence, the 49k-row vocabulary projection only on the hidden states
that predict a loss token.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from learners import compute_loss
from opentinker.sampler import SampledRow, sample_rows, validate_params
from opentinker.shared_forward import selected_logprobs
from protocols.messages import AdamParams, Datum, LoraSpec, SamplingParams

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch


@dataclass
class AdapterState:
    spec: LoraSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    version: int = 0
    pending_grad: bool = False
    stats: dict[str, float] = field(default_factory=dict)


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

    # ----------------------------------------------------------------------------- adapters

    def create_adapter(self, name: str, spec: LoraSpec) -> int:
        """Add a zero-initialised (B = 0) LoRA adapter; returns its version (0)."""
        from peft import LoraConfig, get_peft_model

        if not name.isidentifier() or name == BASE or name in "lora_":
            # PEFT keys adapter weights by name inside "lora_A.<name>": a name that is part of
            # "lora_" would be reinitialised when the saved adapter is loaded.
            raise ValueError(f"invalid adapter name {name!r}: use an identifier that is not part of 'lora_'")
        if name in self.adapters:
            if self.adapters[name].spec != spec:
                raise ValueError(f"adapter {name!r} exists with another spec")
            return self.adapters[name].version
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
        if self.model is self.base:
            self.model = get_peft_model(self.base, config, adapter_name=name)
        else:
            self.model.add_adapter(name, config)
        self.model.eval()
        params = [p for n, p in self.model.named_parameters() if ("lora_A." + name + ".") in n or ("lora_B." + name + ".") in n]
        if not params:
            raise ValueError(f"LoraSpec.target_modules {spec.target_modules} matched no module")
        for p in params:
            p.requires_grad_(False)
        self.adapters[name] = AdapterState(spec=spec, params=params, optimizer=torch.optim.AdamW(params, lr=0.0))
        return 0

    def _adapter(self, name: str) -> AdapterState:
        if name not in self.adapters:
            raise KeyError(f"unknown adapter {name!r}; known: {sorted(self.adapters)}")
        return self.adapters[name]

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
            kwargs = dict(
                input_ids=ids, attention_mask=mask, position_ids=pos, cache=past,
                use_cache=True, logits_to_keep=1,
            )
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

    def _logp_at(
        self, seqs: Sequence[np.ndarray], masks: Sequence[np.ndarray], share: bool = True
    ) -> tuple[torch.Tensor, list[tuple[int, np.ndarray]]]:
        """``logp_N`` of the masked tokens of ``seqs`` with the active adapter, and per row its
        positions (see :func:`opentinker.shared_forward.selected_logprobs`)."""
        inner = self.model.get_base_model() if self.model is not self.base else self.base
        logp_N, taken = selected_logprobs(inner.model, inner.lm_head, seqs, masks, self.pad_id, self.device, share)
        return logp_N, list(enumerate(taken))

    @torch.no_grad()
    def logprobs(self, adapter: str | None, seqs: Sequence[np.ndarray], chunk: int = 64) -> list[np.ndarray]:
        """Teacher-forced ``float32[T_i]`` log-probs of every token (entry 0 is 0)."""
        self._check_tokens(seqs, "LogprobsRequest.sequences")
        out: list[np.ndarray] = []
        with self._select(adapter):
            for start in range(0, len(seqs), chunk):
                part = [np.asarray(s) for s in seqs[start : start + chunk]]
                logp_N, taken = self._logp_at(part, [np.ones(len(s)) for s in part], self.share_prefix)
                logp_N = logp_N.cpu().numpy()
                k = 0
                for (i, pos), s in zip(taken, part):
                    row = np.zeros(len(s), dtype=np.float32)
                    row[pos] = logp_N[k : k + len(pos)]
                    k += len(pos)
                    out.append(row)
        return out

    # ----------------------------------------------------------------------------- training

    def forward_backward(
        self,
        adapter: str,
        datums: Sequence[Datum],
        loss: str,
        loss_config: Mapping[str, float],
        normalizer: float,
        chunk: int = 64,
    ) -> tuple[float, dict[str, float]]:
        """Accumulate gradients of ``sum(loss) / normalizer`` over ``datums`` into ``adapter``.

        Returns the normalised loss and the loss's diagnostics (token-weighted over chunks).
        """
        if not normalizer > 0:
            raise ValueError(f"ForwardBackward.normalizer must be > 0, got {normalizer}")
        state = self._adapter(adapter)
        self._check_tokens([d.tokens for d in datums], "ForwardBackward.datums.tokens")
        for d in datums:
            if "mask" not in d.loss_inputs:
                raise ValueError("Datum.loss_inputs needs 'mask'")
            for k, v in d.loss_inputs.items():
                if len(v) != len(d.tokens):
                    raise ValueError(f"Datum.loss_inputs[{k!r}] has length {len(v)}, tokens {len(d.tokens)}")
        total = 0.0
        sums: dict[str, float] = {}
        n_total = 0
        with self._select(adapter):
            for p in state.params:
                p.requires_grad_(True)
            try:
                for start in range(0, len(datums), chunk):
                    part = datums[start : start + chunk]
                    logp_N, taken = self._logp_at(
                        [d.tokens for d in part], [d.loss_inputs["mask"] for d in part], self.share_prefix
                    )
                    if logp_N.numel() == 0:
                        continue
                    inputs = {
                        k: torch.as_tensor(
                            np.concatenate([np.asarray(d.loss_inputs[k])[pos] for d, (_, pos) in zip(part, taken)]),
                            dtype=torch.float32, device=self.device,
                        )
                        for k in part[0].loss_inputs
                        if k != "mask"
                    }
                    out = compute_loss(loss, logp_N, inputs, loss_config)
                    (out.loss_sum / normalizer).backward()
                    total += float(out.loss_sum.detach()) / normalizer
                    n = int(logp_N.numel())
                    n_total += n
                    for k, v in out.metrics.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * n
            finally:
                for p in state.params:
                    p.requires_grad_(False)
        state.pending_grad = True
        metrics = {k: v / max(n_total, 1) for k, v in sums.items() if k != "n_tokens"}
        metrics["n_tokens"] = float(n_total)
        return total, metrics

    def optim_step(self, adapter: str, hp: AdamParams) -> tuple[int, float]:
        """AdamW on the accumulated gradients; zero them; bump and return the version."""
        state = self._adapter(adapter)
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

    def save(self, adapter: str, path: str) -> int:
        """Write ``adapter`` in PEFT format to ``path`` (atomically); returns its version."""
        state = self._adapter(adapter)
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=final.name + ".tmp"))
        try:
            self.model.save_pretrained(str(tmp), selected_adapters=[adapter])
            # PEFT writes a non-"default" adapter into a subfolder named after it.
            src = tmp / adapter if (tmp / adapter / "adapter_config.json").is_file() else tmp
            if final.exists():
                shutil.rmtree(final)
            os.replace(src, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return state.version
