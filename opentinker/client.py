"""A Python client of a scheduler in Tinker's shapes: a service client opens training clients
(a LoRA adapter or a full-parameter copy) and sampling clients on one base model.

    from opentinker.client import ServiceClient
    from protocols.messages import AdamParams, SamplingParams

    service = ServiceClient()                        # a scheduler in this process (tiny-random: model="tiny-random")
    policy = service.create_lora_training_client("main", rank=8)
    rows = policy.sample([prompt_tokens], SamplingParams(max_tokens=8, seed=1)).result()
    policy.forward_backward(datums, "importance_sampling").result()
    policy.optim_step(AdamParams(lr=1e-4)).result()
    sampler = policy.save_weights_for_sampler("main_v1")   # a frozen copy to sample from
    service.close()

Every remote call returns an :class:`APIFuture` at once (the request is on the wire; many can
be in flight, and a scheduler applies one adapter's operations in the order sent);
``.result()`` waits for the typed reply, or raises :class:`RequestFailed` naming the call and
the scheduler's reason. ``ServiceClient(address)`` talks to a scheduler a job started (its
endpoint; the job's bus secret is this process's) or to ``opentinker serve`` (its endpoint or
service file: the client opens a job there, as ``opentinker run --scheduler`` does). One
client per thread (a ZeroMQ socket is not thread-safe). See ``docs/client.md``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from opentinker.bus.common import RemoteError
from opentinker.bus.sync import SyncClient
from protocols.messages import (
    AdamParams,
    AdapterInfo,
    CreateAdapter,
    Datum,
    DropAdapter,
    ForwardBackward,
    ForwardBackwardResult,
    LoadAdapter,
    LogprobsRequest,
    LogprobsResult,
    LoraSpec,
    Message,
    OptimStep,
    OptimStepResult,
    SampleRequest,
    SampleResult,
    SamplingParams,
    SaveAdapter,
    Saved,
    SnapshotAdapter,
)

T = TypeVar("T")


class RequestFailed(RuntimeError):
    """A remote call the scheduler refused or could not do; ``str(e)`` names the call."""


class APIFuture(Generic[T]):
    """The reply to one request in flight; :meth:`result` waits for it (once; then cached)."""

    def __init__(self, client: SyncClient, rid: int, what: str, convert: Callable[[Message], T]) -> None:
        self._client, self._rid, self._what, self._convert = client, rid, what, convert
        self._done = False
        self._value: Any = None

    def result(self, timeout: float = 600.0) -> T:
        """The typed reply; :class:`RequestFailed` naming the call if the scheduler refused it."""
        if not self._done:
            try:
                reply = self._client.result(self._rid, timeout)
            except RemoteError as e:
                raise RequestFailed(f"{self._what}: {e}") from None
            self._value, self._done = self._convert(reply), True
        return self._value


class ServiceClient:
    """A connection to one scheduler (see the module doc).

    Args:
        address: a scheduler's bus endpoint, or an ``opentinker serve`` endpoint or service
            file; ``""``: start a scheduler in this process on ``model``.
        model: the base model of a scheduler started here (a model spec, e.g.
            ``smollm2-135m`` or ``tiny-random``); on ``opentinker serve``, the model the job
            expects (refused if the service serves another).
        device, threads: of a scheduler started here.
        job: the job's name on ``opentinker serve``.
    """

    def __init__(self, address: str = "", *, model: str = "smollm2-135m", device: str = "cpu",
                 threads: int | None = None, job: str = "client") -> None:
        from opentinker.engine.model_specs import resolve_model

        self.model_path = resolve_model(model)
        self._scheduler: Any = None
        self._attachment: Any = None
        credentials = None
        if not address:
            from opentinker.engine.service import SchedulerService

            self._scheduler = SchedulerService(self.model_path, device=device, threads=threads)
            address = self._scheduler.start()
        elif not address.startswith(("tcp://", "ipc://")) or _is_service(address):
            from opentinker.control.attach import attach

            self._folder = tempfile.TemporaryDirectory(prefix="opentinker-client-")
            self._attachment = attach(address, job, self.model_path, [self._folder.name], [])
            address, credentials = self._attachment.endpoint, self._attachment.credentials
        self.endpoint = address
        self._client = SyncClient(address, "client", credentials=credentials)

    def _call(self, msg: Message, what: str, convert: Callable[[Message], T]) -> APIFuture[T]:
        return APIFuture(self._client, self._client.submit(msg), what, convert)

    def create_lora_training_client(self, name: str, rank: int = 8, alpha: float = 16.0,
                                    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                                    seed: int = 0) -> TrainingClient:
        """A new LoRA adapter ``name`` on the base model (B = 0: it starts as the base)."""
        spec = LoraSpec(rank=rank, alpha=alpha, target_modules=tuple(target_modules), seed=seed)
        self._call(CreateAdapter(name=name, spec=spec), f"create adapter {name!r}", _check(AdapterInfo)).result()
        return TrainingClient(self, name)

    def create_full_training_client(self, name: str, seed: int = 0) -> TrainingClient:
        """A new full-parameter policy ``name``: a private copy of every base weight."""
        spec = LoraSpec(full=True, seed=seed)
        self._call(CreateAdapter(name=name, spec=spec), f"create policy {name!r}", _check(AdapterInfo)).result()
        return TrainingClient(self, name)

    def create_training_client_from_state(self, path: str, name: str) -> TrainingClient:
        """A training client on the adapter saved at ``path`` (weights, optimizer state, version)."""
        self._call(LoadAdapter(path=path, name=name), f"load {path!r} as {name!r}", _check(AdapterInfo)).result()
        return TrainingClient(self, name)

    def create_sampling_client(self, adapter: str | None = None) -> SamplingClient:
        """A sampling client of ``adapter`` (``None``: the bare base model)."""
        return SamplingClient(self, adapter)

    def close(self) -> None:
        """Close the connection, the job on ``opentinker serve`` (its adapters freed) and a
        scheduler started here."""
        self._client.close()
        if self._attachment is not None:
            self._attachment.close()
            self._folder.cleanup()
        if self._scheduler is not None:
            self._scheduler.stop()

    def __enter__(self) -> ServiceClient:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SamplingClient:
    """Samples and scores with one adapter (or the base model) of a :class:`ServiceClient`."""

    def __init__(self, service: ServiceClient, adapter: str | None) -> None:
        self.service, self.adapter = service, adapter

    def sample(self, prompts: Sequence[np.ndarray | Sequence[int]], params: SamplingParams,
               num_samples: int = 1) -> APIFuture[SampleResult]:
        """``num_samples`` replies to each prompt (``int32[T]`` token ids), in one batch:
        ``SampleResult`` with, per row (prompt-major), the tokens, their log-probs at the
        sampling temperature and the stop reason."""
        rows = [np.asarray(p, dtype=np.int32) for p in prompts for _ in range(num_samples)]
        return self.service._call(SampleRequest(adapter=self.adapter, prompts=rows, params=params, client="client"),
                                  f"sample from {self.adapter or 'the base model'}", _check(SampleResult))

    def compute_logprobs(self, sequences: Sequence[np.ndarray | Sequence[int]],
                         temperature: float = 1.0) -> APIFuture[list[np.ndarray]]:
        """Per sequence, ``float32[T]``: the log-prob of each token given those before it
        (entry 0 is 0)."""
        seqs = [np.asarray(s, dtype=np.int32) for s in sequences]
        return self.service._call(LogprobsRequest(adapter=self.adapter, sequences=seqs, temperature=temperature),
                                  f"log-probs under {self.adapter or 'the base model'}",
                                  lambda m: list(_check(LogprobsResult)(m).logprobs))


class TrainingClient(SamplingClient):
    """Trains one adapter (or full-parameter policy) of a :class:`ServiceClient`, and samples
    from it as it is now."""

    def __init__(self, service: ServiceClient, name: str) -> None:
        super().__init__(service, name)
        self.name = name

    def forward_backward(self, datums: Sequence[Datum], loss: str, loss_config: dict[str, float] | None = None,
                         normalizer: float | None = None) -> APIFuture[ForwardBackwardResult]:
        """Accumulate the gradient of ``sum(loss) / normalizer`` over ``datums`` (a loss of
        ``learners.LOSSES``; ``normalizer``: by default the number of loss tokens, the datums'
        ``mask`` summed)."""
        norm = normalizer if normalizer is not None else float(max(sum(float(np.sum(d.loss_inputs["mask"]))
                                                                        for d in datums), 1.0))
        msg = ForwardBackward(adapter=self.name, datums=list(datums), loss=loss, loss_config=dict(loss_config or {}),
                              normalizer=norm)
        return self.service._call(msg, f"forward_backward on {self.name!r}", _check(ForwardBackwardResult))

    def optim_step(self, params: AdamParams) -> APIFuture[OptimStepResult]:
        """One AdamW step on the accumulated gradient; the adapter's version goes up by one."""
        return self.service._call(OptimStep(adapter=self.name, params=params), f"optim_step on {self.name!r}",
                                  _check(OptimStepResult))

    def save_state(self, path: str) -> APIFuture[Saved]:
        """Save the weights, optimizer state and version in PEFT format under ``path``."""
        return self.service._call(SaveAdapter(adapter=self.name, path=path), f"save {self.name!r} to {path!r}",
                                  _check(Saved))

    def load_state(self, path: str) -> APIFuture[AdapterInfo]:
        """Replace this adapter by the one saved at ``path``."""
        self.service._call(DropAdapter(name=self.name), f"drop {self.name!r}", lambda m: m).result()
        return self.service._call(LoadAdapter(path=path, name=self.name), f"load {path!r} into {self.name!r}",
                                  _check(AdapterInfo))

    def save_weights_for_sampler(self, name: str) -> SamplingClient:
        """A frozen copy of the weights as they are now, named ``name``, and a sampling client
        of it (training on goes on without moving it)."""
        self.service._call(SnapshotAdapter(adapter=self.name, name=name), f"snapshot {self.name!r} as {name!r}",
                           _check(AdapterInfo)).result()
        return SamplingClient(self.service, name)


def _check(kind: type[T]) -> Callable[[Message], T]:
    def convert(msg: Message) -> T:
        if not isinstance(msg, kind):
            raise RequestFailed(f"expected {kind.__name__}, the scheduler sent {type(msg).__name__}")
        return msg

    return convert


def _is_service(address: str) -> bool:
    """Whether ``address`` is an ``opentinker serve`` service (a file, or a known endpoint)."""
    from opentinker.control.attach import find_service

    try:
        find_service(address)
    except Exception:  # noqa: BLE001  (not a service: a plain scheduler endpoint)
        return False
    return True
