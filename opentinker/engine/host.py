"""One resident base model and every LoRA adapter on it, with each adapter's optimizer: the
scheduler's primitives behind one object.

:class:`ModelHost` composes the engine's four roles and runs them synchronously (the
scheduler calls it from its single compute thread):

* the adapter registry (:mod:`opentinker.engine.registry`): the base model, create, drop,
  snapshot, versions;
* the model runner (:mod:`opentinker.engine.runner`): mixed-adapter sampling, teacher-forced
  log-probs, critic values;
* the trainer (:mod:`opentinker.engine.trainer`): ``forward_backward`` with a loss from
  ``learners``, AdamW ``optim_step``;
* adapter files (:mod:`opentinker.engine.adapter_io`): save and load, PEFT format plus
  optimizer state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from opentinker.engine import adapter_io
from opentinker.engine.peft_sampler import SampledRow
from opentinker.engine.registry import BASE, AdapterRegistry, AdapterState, UnknownAdapterError
from opentinker.engine.runner import ModelRunner
from opentinker.engine.trainer import Trainer
from protocols.messages import AdamParams, Datum, LoraSpec, SamplingParams

__all__ = ["BASE", "AdapterState", "ModelHost", "UnknownAdapterError"]


class ModelHost:
    """A base model resident on one device, with named LoRA adapters."""

    def __init__(self, model_path: str, device: str = "cpu", threads: int | None = None) -> None:
        self.registry = AdapterRegistry(model_path, device=device, threads=threads)
        self.runner = ModelRunner(self.registry)
        self.trainer = Trainer(self.registry, self.runner)
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
        return self.registry.model

    @property
    def base_fingerprint(self) -> str:
        return self.registry.base_fingerprint

    @property
    def share_prefix(self) -> bool:
        """Run shared prefixes and duplicate sequences once in log-prob computations (exact)."""
        return self.runner.share_prefix

    @share_prefix.setter
    def share_prefix(self, value: bool) -> None:
        self.runner.share_prefix = value

    def _select(self, adapter: str | None):
        return self.registry.select(adapter)

    # Adapters.
    def create_adapter(self, name: str, spec: LoraSpec) -> int:
        return self.registry.create_adapter(name, spec)

    def drop_adapter(self, name: str) -> None:
        self.registry.drop_adapter(name)

    def snapshot(self, src: str, new_name: str) -> int:
        return self.registry.snapshot(src, new_name)

    def version(self, name: str | None) -> int:
        return self.registry.version(name)

    # Compute.
    def sample(self, adapters: Sequence[str | None], prompts: Sequence[np.ndarray],
               params: Sequence[SamplingParams], seeds: Sequence[int]) -> list[SampledRow]:
        return self.runner.sample(adapters, prompts, params, seeds)

    def logprobs(self, adapter: str | None, seqs: Sequence[np.ndarray], chunk: int = 64) -> list[np.ndarray]:
        return self.runner.logprobs(adapter, seqs, chunk)

    def values(self, adapter: str, seqs: Sequence[np.ndarray], chunk: int = 64) -> list[np.ndarray]:
        return self.runner.values(adapter, seqs, chunk)

    def forward_backward(self, adapter: str, datums: Sequence[Datum], loss: str, loss_config: Mapping[str, float],
                         normalizer: float, chunk: int = 64, value_normalizer: float = 0.0,
                         ) -> tuple[float, dict[str, float]]:
        return self.trainer.forward_backward(adapter, datums, loss, loss_config, normalizer, chunk,
                                             value_normalizer)

    def optim_step(self, adapter: str, hp: AdamParams) -> tuple[int, float]:
        return self.trainer.optim_step(adapter, hp)

    # Files.
    def save(self, adapter: str, path: str) -> int:
        return adapter_io.save(self.registry, adapter, path)

    def load(self, path: str, name: str, trainable: bool = True) -> int:
        return adapter_io.load(self.registry, path, name, trainable)
