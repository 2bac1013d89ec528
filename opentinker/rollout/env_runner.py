"""Env runner: hosts PettingZoo games, drives their turns, renders observations to tokens,
asks the scheduler for replies, and routes each trainable seat's trajectory to its learner.

Every episode of a :class:`RunEpisodes` request runs as its own asyncio task, so the
decisions of many episodes are in flight at once and the scheduler batches them. Nothing
here imports torch: the runner is text, tokens and sockets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import numpy as np

import games
from opentinker.bus import LOOPBACK, Client, LoopThread, Pusher, Server
from opentinker.bus.auth import Credentials
from opentinker.rollout.episodes import play_episode
from opentinker.rollout.render import ChatTokenizer
from opentinker.rollout.routes import Routes
from protocols.messages import (
    EpisodesDone,
    EpisodeSpec,
    EpisodeSummary,
    Message,
    Metrics,
    PolicyKind,
    PolicyRef,
    ResendTrajectories,
    Resent,
    RunEpisodes,
    SampleRequest,
    SampleResult,
    SamplingParams,
    Trajectory,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


MAX_EPISODES_IN_FLIGHT = 256
"""Default :attr:`EnvRunner.max_episodes`; the runtime gives each runner its share of
:data:`SCHEDULER_EPISODES` instead."""
SCHEDULER_EPISODES = 512
"""Episodes all runners of a job play at once: half the scheduler's bound on requests in
flight (``Server.max_inflight``, 1,024), leaving room for learners and the coordinator."""


def runner_share(runners: int) -> int:
    """Episodes each of a job's ``runners`` env runners plays at once (its
    :attr:`EnvRunner.max_episodes`, and the coordinator's wave of an evaluation): its share of
    :data:`SCHEDULER_EPISODES`, at least 1."""
    return max(1, SCHEDULER_EPISODES // runners)


class EnvRunner:
    """Serves :class:`RunEpisodes` on the bus."""

    def __init__(
        self, name: str, scheduler_endpoint: str, model_path: str, endpoint: str = LOOPBACK,
        sample_timeout_s: float = 900.0, games: tuple[str, ...] = (), max_episodes: int = MAX_EPISODES_IN_FLIGHT,
        scheduler_auth: tuple[str, str] | None = None, routes: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.scheduler_auth = Credentials.of(scheduler_auth)
        """What it presents to the scheduler (a job's credentials on a shared scheduler)."""
        self.max_episodes = max_episodes
        """Episodes played at once (each has at most one request at the scheduler): a batch
        larger than the scheduler's bound on requests in flight is played in waves instead of
        being refused ``busy``."""
        self.games = frozenset(games)
        """Games beside the registered ones that episodes may name (the job's imported
        PettingZoo env): a message never makes a runner import a module it was not given."""
        self.scheduler_endpoint = scheduler_endpoint
        self.routes = Routes(scheduler_endpoint, routes)
        """Policy -> its scheduler's endpoint, in a job with several (``runtime.devices``): a
        request naming an adapter goes to its policy's scheduler, others to
        ``scheduler_endpoint``."""
        self.model_path = model_path
        self.sample_timeout_s = sample_timeout_s
        self._bind = endpoint
        self._seq = 0
        self._pushed = 0
        self._resent = 0
        self._batch_done: dict[int, int] = {}
        """Batch id -> its episodes this runner has ended (:meth:`_progress`)."""
        self._outbox: dict[int, dict[tuple[int, str], Trajectory]] = {}
        """Step -> (episode_id, seat) -> the trajectory pushed, kept until a later training
        step starts, for :class:`ResendTrajectories`."""
        self.endpoint = ""

    def start(self) -> str:
        self.tok = ChatTokenizer(self.model_path)
        self.loop = LoopThread(f"{self.name}-bus")
        self.server = Server(self._handle, self._bind, name=self.name)
        self.endpoint = self.loop.run(self._start())
        return self.endpoint

    async def _start(self) -> str:
        self.schedulers = {ep: Client(self.loop.ctx, ep, name=self.name, credentials=self.scheduler_auth)
                           for ep in self.routes.endpoints()}
        self.pushers: dict[str, Pusher] = {}
        self._pushing_to: dict[str, str] = {}
        """Policy -> the learner PULL endpoint its pusher sends to."""
        self._slots = asyncio.Semaphore(self.max_episodes)
        return await self.server.start(self.loop.ctx)

    def counters(self) -> dict[str, int]:
        """Bus counters of this runner: requests served, samples asked, trajectories pushed."""
        out = dict(self.server.counters)
        for client in self.schedulers.values():  # summed over the job's schedulers
            for k, v in client.counters.items():
                out[f"client/{k}"] = out.get(f"client/{k}", 0) + v
        out["pushed/Trajectory"] = self._pushed
        out["resent/Trajectory"] = self._resent
        return out

    async def _handle(self, msg: Message) -> Message:
        if isinstance(msg, ResendTrajectories):
            return await self._resend(msg)
        if not isinstance(msg, RunEpisodes):
            raise ValueError(f"an env runner does not serve {type(msg).__name__}")
        if msg.learners:  # a training step: the trajectories of earlier ones were all delivered
            for old in [s for s in self._outbox if s < msg.step]:
                del self._outbox[old]
        for spec in msg.episodes:
            if spec.game not in self.games and spec.game not in games.names():
                raise ValueError(f"unknown game {spec.game!r}; known: {[*games.names(), *sorted(self.games)]}")
        for name, ep in msg.learners.items():
            if name in self.pushers and self._pushing_to.get(name) != ep:  # its learner was started again
                self.pushers.pop(name).close()
            if name not in self.pushers:
                self.pushers[name], self._pushing_to[name] = Pusher(self.loop.ctx, ep), ep
        progress = self._progress(msg)

        async def bounded(spec: EpisodeSpec) -> tuple[EpisodeSummary, list[Trajectory]]:
            async with self._slots:  # one bound over every request (a large batch comes in slices)
                return await play_episode(spec, msg, self.tok, self._sample, self._score)

        results = await asyncio.gather(*(progress(bounded(spec)) for spec in msg.episodes))
        sent = 0
        outbox = self._outbox.setdefault(msg.step, {})
        for _, trajectories in results:
            for traj in trajectories:
                self._seq += 1
                traj = msgspec.structs.replace(traj, seq=self._seq)
                outbox[(traj.episode_id, traj.seat)] = traj  # until acknowledged (a later step starts)
                await self.pushers[traj.policy].send(traj)
                self._pushed += 1
                sent += 1
        return EpisodesDone(summaries=[s for s, _ in results], trajectories_sent=sent)

    async def _resend(self, msg: ResendTrajectories) -> Resent:
        """Push the trajectories ``msg`` names again, from this runner's outbox."""
        outbox = self._outbox.get(msg.step, {})
        count, missing = 0, []
        for key in msg.keys:
            traj = outbox.get((key[0], key[1]))
            if traj is None:
                missing.append(key)
                continue
            await self.pushers[traj.policy].send(traj)
            self._resent += 1
            count += 1
        return Resent(step=msg.step, count=count, missing=missing)

    def _progress(self, msg: RunEpisodes) -> Callable[[Awaitable[T]], Awaitable[T]]:
        """Wraps each episode so that its end is pushed to ``msg.progress`` as
        :class:`Metrics` (every ~5% of the episodes and at the last; dropped if nobody reads),
        counted over the request's whole ``batch`` (every slice and wave of it this runner
        plays) when it names one."""
        n = msg.batch_episodes or len(msg.episodes)
        counts = self._batch_done if msg.batch else {}  # a request without a batch counts alone
        counts.setdefault(msg.batch, 0)  # a new batch goes last: the pruning below keeps it
        while len(self._batch_done) > 64:  # the oldest batches' counts are not read again
            del self._batch_done[next(iter(self._batch_done))]
        every = max(1, n // 20)
        pusher = None
        if msg.progress:
            if msg.progress not in self.pushers:
                self.pushers[msg.progress] = Pusher(self.loop.ctx, msg.progress)
            pusher = self.pushers[msg.progress]
        train = float(any(s.train for s in msg.episodes))

        async def wrap(episode: Awaitable[T]) -> T:
            result = await episode
            done = counts[msg.batch] = counts.get(msg.batch, 0) + 1  # even if pruned meanwhile
            if pusher is not None and (done % every == 0 or done == n):
                pusher.try_send(Metrics(source=self.name, step=msg.step, time=time.time(),
                                        values={"episodes_done": float(done), "episodes": float(n), "train": train}))
            return result

        return wrap

    async def _sample(self, ref: PolicyRef, prompt: np.ndarray, params: SamplingParams) -> SampleResult:
        adapter = ref.name if ref.kind is PolicyKind.ADAPTER else None
        req = SampleRequest(adapter=adapter, prompts=[prompt], params=params, client=self.name)
        reply = await self.schedulers[self.routes(adapter)].request(req, timeout=self.sample_timeout_s)
        assert isinstance(reply, SampleResult)
        return reply

    async def _score(self, ref: PolicyRef, tokens: np.ndarray, temperature: float, tail: int) -> tuple[np.ndarray, int]:
        """Teacher-forced log-probs of the last ``tail`` of ``tokens`` under ``ref``'s adapter
        (an exploring reply): the reply given to the engine as a forced sample
        (``SampleRequest.forced``), so its prompt's cached prefix serves it and the reply is
        cached for the seat's next turn, in the running batch beside the drawn replies."""
        params = SamplingParams(temperature=temperature, max_tokens=tail)
        req = SampleRequest(adapter=ref.name, prompts=[tokens[:-tail]], params=params, client=self.name,
                            forced=[np.asarray(tokens[-tail:], dtype=np.int32)])
        reply = await self.schedulers[self.routes(ref.name)].request(req, timeout=self.sample_timeout_s)
        assert isinstance(reply, SampleResult)
        logprobs = np.zeros(len(tokens), np.float32)
        logprobs[-tail:] = reply.logprobs[0]
        return logprobs, reply.adapter_version

    def stop(self) -> None:
        if hasattr(self, "loop"):
            self.loop.run(self.server.stop())
            for client in self.schedulers.values():
                client.close()
            for p in self.pushers.values():
                p.close()
            self.loop.stop()

