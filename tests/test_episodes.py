"""play_episode's bookkeeping with fixed replies: per-turn rewards, including rewards paid on
another seat's move, sum to each seat's total."""

from __future__ import annotations

import numpy as np
from conftest import run

from games.kuhn_poker import DEALS
from opentinker.rollout.episodes import play_episode
from protocols.messages import (
    EpisodeSpec,
    PolicyKind,
    PolicyRef,
    RunEpisodes,
    SampleResult,
    SamplingParams,
    StopReason,
)


def test_a_showdown_paid_on_the_callers_move_lands_on_the_bettors_turn(chat_tok):
    main = PolicyRef(kind=PolicyKind.ADAPTER, name="main")
    spec = EpisodeSpec(episode_id=5, group_id=0, game="kuhn_poker_v0", game_kwargs={"deal": DEALS.index((2, 1))},
                       seed=0, seats={"player_0": main, "player_1": main}, train=True)
    msg = RunEpisodes(episodes=[spec], sampling=SamplingParams(max_tokens=4), system_prompt="You play poker.",
                      learners={"main": "tcp://127.0.0.1:1"})
    replies = iter(["bet", "call"])

    async def sample(ref, prompt, params):
        toks = np.asarray([*chat_tok.encode(next(replies)), chat_tok.eos_id], np.int32)
        return SampleResult(tokens=[toks], logprobs=[np.zeros(len(toks), np.float32)],
                            stop_reasons=[StopReason.STOP], adapter_version=0, batch_id=0)

    summary, trajectories = run(play_episode(spec, msg, chat_tok, sample))
    by_seat = {t.seat: t for t in trajectories}
    assert summary.rewards == {"player_0": 2.0, "player_1": -2.0}  # K bets, Q calls, K wins 2
    # player_0's only decision was the bet; the showdown came on player_1's call.
    assert [t.reward for t in by_seat["player_0"].turns] == [2.0]
    assert [t.reward for t in by_seat["player_1"].turns] == [-2.0]
    for t in trajectories:
        assert sum(turn.reward for turn in t.turns) == t.total_reward
