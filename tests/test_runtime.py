"""The runtime on the local backend with tiny-random: the real bus, scheduler, env runners,
learner and coordinator in one process."""

from __future__ import annotations

import math
import msgspec

import pytest

from conftest import DEVICE, with_overrides

from opentinker.config import JobConfig
from opentinker.rollout.episodes import train_episodes
from opentinker.control.runtime import Job
from protocols.messages import PolicyKind


def _cfg(**over) -> JobConfig:
    raw = {
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE},
        "runtime": {"backend": "local", "env_runners": 2, "timeout_s": 120},
        "train": {"groups_per_step": 4, "group_size": 2, "lr": 1e-2},
        "sampling": {"max_tokens": 4},
        "eval": {"hands_per_stratum": 2, "head_to_head_per_stratum": 1, "cross_play_per_stratum": 1},
        "policies": [{"name": "main", "opponents": {"random": 1, "self": 1, "base": 1, "other": 1}},
                     {"name": "other", "opponents": {"random": 1}}],
    }
    return msgspec.convert(with_overrides(raw, over), JobConfig)


@pytest.fixture(scope="module")
def job(tiny_path):
    j = Job(_cfg(), tiny_path)
    yield j
    j.shutdown()


def test_training_steps_bump_versions_and_count_bus_messages(job):
    before = job.info()
    m = job.coordinator("train_step", 1)
    after = job.info()
    assert m["train/main/version"] == 1 and m["train/other/version"] == 1
    specs = train_episodes(job.cfg, 1)
    assert len(specs) == 2 * 4 * 2  # two policies x groups x group size

    def delta(name, key):
        return after[name]["counters"].get(key, 0) - before[name]["counters"].get(key, 0)

    samples = sum(delta(f"env_runner{i}", "client/sent/SampleRequest") for i in range(2))
    pushed = sum(delta(f"env_runner{i}", "pushed/Trajectory") for i in range(2))
    requests = sum(delta(f"env_runner{i}", "recv/RunEpisodes") for i in range(2))
    # Every LLM decision is one SampleRequest; every trainable seat one Trajectory; every
    # runner one RunEpisodes per step, whatever the number of episodes.
    decisions = m["train/main/turns"] + m["train/other/turns"]
    llm_decisions_of_base = samples - decisions
    assert samples >= decisions and llm_decisions_of_base >= 0
    trainable_seats = sum(
        sum(1 for r in s.seats.values() if r.kind is PolicyKind.ADAPTER) for s in specs
    )
    # A trainable seat that never acted (the opponent forfeited first) sends nothing.
    assert pushed == m["train/main/n_datums"] + m["train/other/n_datums"]
    assert 0 < pushed <= trainable_seats
    assert requests == 2
    got = delta("learner_main", "pull/recv/Trajectory") + delta("learner_other", "pull/recv/Trajectory")
    assert got == pushed
    assert delta("scheduler", "recv/SampleRequest") == samples
    assert delta("scheduler", "ForwardBackward") == delta("scheduler", "OptimStep") == 2
    # The engine's metrics of the step: every sampled token counted, rows shared steps.
    assert m["perf/engine/decode_tokens"] == delta("scheduler", "engine/decode_tokens") > 0
    assert m["perf/engine/rows_per_step"] >= 1 and 0 <= m["perf/engine/prefix_hit_rate"] < 1
    assert m["perf/engine/adapters_resident"] == 2 and m["perf/engine/adapters_spilled"] == 0
    assert m["perf/scheduler_peak_rss_mb"] > 10  # the step's own peak (the whole process, on the local backend)


def test_two_env_runners_share_forward_passes(job):
    job.coordinator("train_step", 2)
    stats = job.coordinator("scheduler_stats")
    mixed = [b for b in stats["batches"] if {"runner0", "runner1"} <= set(b)]
    assert mixed, f"no batch served rows of both runners: {stats['batches'][:10]}"


def test_episodes_are_a_function_of_seed_and_step(job, tiny_path):
    a, b = train_episodes(job.cfg, 3), train_episodes(job.cfg, 3)
    assert a == b and a != train_episodes(job.cfg, 4)
    seeds = {(s.group_id, s.seed) for s in a}
    assert len({s.seed for s in a}) == 4 * 2  # a group shares its seed (its deal)
    assert len(seeds) == len({s.seed for s in a})


def test_evaluation_reports_strata_and_exploitability(job):
    job.coordinator("train_step", 5)  # trained (else every policy is the base model: no mirror matches)
    ev = job.coordinator("evaluate", 5, True, 2)
    for p, q in (("main", "other"), ("other", "main")):
        assert ev[f"eval/{p}/vs_random/hands"] == 6 * 2 * 2
        assert ev[f"eval/{p}/vs_base/hands"] == 6 * 2 * 1
        assert ev[f"eval/{p}/vs_{q}/hands"] == 6 * 2 * 1  # the cross-play matrix
        assert -2.0 <= ev[f"eval/{p}/vs_{q}/chips"] <= 2.0 and 0.0 <= ev[f"eval/{p}/vs_{q}/invalid_rate"] <= 1.0
        assert 0.0 <= ev[f"eval/{p}/vs_random/invalid_rate"] <= 1.0
        assert 0.0 < ev[f"eval/{p}/exploitability"] < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("game", __import__("games").names())
