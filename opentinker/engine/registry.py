"""The adapter registry: one resident base model and every named LoRA adapter on it.

:class:`AdapterRegistry` holds the base model (PEFT injects the LoRA layers into it in
place), each adapter's parameters (:class:`AdapterState`: its portable parameter table, its
AdamW, its version) and the adapter lifecycle: create, drop, snapshot (a frozen copy). The
inference API (:mod:`opentinker.engine.inference`), the trainer (:mod:`opentinker.engine.trainer`)
and the adapter files (:mod:`opentinker.engine.adapter_io`) read and change adapters only
through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from opentinker.engine import adapter_io, value_head
from opentinker.engine.request_checks import check_tokens
from protocols.messages import LoraSpec

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


class AdapterTable:
    """What every registry shares: the table of named adapters with versions, lookups, and
    the checks on names, specs and token ids. Subclasses add the adapters' weights
    (:meth:`add`, :meth:`drop_adapter`) and the model that computes with them."""

    adapters: dict[str, AdapterState]
    vocab_size: int

    def add(self, name: str, spec: LoraSpec, trainable: bool) -> AdapterState:
        raise NotImplementedError

    def drop_adapter(self, name: str) -> None:
        raise NotImplementedError

    def create_adapter(self, name: str, spec: LoraSpec) -> int:
        """Add a zero-initialised (B = 0) adapter; returns its version (0). Creating an
        existing adapter with the same spec returns its version (idempotent)."""
        if name in self.adapters:
            if self.adapters[name].spec != spec:
                raise ValueError(f"adapter {name!r} exists with another spec")
            return self.adapters[name].version
        self.add(name, spec, trainable=True)
        return 0

    def check_new(self, name: str, spec: LoraSpec) -> None:
        """``ValueError`` for a name or spec a new adapter may not have."""
        if not name.isidentifier() or name == BASE or name in "lora_":
            # PEFT keys adapter weights by name inside "lora_A.<name>": a name that is part of
            # "lora_" would be reinitialised when the saved adapter is loaded.
            raise ValueError(f"invalid adapter name {name!r}: use an identifier that is not part of 'lora_'")
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} already exists")
        if spec.rank < 1:
            raise ValueError(f"LoraSpec.rank must be >= 1, got {spec.rank}")

    @torch.no_grad()
    def snapshot(self, src: str, new_name: str) -> int:
        """Freeze a copy of ``src`` (its value head too) under ``new_name``, at ``src``'s
        current version (returned).

        The copy samples, scores and values exactly as ``src`` did at this moment, whatever
        ``src`` trains afterwards; ``forward_backward`` and ``optim_step`` on it are refused.
        """
        spec = self.get(src).spec
        state = self.add(new_name, spec, trainable=False)
        source = self.get(src)  # after the copy exists: adding it may have spilled the source
        for key, p in state.named.items():
            p.copy_(source.named[key])
        state.version = source.version
        return state.version

    def get(self, name: str) -> AdapterState:
        """The adapter ``name``; :class:`UnknownAdapterError` naming the known ones otherwise."""
        if name not in self.adapters:
            raise UnknownAdapterError(f"unknown adapter {name!r}; known: {sorted(self.adapters)}")
        return self.adapters[name]

    def trainable(self, name: str, op: str) -> AdapterState:
        """The adapter ``name``, checked to be trainable (``ValueError`` naming ``op``)."""
        state = self.get(name)
        if not state.trainable:
            raise ValueError(f"{op}: adapter {name!r} is frozen (a snapshot, or loaded with "
                             "trainable=False) and cannot be trained")
        return state

    def version(self, name: str | None) -> int:
        return -1 if name is None else self.get(name).version

    def check_tokens(self, seqs: Sequence[np.ndarray], where: str) -> None:
        """Raise ``ValueError`` naming ``where[i]`` unless every sequence is a non-empty 1-D
        integer array (a list of ints is taken as one) of ids in the vocabulary: the service's
        own check (:func:`~opentinker.engine.request_checks.check_tokens`), for requests that
        reach the engine without the bus."""
        for i, s in enumerate(seqs):
            check_tokens(np.asarray(s), f"{where}[{i}]", self.vocab_size)


class AdapterRegistry(AdapterTable):
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
        self.pad_id = int(self.base.config.pad_token_id if self.base.config.pad_token_id is not None else 0)
        self.vocab_size = int(self.base.config.vocab_size)
        self.max_context = int(getattr(self.base.config, "max_position_embeddings", None) or 2048)
        """Longest sequence (prompt + reply) the model was built for."""
        self.hidden_size = int(self.base.config.hidden_size)
        self.base_fingerprint = adapter_io.fingerprint(self.base)
        """Identifies the base weights in saved adapters (:func:`opentinker.engine.adapter_io.fingerprint`)."""

    # ----------------------------------------------------------------------------- lifecycle

    def add(self, name: str, spec: LoraSpec, trainable: bool) -> AdapterState:
        """Inject a new adapter ``name`` into the model (PEFT's initialisation, seeded by
        ``spec.seed``) and register it; ``trainable=False`` gives it no optimizer."""
        from peft import LoraConfig, get_peft_model

        self.check_new(name, spec)
        if spec.full:
            raise ValueError("LoraSpec.full: full-parameter policies need the engine's own forward "
                             "(model.engine = 'auto' or 'own', on a Llama, Qwen2 or Qwen3 model)")
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
        self.get(name)
        del self.adapters[name]
        self.model.delete_adapter(name)

    # ----------------------------------------------------------------------------- lookups

    # ----------------------------------------------------------------------------- activation

    def select(self, adapter: str | None):
        """Context in which the model computes with ``adapter`` (``None``: the base)."""
        if self.model is self.base:
            if adapter is not None:
                self.get(adapter)
            return contextlib.nullcontext()
        if adapter is None:
            return self.model.disable_adapter()
        self.get(adapter)
        self.model.set_adapter(adapter)
        for n, p in self.model.named_parameters():  # set_adapter may flip requires_grad
            p.requires_grad_(False)
        return contextlib.nullcontext()

    @property
    def lm_head(self) -> torch.nn.Module:
        """The vocabulary projection (``h_R_H -> logits_R_V``)."""
        return self.base.lm_head

    def hidden(self, input_ids_B_L: torch.Tensor, attention_mask_B_T: torch.Tensor | None = None,
               position_ids_B_L: torch.Tensor | None = None, cache=None,
               use_cache: bool = False) -> tuple[torch.Tensor, object]:
        """Final hidden states ``h_B_L_H`` of the PEFT model's body with the active adapter
        (PEFT injects the LoRA layers into ``self.base`` in place) continuing ``cache`` (a
        transformers ``DynamicCache``), and with ``use_cache`` the cache of past + new."""
        out = self.base.model(input_ids=input_ids_B_L, attention_mask=attention_mask_B_T,
                              position_ids=position_ids_B_L, cache=cache, use_cache=use_cache)
        return out.last_hidden_state, out.cache if use_cache else None
