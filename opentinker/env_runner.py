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
from opentinker.render import ChatTokenizer, SeatRenderer
from protocols.messages import (
    EpisodeSpec,
    EpisodesDone,
    EpisodeSummary,
    Message,
    ParseOutcome,
    PolicyKind,
    PolicyRef,
    RunEpisodes,
    SampleRequest,
    SampleResult,
    SamplingParams,
    StopReason,
    Trajectory,
    Turn,
)

log = logging.getLogger(__name__)
MAX_AGENT_STEPS = 1000
"""Upper bound on agent-steps in one episode: a game that runs longer is an error."""


def sample_seed(episode_seed: int, episode_id: int, seat_index: int, turn: int) -> int:
    """The seed of one decision's sample (63-bit). Episodes of a group share ``episode_seed``
    (hence the game's start) and differ in ``episode_id``, hence in their samples."""
    words = np.random.SeedSequence([episode_seed & 0xFFFFFFFF, episode_seed >> 32, episode_id, seat_index, turn])
    hi, lo = (int(w) for w in words.generate_state(2, np.uint32))
    return (hi << 31) | (lo >> 1)


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
        results = await asyncio.gather(*(self._play(spec, msg) for spec in msg.episodes))
        sent = 0
        for _, trajectories in results:
            for traj in trajectories:
                self._seq += 1
                await self.pushers[traj.policy].send(msgspec.structs.replace(traj, seq=self._seq))
                sent += 1
        return EpisodesDone(summaries=[s for s, _ in results], trajectories_sent=sent)

    async def _play(self, spec: EpisodeSpec, msg: RunEpisodes) -> tuple[EpisodeSummary, list[Trajectory]]:
        env = games.make(spec.game, **spec.game_kwargs)
        env.reset(seed=spec.seed)
        agents = list(env.possible_agents)
        for agent in spec.seats:
            if agent not in agents:
                raise ValueError(f"episode {spec.episode_id}: {spec.game} has no seat {agent!r}")
        scripted = {
            a: games.make_scripted(ref.name) for a, ref in spec.seats.items() if ref.kind is PolicyKind.SCRIPTED
        }
        rng = np.random.default_rng([spec.seed & 0xFFFFFFFF, spec.seed >> 32, spec.episode_id, 7])
        renderers = {a: SeatRenderer(self.tok, msg.system_prompt) for a in agents if a not in scripted}
        turns: dict[str, list[Turn]] = {a: [] for a in agents}
        totals = {a: 0.0 for a in agents}
        invalid = {a: 0 for a in agents}
        decisions = {a: 0 for a in agents}
        transcript: list[str] = []
        for n, agent in enumerate(env.agent_iter(max_iter=MAX_AGENT_STEPS)):
            obs, _, term, trunc, info = env.last()
            if term or trunc:
                env.step(None)
                continue
            ref = spec.seats.get(agent)
            if ref is None:
                raise ValueError(f"episode {spec.episode_id}: no policy for seat {agent!r}")
            decisions[agent] += 1
            before = dict(getattr(env.unwrapped, "invalid_counts", {}))
            if agent in scripted:
                text = scripted[agent].act(obs["text"], info, rng)
                env.step(text)
            else:
                r = renderers[agent]
                obs_tokens = r.observe(obs["text"])
                seed = sample_seed(spec.seed, spec.episode_id, agents.index(agent), len(turns[agent]))
                result = await self._sample(ref, r.prompt(), msg.sampling, seed)
                sampled, logps = result.tokens[0], result.logprobs[0]
                stop = result.stop_reasons[0]
                r.add_reply(sampled, stop is StopReason.STOP)
                text = self.tok.decode(sampled)
                env.step(text)
                bad = getattr(env.unwrapped, "invalid_counts", {}).get(agent, 0) > before.get(agent, 0)
                turns[agent].append(
                    Turn(
                        obs_tokens=obs_tokens,
                        sampled_tokens=np.asarray(sampled, dtype=np.int32),
                        sampler_logprobs=np.asarray(logps, dtype=np.float32),
                        policy=msgspec.structs.replace(ref, version=result.adapter_version),
                        stop_reason=stop,
                        parse=ParseOutcome.INVALID if bad else ParseOutcome.OK,
                        reward=float(env.rewards.get(agent, 0.0)),
                    )
                )
            if getattr(env.unwrapped, "invalid_counts", {}).get(agent, 0) > before.get(agent, 0):
                invalid[agent] += 1
            for a, rew in env.rewards.items():
                totals[a] += float(rew)
            transcript.append(f"{agent} [{ref.label()}]: {text!r}")
        else:
            if env.agents:
                raise RuntimeError(f"episode {spec.episode_id} did not end in {MAX_AGENT_STEPS} agent-steps")
        env.close()
        trajectories = []
        if spec.train:
            for agent, ref in spec.seats.items():
                if ref.kind is PolicyKind.ADAPTER and ref.name in msg.learners and turns[agent]:
                    trajectories.append(
                        Trajectory(
                            episode_id=spec.episode_id,
                            group_id=spec.seat_groups.get(agent, spec.group_id),
                            seat=agent,
                            seed=spec.seed,
                            policy=ref.name,
                            turns=turns[agent],
                            total_reward=totals[agent],
                            step=msg.step,
                        )
                    )
        summary = EpisodeSummary(
            episode_id=spec.episode_id, group_id=spec.group_id, seed=spec.seed,
            rewards=totals, invalid=invalid, turns=decisions, transcript=transcript,
        )
        return summary, trajectories

    async def _sample(
        self, ref: PolicyRef, prompt: np.ndarray, sampling: SamplingParams, seed: int
    ) -> SampleResult:
        params = msgspec.structs.replace(
            sampling,
            seed=seed,
            stop_token_ids=sampling.stop_token_ids or (self.tok.eos_id,),
        )
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

