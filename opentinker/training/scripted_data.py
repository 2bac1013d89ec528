"""SFT data from a scripted seat's play (``offline.scripted``): demonstrations rendered as the
policy's own sampling renders its turns.

An offline SFT job with ``scripted = "calc_tool_user"`` plays ``offline.episodes`` episodes of
the job's game with that seat in the first policy's seat (and in every seat its mix gives to
``self``; other seats go to the mix's scripted opponents), through the rollout's own
:func:`~opentinker.rollout.episodes.play_episode`: the scripted seat is named among the
episodes' learners, so its turns are rendered by the same
:class:`~opentinker.rollout.render.SeatRenderer` as an LLM seat's (the system prompt, its tool
declarations, tool results as ``tool`` messages) and its replies are recorded as sampled
tokens (the text's tokens and the stop token). The trajectories then go through the same
assembly as recorded ones (:func:`learners.offline.sft_datums`): the loss is on the scripted
replies' tokens only, never on the prompt, a tool's result or the template's tokens.

Which episodes: those of a training step with ``groups_per_step = episodes`` and
``group_size = 1`` (:func:`~opentinker.rollout.episodes.train_episodes`, step 0): distinct
starts and seats drawn from the job's seed.
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from opentinker.config import JobConfig
from opentinker.engine.model_specs import resolve_model
from opentinker.rollout.episodes import play_episode, train_episodes
from opentinker.rollout.render import ChatTokenizer
from protocols.messages import (
    EpisodeSpec,
    PolicyKind,
    PolicyRef,
    RunEpisodes,
    SampleResult,
    SamplingParams,
    Trajectory,
)


def scripted_episodes(cfg: JobConfig) -> list[EpisodeSpec]:
    """The episodes the ``offline.scripted`` seat plays: a training step's draw of
    ``offline.episodes`` starts, the scripted seat wherever the first policy would sit
    (its own seat and ``self`` opponents)."""
    oc = cfg.offline_job()
    assert oc is not None and oc.scripted
    policy = cfg.policies[0]
    one = msgspec.structs.replace(cfg, policies=[policy], train=msgspec.structs.replace(
        cfg.train, groups_per_step=oc.episodes, group_size=1))
    seat = PolicyRef(kind=PolicyKind.SCRIPTED, name=oc.scripted)
    out = []
    for spec in train_episodes(one, 0):
        seats = {a: seat if ref.kind is PolicyKind.ADAPTER and ref.name == policy.name else ref
                 for a, ref in spec.seats.items()}
        if any(ref.kind is not PolicyKind.SCRIPTED for ref in seats.values()):  # config checks refuse these
            raise ValueError(f"offline.scripted: episode {spec.episode_id} has a seat for a model: {seats}")
        out.append(msgspec.structs.replace(spec, seats=seats))
    return out


async def _no_model(ref: PolicyRef, prompt: np.ndarray, params: SamplingParams) -> SampleResult:
    raise RuntimeError(f"offline.scripted: {ref.label()} asked a model to sample; every seat here is scripted")


def scripted_trajectories(cfg: JobConfig, tok: ChatTokenizer | None = None) -> list[Trajectory]:
    """The scripted seat's trajectories over :func:`scripted_episodes`, token-in/token-out as
    a learner's (``tok``: the job's model's tokenizer, loaded when not given)."""
    oc = cfg.offline_job()
    assert oc is not None and oc.scripted
    tok = tok or ChatTokenizer(resolve_model(cfg.model.base))
    specs = scripted_episodes(cfg)
    msg = RunEpisodes(episodes=specs, sampling=SamplingParams(max_tokens=cfg.sampling.max_tokens),
                      system_prompt=cfg.system_prompt, learners={oc.scripted: ""})

    async def play_all() -> list[Trajectory]:
        out: list[Trajectory] = []
        for spec in specs:
            _, trajectories = await play_episode(spec, msg, tok, _no_model)
            out.extend(trajectories)
        return out

    return asyncio.run(play_all())
