"""The adapter registry on the engine's own forward: one base :class:`~opentinker.engine.model.Decoder`
and every LoRA adapter as plain tensors, no PEFT in the hot path.

Same interface as :class:`opentinker.engine.registry.AdapterRegistry` (the PEFT registry, kept
as the fallback for architectures the engine does not run), so the model runner, the trainer
and the adapter files work on either. Differences:

* An adapter's parameters are PEFT-named tensors (``base_model.model.model.layers.0.self_attn
  .q_proj.lora_A.weight``), initialised as PEFT does for the same seed, and held in a
  :class:`~opentinker.engine.model.LoraWeights` view without copying, so the optimizer, the
  trainer's gradients and the sampler all see the very same tensors.
* :meth:`inner` gives the trainer a transformers-shaped body (``input_ids``,
  ``attention_mask``, ``position_ids``, ``cache`` -> ``last_hidden_state``, ``cache``) over
  the engine's dense attention with the selected adapter's LoRA: the trainer scores with the
  same forward the sampler draws with.
* Saving writes PEFT's two files itself (``adapter_config.json``, ``adapter_model.safetensors``
  with PEFT's keys), so ``PeftModel.from_pretrained`` reads them as before.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import torch

from opentinker.engine import adapter_io, value_head
from opentinker.engine.memory import AdapterMemory, OverBudget, trim_heap
from opentinker.engine.model import (
    Decoder,
    DenseAttention,
    DenseCache,
    LoraBatch,
    LoraWeights,
)
from opentinker.engine.model.lora_slots import LoraSlots
from opentinker.engine.model.tree_attention import TreeAttention
from opentinker.engine.registry import AdapterState, AdapterTable
from protocols.messages import LoraSpec

__all__ = ["LoraRegistry"]


class LoraRegistry(AdapterTable):
    """A base :class:`Decoder` resident on one device, with named LoRA adapters as tensors."""

    def __init__(self, model_path: str, device: str = "cpu", threads: int | None = None,
                 dtype: torch.dtype = torch.float32, adapter_budget_bytes: int | None = None) -> None:
        """Loads ``model_path`` (a safetensors folder); raises
        :class:`~opentinker.engine.model.UnsupportedArchitecture` for a family the engine does
        not run (the caller falls back to the PEFT registry). ``dtype``: of the base weights
        and activations (LoRA weights and optimizer states stay fp32). ``adapter_budget_bytes``:
        device memory for adapters and their optimizer states; beyond it the least recently
        used spill to host memory (:mod:`opentinker.engine.memory`)."""
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.model_path = model_path
        self.dtype = dtype
        self.decoder = Decoder.from_pretrained(model_path, dtype=dtype, device=self.device)
        self.decoder.eval()
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.pad_id = int(config.get("pad_token_id") if config.get("pad_token_id") is not None else 0)
        self.vocab_size = self.decoder.spec.vocab_size
        self.hidden_size = self.decoder.spec.hidden_size
        self.max_context = int(config.get("max_position_embeddings") or 2048)
        """Longest sequence (prompt + reply) the model was built for."""
        self.adapters: dict[str, AdapterState] = {}
        self._weights: dict[str, LoraWeights] = {}
        self.copies: dict[str, Decoder] = {}
        """Full-parameter policies: name -> its private copy of the decoder."""
        self.active: str | None = None
        self.base_fingerprint = adapter_io.fingerprint(self.decoder)
        """Identifies the base weights in saved adapters: the same value the PEFT registry
        computes for the same checkpoint (same tensor names), so adapters move between them."""
        self.lm_head: torch.nn.Module = _Head(self)
        """The active adapter's vocabulary projection (``h_R_H -> logits_R_V``)."""
        self.slots = LoraSlots(self.decoder.spec, torch.float32, self.device, budget=lambda: self.memory.budget_bytes)
        """Every resident LoRA adapter's matrices; its parameters are views into its slot."""
        self.memory = AdapterMemory(self.device, adapter_budget_bytes, pinned=lambda: self.pinned())
        self.memory._state_of = lambda n: self.adapters[n]
        self.memory.on_spill = self._unslot
        self.memory.on_restore = self._reslot
        self.pinned: Callable[[], set[str]] = set
        """Adapters that may not spill now (the engine sets it: those of its running rows)."""

    # ----------------------------------------------------------------------------- lifecycle

    def add(self, name: str, spec: LoraSpec, trainable: bool) -> AdapterState:
        """Register a new adapter ``name`` with PEFT's initialisation for ``spec.seed``;
        ``trainable=False`` gives it no optimizer."""
        self.check_new(name, spec)
        if spec.dropout:
            raise ValueError(f"LoraSpec.dropout {spec.dropout}: the engine runs LoRA without dropout "
                             "(use 0.0, or model.engine = 'peft')")
        if spec.full:
            # A private copy of every base weight (fp32 masters whatever the serving dtype).
            copy = self.decoder.copy(trainable=False)
            if copy.lm_head.weight.dtype != torch.float32:
                copy = copy.float()
            self.copies[name] = copy
            named = dict(copy.named_parameters())
        else:
            try:
                named = LoraWeights.new(spec, self.decoder.spec, dtype=torch.float32, device=self.device)
            except ValueError as e:
                raise ValueError(f"LoraSpec.target_modules {spec.target_modules}: {e}") from None
            if not named:
                raise ValueError(f"LoraSpec.target_modules {spec.target_modules} matched no module")
            self._weights[name] = weights = LoraWeights.from_named(named, spec, self.decoder.spec)
            self._put(weights)
        if spec.value_head:
            named.update(value_head.new_value_head(self.hidden_size, self.device))
        optimizer = torch.optim.AdamW(list(named.values()), lr=0.0) if trainable else None
        self.adapters[name] = state = AdapterState(spec=spec, named=named, optimizer=optimizer)
        try:
            self.memory.add(name, state)
        except OverBudget:
            self.drop_adapter(name)
            raise
        return state

    def drop_adapter(self, name: str) -> None:
        """Free ``name``'s weights, value head and optimizer state."""
        self.get(name)
        del self.adapters[name]
        weights = self._weights.pop(name, None)
        if weights is not None:
            self.slots.release(weights)
        self.copies.pop(name, None)
        self.memory.remove(name)
        if self.active == name:
            self.active = None

    def _unslot(self, name: str) -> None:
        """After ``name`` spilled to the host: its slot is free for others."""
        if name in self._weights:
            self.slots.release(self._weights[name])

    def _reslot(self, name: str) -> None:
        """After ``name`` came back from the host: into a slot again (tensors re-pointed)."""
        if name in self._weights:
            self._put(self._weights[name])

    def _put(self, weights: LoraWeights) -> None:
        """Into the slot store (its tensors become views of the slot, their own buffers freed).
        A CPU engine then hands the freed heap back: the adapter's temporaries and, when the
        store grew, its old buffer (up to the store's size) would otherwise stay resident in
        holes that later allocations of other sizes do not reuse."""
        self.slots.put(weights)
        if self.device.type == "cpu":
            trim_heap()

    def slot_of(self, name: str | None) -> int:
        """The store slot of a LoRA adapter (-1 for the bare base or a full-parameter policy):
        the engine orders a step's rows by it, so consecutive slots are read in place."""
        weights = self._weights.get(name) if name is not None else None
        return -1 if weights is None or weights.slot is None else weights.slot

    # ----------------------------------------------------------------------------- lookups

    def get(self, name: str) -> AdapterState:
        """The adapter ``name``, resident on the device (brought back if it had spilled)."""
        state = super().get(name)
        self.memory.use(name, state)
        return state

    def lora_weights(self, name: str) -> LoraWeights:
        """The adapter's LoRA tensors organised per (layer, module), sharing storage with its
        parameters."""
        self.get(name)
        return self._weights[name]

    def decoder_for(self, name: str | None) -> tuple[Decoder, Hashable, LoraWeights | None]:
        """``(decoder, model-copy key, LoRA weights or None)`` that compute for ``name``
        (``None``: the bare base): the shared base with the adapter's LoRA, or a
        full-parameter policy's private copy."""
        if name is None:
            return self.decoder, "base", None
        self.get(name)
        if name in self.copies:
            return self.copies[name], ("full", name), None
        return self.decoder, "base", self._weights[name]

    # ----------------------------------------------------------------------------- activation

    @contextlib.contextmanager
    def select(self, adapter: str | None) -> Iterator[None]:
        """Inside, :meth:`inner` computes with ``adapter`` (``None``: the bare base)."""
        if adapter is not None:
            self.get(adapter)
        before, self.active = self.active, adapter
        try:
            yield
        finally:
            self.active = before

    def hidden(self, input_ids_B_L: torch.Tensor, attention_mask_B_T: torch.Tensor | None = None,
               position_ids_B_L: torch.Tensor | None = None, cache: DenseCache | None = None,
               use_cache: bool = False) -> tuple[torch.Tensor, DenseCache | None]:
        """Final hidden states ``h_B_L_H`` of the active adapter's decoder (the base with its
        LoRA, or a full-parameter copy), called directly on a dense padded batch continuing
        ``cache``; and, with ``use_cache``, the cache of past + new keys and values. The
        trainer's and the log-probs' forward (:mod:`opentinker.engine.shared_forward`)."""
        B, L = input_ids_B_L.shape
        P = cache.length if cache is not None and len(cache) else 0
        if position_ids_B_L is None:
            position_ids_B_L = (P + torch.arange(L, device=input_ids_B_L.device))[None].expand(B, L)
        attn = DenseAttention(B, L, attention_mask_B_T, cache)
        decoder, _, weights = self.decoder_for(self.active)
        lora = None if weights is None else LoraBatch([weights], [B * L])
        h_N_H = decoder(input_ids_B_L.reshape(-1), position_ids_B_L.reshape(-1), attn, lora)
        return h_N_H.view(B, L, -1), attn.cache if use_cache else None

    def hidden_tree(self, ids_N: torch.Tensor, pos_N: torch.Tensor, attn: TreeAttention) -> torch.Tensor:
        """Final hidden states ``h_N_H`` of the active adapter's decoder on ``N`` flat tokens
        of a prefix tree (``attn`` places them: :func:`~opentinker.engine.shared_forward.token_tree`),
        the trainer's forward when sequences share prefixes at several depths."""
        decoder, _, weights = self.decoder_for(self.active)
        lora = None if weights is None else LoraBatch([weights], [ids_N.shape[0]])
        return decoder(ids_N, pos_N, attn, lora)

    # ----------------------------------------------------------------------------- files

    def write_peft_files(self, adapter: str, folder: Path) -> None:
        """PEFT's ``adapter_config.json`` and ``adapter_model.safetensors`` of ``adapter``."""
        from peft import LoraConfig
        from safetensors.torch import save_file

        state = self.get(adapter)
        spec = state.spec
        if spec.full:  # a full checkpoint transformers loads as it is
            shutil.copy(Path(self.model_path) / "config.json", folder / "config.json")
            weights, _ = value_head.split(state.named)
            save_file({k: p.detach().cpu().contiguous() for k, p in weights.items()},
                      str(folder / adapter_io.FULL_WEIGHTS))
            return
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                            target_modules=list(spec.target_modules), task_type="CAUSAL_LM",
                            base_model_name_or_path=self.model_path)
        config.save_pretrained(str(folder))
        lora, _ = value_head.split(state.named)
        save_file({k: p.detach().cpu().contiguous() for k, p in lora.items()}, str(folder / adapter_io.WEIGHTS))


class _Head(torch.nn.Module):
    """The vocabulary projection of the active adapter's decoder as a module
    (``h_R_H -> logits_R_V``): the base's, or a full-parameter policy's own."""

    def __init__(self, registry: LoraRegistry) -> None:
        super().__init__()
        self.registry = [registry]  # a list: not a submodule

    @property
    def weight(self) -> torch.Tensor:
        """``[V, H]``, as ``nn.Linear``'s."""
        reg = self.registry[0]
        return reg.decoder_for(reg.active)[0].lm_head.weight

    def forward(self, h_R_H: torch.Tensor) -> torch.Tensor:
        reg = self.registry[0]
        return reg.decoder_for(reg.active)[0].logits(h_R_H)
