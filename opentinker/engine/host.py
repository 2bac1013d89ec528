"""One resident base model and every LoRA adapter on it, with each adapter's optimizer: the
scheduler's primitives behind one object.

:class:`ModelHost` composes the engine's four roles and runs them synchronously (the
scheduler calls it from its single compute thread):

* the adapter registry (:mod:`opentinker.engine.registry`): the base model, create, drop,
  snapshot, versions;
* the inference API (:mod:`opentinker.engine.inference`): mixed-adapter sampling, teacher-forced
  log-probs, critic values;
* the trainer (:mod:`opentinker.engine.trainer`): ``forward_backward`` with a loss from
  ``learners``, AdamW ``optim_step``;
* adapter files (:mod:`opentinker.engine.adapter_io`): save and load, PEFT format plus
  optimizer state.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence

import numpy as np
import torch

from opentinker.engine import adapter_io
from opentinker.engine.lora_registry import LoraRegistry
from opentinker.engine.model import UnsupportedArchitecture
from opentinker.engine.peft_sampler import SampledRow
from opentinker.engine.registry import (
    BASE,
    AdapterRegistry,
    AdapterState,
    UnknownAdapterError,
)
from opentinker.engine.inference import Inference
from opentinker.engine.step_loop import Engine
from opentinker.engine.trainer import DEFAULT_TRAIN_MEMORY_BYTES, Trainer, drain
from protocols.messages import AdamParams, Datum, LoraSpec, SamplingParams

__all__ = ["BASE", "AdapterState", "ModelHost", "UnknownAdapterError"]


class ModelHost:
    """A base model resident on one device, with named LoRA adapters."""

    def __init__(self, model_path: str, device: str = "cpu", threads: int | None = None,
                 engine: str = "auto", engine_options: Mapping[str, object] | None = None) -> None:
        """``engine``: ``"auto"`` runs the engine's own forward (continuous batching, prefix
        cache, batched LoRA) for the families it supports and PEFT for the rest; ``"own"``
        insists on it (``UnsupportedArchitecture`` otherwise); ``"peft"`` is the PEFT path
        (whole-request batches, no prefix reuse). ``engine_options`` go to
        :class:`~opentinker.engine.step_loop.Engine` (``kv_budget_bytes``, ``block_size``,
        ``max_batch_tokens``, ``max_rows``, ``lora_method``, ``cuda_graphs``), plus ``dtype`` (``"float32"`` or
        ``"bfloat16"``: base weights and activations; LoRA weights and optimizer states stay
        fp32), ``device_budget_bytes`` (weights + KV + adapters with optimizer states;
        adapters beyond it spill to host memory) and ``train_memory_bytes`` (what one part of a
        ``forward_backward`` may hold in activations: :class:`~opentinker.engine.trainer.Trainer`;
        on every engine)."""
        if engine not in ("auto", "own", "peft"):
            raise ValueError(f"engine must be 'auto', 'own' or 'peft', got {engine!r}")
        self.engine: Engine | None = None
        self.registry: AdapterRegistry | LoraRegistry
        options = dict(engine_options or {})
        train_memory = int(options.pop("train_memory_bytes", DEFAULT_TRAIN_MEMORY_BYTES))
        if engine != "peft":
            dtype = _DTYPES[str(options.pop("dtype", "float32"))]
            budget = options.pop("device_budget_bytes", None)
            try:
                self.registry = LoraRegistry(model_path, device=device, threads=threads, dtype=dtype)
                self.engine = Engine(self.registry, **options)
                if budget:
                    self.registry.memory.budget_bytes = _adapter_budget(int(budget), self.registry, self.engine)
            except UnsupportedArchitecture:
                if engine == "own":
                    raise
        if self.engine is None:
            self.registry = AdapterRegistry(model_path, device=device, threads=threads)
        self.inference = Inference(self.registry, self.engine)
        self.trainer = Trainer(self.registry, self.inference, train_memory)
        self.device = self.registry.device
        self.model_path = model_path

    # The registry's state, for callers that inspect it.
    @property
    def adapters(self) -> dict[str, AdapterState]:
        return self.registry.adapters

    @property
    def base(self):
        return self.registry.base

    @property
    def model(self):
        """The PEFT model (PEFT path only)."""
        return self.registry.model

    @property
    def base_fingerprint(self) -> str:
        return self.registry.base_fingerprint

    @property
    def share_prefix(self) -> bool:
        """Run shared prefixes and duplicate sequences once in log-prob computations (exact)."""
        return self.inference.share_prefix

    @share_prefix.setter
    def share_prefix(self, value: bool) -> None:
        self.inference.share_prefix = value

    def _select(self, adapter: str | None):
        return self.registry.select(adapter)

    # Adapters.
    def create_adapter(self, name: str, spec: LoraSpec) -> int:
        return self.registry.create_adapter(name, spec)

    def drop_adapter(self, name: str) -> None:
        self.registry.drop_adapter(name)
        if self.engine is not None:
            self.engine.retire(name)

    def snapshot(self, src: str, new_name: str) -> int:
        return self.registry.snapshot(src, new_name)

    def version(self, name: str | None) -> int:
        return self.registry.version(name)

    # Compute.
    def sample(self, adapters: Sequence[str | None], prompts: Sequence[np.ndarray],
               params: Sequence[SamplingParams], seeds: Sequence[int],
               forced: Sequence[np.ndarray | None] | None = None) -> list[SampledRow]:
        return self.inference.sample(adapters, prompts, params, seeds, forced)

    def logprobs(self, adapter: str | None, seqs: Sequence[np.ndarray], chunk: int = 64,
                 temperature: float = 1.0, tail: int = 0) -> list[np.ndarray]:
        return self.inference.logprobs(adapter, seqs, chunk, temperature, tail)

    def values(self, adapter: str, seqs: Sequence[np.ndarray], chunk: int = 64) -> list[np.ndarray]:
        return self.inference.values(adapter, seqs, chunk)

    def forward_backward(self, adapter: str, datums: Sequence[Datum], loss: str, loss_config: Mapping[str, float],
                         normalizer: float, chunk: int = 64, value_normalizer: float = 0.0, max_tokens: int = 0,
                         ) -> tuple[float, dict[str, float]]:
        return drain(self.trainer.forward_backward_parts(adapter, datums, loss, loss_config, normalizer, chunk,
                                                         value_normalizer, max_tokens))

    def forward_backward_parts(self, adapter: str, datums: Sequence[Datum], loss: str,
                               loss_config: Mapping[str, float], normalizer: float, value_normalizer: float = 0.0,
                               max_tokens: int = 0) -> Generator[None, None, tuple[float, dict[str, float]]]:
        """:meth:`~opentinker.engine.trainer.Trainer.forward_backward_parts`: a part at a time."""
        return self.trainer.forward_backward_parts(adapter, datums, loss, loss_config, normalizer,
                                                   value_normalizer=value_normalizer, max_tokens=max_tokens)

    def discard_gradients(self, adapter: str) -> int:
        return self.trainer.discard_gradients(adapter)

    def optim_step(self, adapter: str, hp: AdamParams) -> tuple[int, float]:
        out = self.trainer.optim_step(adapter, hp)
        if self.engine is not None:  # its cached prefixes belong to the old weights
            self.engine.retire(adapter)
            self.registry.memory.resize(adapter, self.registry.adapters[adapter])  # AdamW moments now exist
        return out

    # Files.
    def save(self, adapter: str, path: str) -> int:
        return adapter_io.save(self.registry, adapter, path)

    def load(self, path: str, name: str, trainable: bool = True, fresh: bool = False) -> int:
        return adapter_io.load(self.registry, path, name, trainable, fresh)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _adapter_budget(device_budget: int, registry: LoraRegistry, engine: Engine) -> int:
    """What a device budget leaves for adapters once the base weights and the KV pool are in."""
    weights = sum(p.numel() * p.element_size() for p in registry.decoder.parameters())
    left = device_budget - weights - engine.pool.nbytes
    if left <= 0:
        raise ValueError(f"device budget of {device_budget} bytes holds neither the base weights "
                         f"({weights} bytes) and the KV blocks ({engine.pool.nbytes} bytes) with room "
                         "for one adapter: raise it, or lower the KV budget")
    return left
