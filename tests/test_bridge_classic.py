"""The PettingZoo text bridge on pettingzoo.classic envs (tic-tac-toe, connect four, rock-paper-
scissors): conformance, and equivalence with the wrapped env under the same seed and moves."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import pytest
from pettingzoo.classic import connect_four_v3, rps_v2, tictactoe_v3
from pettingzoo.test import api_test

import games

CLASSIC = {"tictactoe_v3": tictactoe_v3.env, "connect_four_v3": connect_four_v3.env, "rps_v2": rps_v2.env}


@pytest.mark.parametrize("name", CLASSIC)
def test_classic_env_through_the_bridge_conforms(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(games.from_pettingzoo(CLASSIC[name], name=f"{name}_text"), num_cycles=100)


@pytest.mark.parametrize("name", CLASSIC)
def test_classic_env_equivalence(name):
    for seed in range(5):
        inner, bridged = CLASSIC[name](), games.from_pettingzoo(CLASSIC[name], name=f"{name}_text")
        inner.reset(seed=seed)
        bridged.reset(seed=seed)
        rng = np.random.default_rng(seed)
        for steps in range(300):
            if not inner.agents:
                break
            agent = inner.agent_selection
            assert bridged.agent_selection == agent
            i_obs, i_rew, i_term, i_trunc, _ = inner.last()
            b_obs, b_rew, b_term, b_trunc, b_info = bridged.last()
            assert (b_rew, b_term, b_trunc) == (i_rew, i_term, i_trunc)
            assert bridged.observation_space(agent).contains(b_obs)
            if i_term or i_trunc:
                inner.step(None)
                bridged.step(None)
                continue
            space = inner.action_space(agent)
            if isinstance(i_obs, Mapping) and "action_mask" in i_obs:
                legal = [int(space.start) + int(i) for i in np.flatnonzero(i_obs["action_mask"])]
            else:
                legal = list(range(int(space.start), int(space.start) + int(space.n)))
            assert b_info["legal_moves"] == [str(a) for a in legal]
            action = legal[int(rng.integers(len(legal)))]
            inner.step(action)
            bridged.step(f"I play {action}.")
            assert bridged.rewards == inner.rewards
            assert bridged.terminations == inner.terminations
            assert bridged.truncations == inner.truncations
        assert not inner.agents and not bridged.agents and steps < 299
        assert bridged.unwrapped.invalid_counts == {a: 0 for a in inner.possible_agents}


def test_classic_garbage_reply_is_a_counted_forfeit():
    env = games.from_pettingzoo(connect_four_v3.env, name="connect_four_text")
    env.reset(seed=0)
    first = env.agent_selection
    env.step("column seventeen, obviously")
    assert env.unwrapped.invalid_counts[first] == 1
    assert env.rewards[first] == -1 and all(env.terminations.values())
