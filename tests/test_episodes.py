"""play_episode's bookkeeping with fixed replies: per-turn rewards, including rewards paid on
another seat's move, sum to each seat's total."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from conftest import run

from games.kuhn_poker import DEALS
from opentinker.rollout.episodes import play_episode
from protocols.messages import (
    EpisodeSpec,
    ParseOutcome,
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


def test_an_exploring_learner_scripted_opponent_and_transcript(chat_tok):
    """With ``explore`` 1 a learner's every decision is a legal move scored through ``score``
    (its log-probs and version on the turn); a scripted seat acts in the runner and has no
    turns; the transcript has each observation, each reply and the outcome."""
    main = PolicyRef(kind=PolicyKind.ADAPTER, name="main")
    rand = PolicyRef(kind=PolicyKind.SCRIPTED, name="random")
    spec = EpisodeSpec(episode_id=3, group_id=1, game="kuhn_poker_v0", game_kwargs={"deal": DEALS.index((2, 1))},
                       seed=9, seats={"player_0": main, "player_1": rand}, train=True)
    msg = RunEpisodes(episodes=[spec], sampling=SamplingParams(max_tokens=4, temperature=0.7),
                      system_prompt="You play poker.", learners={"main": "tcp://127.0.0.1:1"}, step=4, explore=1.0)
    scored = []

    async def sample(ref, prompt, params):
        raise AssertionError("an exploring learner does not sample")

    async def score(ref, tokens, temperature, tail):
        scored.append((ref, tokens, temperature, tail))
        return -0.25 * np.arange(1, len(tokens) + 1, dtype=np.float32), 3

    summary, trajectories = run(play_episode(spec, msg, chat_tok, sample, score))
    (traj,) = trajectories
    assert (traj.seat, traj.policy, traj.step, traj.group_id, traj.seed) == ("player_0", "main", 4, 1, 9)
    assert len(traj.turns) == len(scored) == summary.turns["player_0"] >= 1
    for turn, (ref, tokens, temperature, tail) in zip(traj.turns, scored):
        reply = list(turn.sampled_tokens)
        assert chat_tok.decode(reply[:-1]) in ("check", "bet", "call", "fold") and reply[-1] == chat_tok.eos_id
        assert ref == main and temperature == 0.7 and tail == len(reply) and list(tokens[-tail:]) == reply
        np.testing.assert_array_equal(turn.sampler_logprobs, -0.25 * np.arange(len(tokens) - tail + 1,
                                                                                len(tokens) + 1))
        assert turn.policy.version == 3 and turn.stop_reason is StopReason.STOP
        assert turn.parse is ParseOutcome.OK
    assert summary.rewards["player_0"] == -summary.rewards["player_1"] == traj.total_reward != 0
    assert summary.invalid == {"player_0": 0, "player_1": 0}
    lines = summary.transcript
    assert lines[0] == "player_0 [adapter:main] sees:" and lines[1].startswith("    ")
    replies = [line for line in lines
               if line.startswith(("player_0 [adapter:main@3]: ", "player_1 [scripted:random]: "))]
    assert len(replies) == summary.turns["player_0"] + summary.turns["player_1"]
    assert replies[0] == f"player_0 [adapter:main@3]: {chat_tok.decode(list(traj.turns[0].sampled_tokens)[:-1])!r}"
    r0, r1 = summary.rewards["player_0"], summary.rewards["player_1"]
    assert lines[-1] == f"outcome: player_0 {r0:+g}, player_1 {r1:+g}"


def test_an_invalid_reply_is_counted_and_a_bad_episode_is_refused(chat_tok):
    """A reply the game rejects counts as invalid (turn, summary and transcript); a seat the
    game lacks, a seat without a policy, and exploring without ``score`` are errors."""
    main = PolicyRef(kind=PolicyKind.ADAPTER, name="main")
    base = PolicyRef(kind=PolicyKind.BASE)
    spec = EpisodeSpec(episode_id=1, group_id=0, game="kuhn_poker_v0", game_kwargs={"deal": DEALS.index((2, 1))},
                       seed=0, seats={"player_0": main, "player_1": base}, train=True)
    msg = RunEpisodes(episodes=[spec], sampling=SamplingParams(max_tokens=4), system_prompt="You play poker.",
                      learners={"main": "tcp://127.0.0.1:1"})
    replies = iter(["banana"])

    async def sample(ref, prompt, params):
        toks = np.asarray([*chat_tok.encode(next(replies)), chat_tok.eos_id], np.int32)
        return SampleResult(tokens=[toks], logprobs=[np.zeros(len(toks), np.float32)],
                            stop_reasons=[StopReason.STOP], adapter_version=2, batch_id=0)

    summary, trajectories = run(play_episode(spec, msg, chat_tok, sample))
    (traj,) = trajectories  # the base model does not learn
    (turn,) = traj.turns  # an invalid reply forfeits the hand
    assert turn.parse is ParseOutcome.INVALID and turn.reward == -1.0 and turn.policy.version == 2
    assert summary.rewards == {"player_0": -1.0, "player_1": 1.0} and summary.invalid == {"player_0": 1, "player_1": 0}
    assert summary.transcript[-2:] == ["player_0 [adapter:main@2]: 'banana'  (invalid)",
                                       "outcome: player_0 -1 (1 invalid), player_1 +1"]

    for seats, why in (({"player_0": main, "player_9": base}, "has no seat 'player_9'"),
                       ({"player_1": base}, "no policy for seat 'player_0'")):
        bad = msgspec.structs.replace(spec, seats=seats)
        with pytest.raises(ValueError, match=why):
            run(play_episode(bad, msg, chat_tok, sample))
    exploring = msgspec.structs.replace(msg, explore=0.5)
    with pytest.raises(ValueError, match="needs a score function"):
        run(play_episode(spec, exploring, chat_tok, sample))


def test_group_draws_give_a_groups_episodes_one_opponent(chat_tok):
    """With ``group_draws`` the random opponent of a training group's episodes draws from the
    group's stream: the learner playing the same moves meets the same replies (common random
    numbers), so every episode ends alike; per-episode streams differ, and an evaluation
    always draws per episode."""
    main = PolicyRef(kind=PolicyKind.ADAPTER, name="main")
    rand = PolicyRef(kind=PolicyKind.SCRIPTED, name="random")

    calls: list[int] = []

    async def sample(ref, prompt, params):  # check first (player_0 acts first), then call
        word = "call" if calls else "check"
        calls.append(1)
        toks = np.asarray([*chat_tok.encode(word), chat_tok.eos_id], np.int32)
        return SampleResult(tokens=[toks], logprobs=[np.zeros(len(toks), np.float32)],
                            stop_reasons=[StopReason.STOP], adapter_version=0, batch_id=0)

    def outcomes(group_draws: bool, train: bool) -> list[tuple[str, ...]]:
        specs = [EpisodeSpec(episode_id=100 + i, group_id=7, game="kuhn_poker_v0", seed=11, train=train,
                             game_kwargs={"deal": DEALS.index((2, 1))}, seats={"player_0": main, "player_1": rand})
                 for i in range(12)]
        msg = RunEpisodes(episodes=specs, sampling=SamplingParams(max_tokens=4), system_prompt="You play poker.",
                          learners={"main": "tcp://127.0.0.1:1"}, group_draws=group_draws)
        out = []
        for spec in specs:
            calls.clear()
            summary, _ = run(play_episode(spec, msg, chat_tok, sample))
            assert summary.invalid == {"player_0": 0, "player_1": 0}
            out.append(tuple(line for line in summary.transcript if line.startswith("player_1 [scripted")))
        return out

    assert len(set(outcomes(group_draws=True, train=True))) == 1
    assert len(set(outcomes(group_draws=False, train=True))) == 2  # the opponent checks or bets
    assert len(set(outcomes(group_draws=True, train=False))) == 2


@pytest.mark.parametrize("opponent", ["random", "tictactoe_minimax"])
def test_a_learners_turns_carry_the_games_value_of_their_state(chat_tok, opponent):
    """Against a scripted opponent the game values (tic-tac-toe: random, minimax), each turn of
    a training episode carries ``state_value`` of the board it was played on, for its seat, and
    ``move_values`` of each empty cell; a self-play one carries none."""
    from games.tictactoe import move_values, state_value

    main = PolicyRef(kind=PolicyKind.ADAPTER, name="main")
    other = PolicyRef(kind=PolicyKind.SCRIPTED, name=opponent)
    boards = []

    def spec(train: bool, seats: dict) -> tuple:
        s = EpisodeSpec(episode_id=2, group_id=0, game="tictactoe_v0", seed=4, seats=seats, train=train)
        return s, RunEpisodes(episodes=[s], sampling=SamplingParams(max_tokens=4), system_prompt="Tic-tac-toe.",
                              learners={"main": "tcp://127.0.0.1:1"})

    async def sample(ref, prompt, params):  # the lowest empty cell of the board the prompt shows
        text = chat_tok.decode(list(prompt))
        board = text[text.rindex("Tic-tac-toe. You are"):].split("\n")[1:4]
        cells = "".join(line.replace(" ", "") for line in board)
        boards.append("".join(c if c in "XO" else "." for c in cells))
        toks = np.asarray([*chat_tok.encode(next(c for c in cells if c.isdigit())), chat_tok.eos_id], np.int32)
        return SampleResult(tokens=[toks], logprobs=[np.zeros(len(toks), np.float32)],
                            stop_reasons=[StopReason.STOP], adapter_version=0, batch_id=0)

    _, trajectories = run(play_episode(*spec(True, {"player_x": main, "player_o": other}), chat_tok, sample))
    (traj,) = trajectories
    assert len(traj.turns) == len(boards) >= 3
    assert [t.game_value for t in traj.turns] == [state_value(b, "player_x", opponent) for b in boards]
    assert traj.turns[0].game_value == (0.0 if opponent == "tictactoe_minimax" else pytest.approx(0.9948, abs=1e-4))
    for t, b in zip(traj.turns, boards):  # and every legal move's value, by its reply's first token
        values = move_values(b, "player_x", opponent)
        assert t.move_tokens.tolist() == [[*chat_tok.encode(m), chat_tok.eos_id] for m in values]  # one token each
        assert t.move_values.tolist() == pytest.approx(list(values.values()))
        assert set(t.move_values_by) == {"random", "tictactoe_minimax"}  # against every valued opponent
        for o, v in t.move_values_by.items():
            assert v.tolist() == pytest.approx(list(move_values(b, "player_x", o).values()))
    boards.clear()
    _, trajectories = run(play_episode(*spec(True, {"player_x": main, "player_o": main}), chat_tok, sample))
    assert trajectories and all(t.game_value is None and t.move_tokens is None and t.move_values is None
                                and not t.move_values_by for traj in trajectories for t in traj.turns)
