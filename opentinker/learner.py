"""Learner: one per trainable policy. Receives that policy's trajectories on its own PULL
socket, and on a :class:`LearnerStep` turns the step's trajectories into datums (in
episode-id order, never arrival order) with the configured advantage estimator, and asks the
scheduler for ``forward_backward`` and ``optim_step``. The algorithm itself lives in
``learners`` as pure functions; this actor owns the I/O.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Mapping

from learners import ADVANTAGES, LOSSES, assemble, loss_token_count
from opentinker.bus import LOOPBACK, Client, LoopThread, Puller, Server
from protocols.messages import (
    AdamParams,
    ForwardBackward,
    ForwardBackwardResult,
    LearnerStep,
    LearnerStepResult,
    Message,
    OptimStep,
    OptimStepResult,
    Trajectory,
)

log = logging.getLogger(__name__)


def check_algorithms(advantage: str, loss: str) -> None:
    """Raise ``ValueError`` naming an advantage estimator or policy loss this learner lacks."""
    if advantage not in ADVANTAGES:
        raise ValueError(f"train.advantage {advantage!r} is not a group estimator; known: {sorted(ADVANTAGES)}")
    if loss not in LOSSES:
        raise ValueError(f"train.loss {loss!r} is not a policy-gradient loss; known: {sorted(LOSSES)}")


class Learner:
    """Trains adapter ``policy`` on the scheduler."""

    def __init__(
        self,
        policy: str,
        scheduler_endpoint: str,
        advantage: str,
        loss: str,
        loss_config: Mapping[str, float],
        adam: AdamParams,
        advantage_config: Mapping[str, float] | None = None,
        endpoint: str = LOOPBACK,
    ) -> None:
        check_algorithms(advantage, loss)
        self.policy = policy
        self.scheduler_endpoint = scheduler_endpoint
        self.advantage = advantage
        self.advantage_config = dict(advantage_config or {})
        self.loss = loss
        self.loss_config = dict(loss_config)
        self.adam = adam
        self._bind = endpoint
        self._by_step: dict[int, dict[tuple[int, str], Trajectory]] = collections.defaultdict(dict)
        self.duplicates = 0
        self.endpoint = self.pull_endpoint = ""

    def start(self) -> tuple[str, str]:
        """Returns ``(request endpoint, trajectory PULL endpoint)``."""
        self.loop = LoopThread(f"learner-{self.policy}-bus")
        self.endpoint, self.pull_endpoint = self.loop.run(self._start())
        return self.endpoint, self.pull_endpoint

    async def _start(self) -> tuple[str, str]:
        self._arrived = asyncio.Condition()
        self.scheduler = Client(self.loop.ctx, self.scheduler_endpoint, name=f"learner-{self.policy}")
        self.puller = Puller(self.loop.ctx)
        self.server = Server(self._handle, self._bind, name=f"learner-{self.policy}")
        self._recv_task = asyncio.create_task(self._receive())
        return await self.server.start(self.loop.ctx), self.puller.endpoint

    def counters(self) -> dict[str, int]:
        out = dict(self.server.counters)
        out.update({f"pull/{k}": v for k, v in self.puller.counters.items()})
        out.update({f"client/{k}": v for k, v in self.scheduler.counters.items()})
        return out

    async def _receive(self) -> None:
        while True:
            msg = await self.puller.recv()
            if not isinstance(msg, Trajectory) or msg.policy != self.policy:
                log.warning("learner %s: dropped %s", self.policy, type(msg).__name__)
                continue
            key = (msg.episode_id, msg.seat)
            async with self._arrived:
                if key in self._by_step[msg.step]:
                    self.duplicates += 1  # a re-sent trajectory is counted once
                self._by_step[msg.step][key] = msg
                self._arrived.notify_all()

    async def _handle(self, msg: Message) -> Message:
        if not isinstance(msg, LearnerStep):
            raise ValueError(f"a learner does not serve {type(msg).__name__}")
        async with self._arrived:
            try:
                await asyncio.wait_for(
                    self._arrived.wait_for(lambda: len(self._by_step[msg.step]) >= msg.expected),
                    msg.timeout_s,
                )
            except asyncio.TimeoutError:
                got = len(self._by_step[msg.step])
                raise TimeoutError(
                    f"learner {self.policy}: step {msg.step} has {got} of {msg.expected} trajectories"
                ) from None
            trajectories = list(self._by_step.pop(msg.step).values())
        datums, metrics = assemble(trajectories, self.advantage, self.advantage_config)
        n_tokens = loss_token_count(datums)
        fb = await self.scheduler.request(
            ForwardBackward(
                adapter=self.policy, datums=datums, loss=self.loss, loss_config=self.loss_config,
                normalizer=float(max(n_tokens, 1)),
            )
        )
        assert isinstance(fb, ForwardBackwardResult)
        opt = await self.scheduler.request(OptimStep(adapter=self.policy, params=self.adam))
        assert isinstance(opt, OptimStepResult)
        metrics.update({f"loss/{k}": v for k, v in fb.metrics.items()})
        metrics["loss"] = fb.loss
        metrics["grad_norm"] = opt.grad_norm
        invalid = sum(t.parse.value == "invalid" for tr in trajectories for t in tr.turns)
        turns = sum(len(tr.turns) for tr in trajectories)
        metrics["invalid_rate"] = invalid / max(turns, 1)
        metrics["turns"] = float(turns)
        return LearnerStepResult(step=msg.step, version=opt.version, metrics=metrics)

    def stop(self) -> None:
        if hasattr(self, "loop"):
            self.loop.run(self.server.stop())
            self.puller.close()
            self.scheduler.close()
            self.loop.stop()