def test_every_game_trains_and_evaluates_through_the_runtime(game, tiny_path):
    hook = __import__("games").evaluation(game)
    partner = hook.scripted[0]  # every registered game declares a scripted seat of its own
    cfg = _cfg(game=game, policies=[{"name": "main", "opponents": {"random": 1, "self": 1, partner: 1}}])
    job = Job(cfg, tiny_path)
    try:
        m = job.coordinator("train_step", 1)
        assert m["train/main/version"] == 1 and m["train/episodes"] == 4 * 2
        ev = job.coordinator("evaluate", 1, True, 1)
        # Against random and against the scripted partner of the training mix, every seat.
        n_seats = len(__import__("games").make(game).possible_agents)
        for opp in ("random", partner):
            assert ev[f"eval/main/vs_{opp}/hands"] == 6 * n_seats, opp
            assert 0.0 <= ev[f"eval/main/vs_{opp}/invalid_rate"] <= 1.0
            assert math.isfinite(ev[f"eval/main/vs_{opp}/{hook.unit}"])  # the metric is named by the game's unit
            if hook.competitive:  # every game won, drawn or lost
                assert sum(ev[f"eval/main/vs_{opp}/{k}"] for k in ("wins", "draws", "losses")) == 6 * n_seats
            else:
                assert f"eval/main/vs_{opp}/wins" not in ev
        assert {k.rsplit("/", 1)[1] for k in ev if k.startswith("eval/main/") and k.count("/") == 2} >= {
            m.name for m in hook.exact}
    finally:
        job.shutdown()


def test_game_kwargs_reach_every_episode(tiny_path):
    cfg = _cfg(game="liars_dice_v0", game_kwargs={"num_players": 4},
               policies=[{"name": "main", "opponents": {"liars_dice_cautious": 1}}])
    specs = train_episodes(cfg, 1)
    assert all(s.game_kwargs == {"num_players": 4} and len(s.seats) == 4 for s in specs)
    job = Job(cfg, tiny_path)
    try:
        m = job.coordinator("train_step", 1)
        assert m["train/main/version"] == 1
        ev = job.coordinator("evaluate", 1, False, 1)
        assert ev["eval/main/vs_random/hands"] == 6 * 4  # every one of the 4 seats, 6 blocks each
    finally:
        job.shutdown()
    bad = _cfg(game="liars_dice_v0", game_kwargs={"players": 4})
    with pytest.raises(ValueError, match="game_kwargs.*players.*liars_dice_v0"):
        train_episodes(bad, 1)


def test_runners_stream_episode_progress_to_the_driver(job):
    """The driver's EpisodeFeed hears every episode of a step end, summed over both runners."""
    import time

    from opentinker.progress import EpisodeFeed

    seen: list[tuple[int, int, bool]] = []
    feed = EpisodeFeed(lambda done, total, train: seen.append((done, total, train)))
    try:
        m = job.coordinator("train_step", 7, feed.endpoint)
        for _ in range(200):  # the last pushes may land just after the reply
            if seen and seen[-1][0] == m["train/episodes"]:
                break
            time.sleep(0.01)
    finally:
        feed.close()
    assert seen[-1] == (m["train/episodes"], m["train/episodes"], True)
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)  # it only moves forward


def test_untrained_policies_play_no_mirror_matches(tiny_path):
    """Before any step every policy is the base model: the evaluation plays random (and the
    scripted seats of the mix) only; after a step, the base model and the other policy too."""
    job = Job(_cfg(), tiny_path)
    try:
        before = job.coordinator("evaluate", 0, True, 1)
        assert "eval/main/vs_random/hands" in before
        assert not [k for k in before if "/vs_base/" in k or "/vs_other/" in k or "/vs_main/" in k]
        job.coordinator("train_step", 1)
        after = job.coordinator("evaluate", 1, True, 1)
        assert after["eval/main/vs_base/hands"] == after["eval/main/vs_other/hands"] == 6 * 2
    finally:
        job.shutdown()


def test_the_best_response_opponent_is_an_exact_exploiter(tiny_path):
    """``best_response`` in the mix: every step's opponent plays a pure best response to the
    policy's current move probabilities (the game's hook), and the step logs its exploitability."""
    import games
    from opentinker.rollout.episodes import opponent_ref

    cfg = _cfg(policies=[{"name": "main", "opponents": {"best_response": 1}}])
    job = Job(cfg, tiny_path)
    try:
        m = job.coordinator("train_step", 1)
        assert 0.0 < m["train/main/exploitability"] < 1.0 and m["timing_s/best_response"] > 0
        assert m["train/episodes"] == 4 * 2 and m["train/main/version"] == 1
        lines = job.coordinator("recent_transcripts")
        assert any("[scripted:table]" in line for line in lines)
        # The evaluation's exploitability (four spellings) is of the same policy.
        ev = job.coordinator("evaluate", 1, False, 1)
        assert abs(ev["eval/main/exploitability"] - m["train/main/exploitability"]) < 0.2
    finally:
        job.shutdown()
    with pytest.raises(ValueError, match="made by train_episodes"):
        opponent_ref("main", "best_response")
    assert games.evaluation("tictactoe_v0").exploiter() is None
    from opentinker.control.config_checks import check_config

    with pytest.raises(Exception, match="best_response: tictactoe_v0's evaluation hook gives no best response"):
        check_config(_cfg(game="tictactoe_v0", policies=[{"name": "main", "opponents": {"best_response": 1}}]))


