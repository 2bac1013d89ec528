"""Env runner: hosts PettingZoo games, drives their turns, renders observations to tokens,
asks the scheduler for replies, and routes each trainable seat's trajectory to its learner.

Every episode of a :class:`RunEpisodes` request runs as its own asyncio task, so the
decisions of many episodes are in flight at once and the scheduler batches them. Nothing
here imports torch: the runner is text, tokens and sockets.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import numpy as np

import games
from opentinker.bus import LOOPBACK, Client, LoopThread, Pusher, Server
from opentinker.episodes import play_episode
from opentinker.render import ChatTokenizer
from protocols.messages import (
    EpisodesDone,
    Message,
    PolicyKind,
    PolicyRef,
    RunEpisodes,
    SampleRequest,
    SampleResult,
    SamplingParams,
)

log = logging.getLogger(__name__)


class EnvRunner:
    """Serves :class:`RunEpisodes` on the bus."""

    def __init__(
        self, name: str, scheduler_endpoint: str, model_path: str, endpoint: str = LOOPBACK,
        sample_timeout_s: float = 900.0,
    ) -> None:
        self.name = name
        self.scheduler_endpoint = scheduler_endpoint
        self.model_path = model_path
        self.sample_timeout_s = sample_timeout_s
        self._bind = endpoint
        self._seq = 0
        self.endpoint = ""

    def start(self) -> str:
        self.tok = ChatTokenizer(self.model_path)
        self.loop = LoopThread(f"{self.name}-bus")
        self.server = Server(self._handle, self._bind, name=self.name)
        self.endpoint = self.loop.run(self._start())
        return self.endpoint

    async def _start(self) -> str:
        self.scheduler = Client(self.loop.ctx, self.scheduler_endpoint, name=self.name)
        self.pushers: dict[str, Pusher] = {}
        return await self.server.start(self.loop.ctx)

    def counters(self) -> dict[str, int]:
        """Bus counters of this runner: requests served, samples asked, trajectories pushed."""
        out = dict(self.server.counters)
        out.update({f"client/{k}": v for k, v in self.scheduler.counters.items()})
        out["pushed/Trajectory"] = sum(p.sent for p in self.pushers.values())
        return out

    async def _handle(self, msg: Message) -> Message:
        if not isinstance(msg, RunEpisodes):
            raise ValueError(f"an env runner does not serve {type(msg).__name__}")
        for spec in msg.episodes:
            if spec.game not in games.names():
                raise ValueError(f"unknown game {spec.game!r}; known: {games.names()}")
        for name, ep in msg.learners.items():
            if name not in self.pushers:
                self.pushers[name] = Pusher(self.loop.ctx, ep)
        results = await asyncio.gather(*(play_episode(spec, msg, self.tok, self._sample) for spec in msg.episodes))
        sent = 0
        for _, trajectories in results:
            for traj in trajectories:
                self._seq += 1
                await self.pushers[traj.policy].send(msgspec.structs.replace(traj, seq=self._seq))
                sent += 1
        return EpisodesDone(summaries=[s for s, _ in results], trajectories_sent=sent)

    async def _sample(self, ref: PolicyRef, prompt: np.ndarray, params: SamplingParams) -> SampleResult:
        adapter = ref.name if ref.kind is PolicyKind.ADAPTER else None
        req = SampleRequest(adapter=adapter, prompts=[prompt], params=params, client=self.name)
        reply = await self.scheduler.request(req, timeout=self.sample_timeout_s)
        assert isinstance(reply, SampleResult)
        return reply

    def stop(self) -> None:
        if hasattr(self, "loop"):
            self.loop.run(self.server.stop())
            self.scheduler.close()
            for p in self.pushers.values():
                p.close()
            self.loop.stop()