def test_exploring_replies_are_legal_moves_scored_by_the_policy(tmp_path, tiny_path):
    """``sampling.explore``: some training decisions reply with a legal move (the tiny random
    model never writes one by itself), each carrying the policy's own teacher-forced log-probs;
    evaluations never explore."""
    import io

    import numpy as np
    from rich.console import Console

    from opentinker.rollout.render import ChatTokenizer
    from opentinker.run import run_job
    from opentinker.training import trajectory_log

    cfg = _cfg(out_dir=str(tmp_path), sampling={"max_tokens": 4, "explore": 0.5},
               train={"steps": 1, "groups_per_step": 4, "group_size": 2, "lr": 1e-2},
               eval={"hands_per_stratum": 1, "head_to_head_per_stratum": 0, "cross_play_per_stratum": 0},
               policies=[{"name": "main", "opponents": {"random": 1}}])
    res = run_job(cfg, console=Console(file=io.StringIO()))
    tok = ChatTokenizer(tiny_path)
    turns = [t for r in trajectory_log.read(res.run_dir / "trajectories" / "main.jsonl") for t in r.turns]
    explored = [t for t in turns if list(t.sampled_tokens)[-1] == tok.eos_id
                and tok.decode(list(t.sampled_tokens)[:-1]) in ("check", "bet", "call", "fold")]
    assert 0 < len(explored) < len(turns), (len(explored), len(turns))
    for t in explored:
        lp = np.asarray(t.sampler_logprobs)
        assert t.parse.value == "ok" and len(lp) == len(t.sampled_tokens) and np.all(np.isfinite(lp) & (lp < 0))
        assert t.policy.version == 0
    assert res.last_eval["eval/main/vs_random/invalid_rate"] > 0.9  # evaluation sampled only
    # The trainer scores every reply as its log-probs said (the explored ones too): ratio 1.
    (train,) = [r for r in res.rows if r["kind"] == "train"]
    assert train["train/main/loss/logp_diff_max"] < 1e-3, train["train/main/loss/logp_diff_max"]


def test_an_evaluation_larger_than_the_schedulers_bound_plays_in_waves(tiny_path):
    """1,200 evaluation games at once (two policies x 12 strata x 50), more than the
    scheduler's 1,024 requests in flight: the runners play them in waves instead of the
    scheduler refusing them ``busy``, each wave one request per runner of at most what it
    plays at once (so ``runtime.timeout_s`` bounds a wave, not the whole evaluation), and the
    driver's progress counts the whole evaluation, not the wave."""
    import time

    from opentinker.progress import EpisodeFeed
    from opentinker.rollout.env_runner import SCHEDULER_EPISODES

    job = Job(_cfg(eval={"exact": False, "ratings": False}), tiny_path)
    seen: list[tuple[int, int, bool]] = []
    feed = EpisodeFeed(lambda done, total, train: seen.append((done, total, train)))
    try:
        before = job.info()
        ev = job.coordinator("evaluate", 0, False, 50, feed.endpoint)
        assert ev["eval/main/vs_random/hands"] == ev["eval/other/vs_random/hands"] == 600
        assert 2 * 600 > 1024 > SCHEDULER_EPISODES
        after = job.info()
        requests = [after[f"env_runner{i}"]["counters"]["recv/RunEpisodes"]
                    - before[f"env_runner{i}"]["counters"].get("recv/RunEpisodes", 0) for i in range(2)]
        assert requests == [3, 3]  # 600 games a runner in waves of 256
        for _ in range(200):  # the last pushes may land just after the reply
            if seen and seen[-1][0] == 1200:
                break
            time.sleep(0.01)
    finally:
        feed.close()
        job.shutdown()
    assert seen[-1] == (1200, 1200, False)
    assert {total for _, total, _ in seen} <= {600, 1200}  # one runner's part, then both: never a wave's
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)


def test_env_runners_wait_for_a_reply_as_long_as_the_job_does(job):
    """A runner's wait for one sample is ``runtime.timeout_s`` (120 here), not a fixed 900 s: a
    final evaluation given ``--timeout 3600`` failed on a runner's 900 s wait."""
    assert job._runner_kwargs(0)["sample_timeout_s"] == 120
    assert job._handles["env_runner0"].obj.sample_timeout_s == 120  # the local backend builds it in-process
