"""Requests larger than a bus server takes in one message go in slices
(:mod:`opentinker.bus.chunking`): the slicer keeps every slice within its budget, and each
sender (offline jobs, the learner, the coordinator) gets the same results from slices as from
one request (tiny-random, loopback, limits made tiny so that slicing really happens)."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq.asyncio
from conftest import DEVICE, run
from safetensors.numpy import load_file

import opentinker.bus.server as bus_server
from opentinker.bus import Client, Pusher
from opentinker.bus.chunking import (
    ENGINE_ROWS,
    LIST_SLACK,
    budget,
    measure,
    merge_forward_backward,
    split,
    split_request,
)
from opentinker.config import JobConfig
from protocols import codec
from protocols.codec import DecodeError, Limits, check_sizes, encode
from protocols.messages import (
    AdamParams,
    CreateAdapter,
    Datum,
    EpisodeSpec,
    ErrorCode,
    ForwardBackwardResult,
    LearnerStep,
    LogprobsRequest,
    LoraSpec,
    ParseOutcome,
    PolicyKind,
    PolicyRef,
    RunEpisodes,
    SamplingParams,
    SaveAdapter,
    StopReason,
    Trajectory,
    Turn,
)

TINY = Limits(max_body_bytes=1024, max_buffers=24)
"""Limits under which every sender's request of these tests needs several slices."""
BIG_RID = (1 << 63) - 1
"""The largest request id: the longest header."""


def fits(msg: msgspec.Struct, cap: Limits) -> bool:
    """Whether the server would take ``msg`` under ``cap`` (the server's own check)."""
    try:
        check_sizes(encode(msg, BIG_RID), cap)
    except DecodeError as e:
        assert e.code is ErrorCode.TOO_LARGE
        return False
    return True


MEASURED = ("learn_s", "peak_rss_mb")
"""Metrics that are measurements of this process (seconds, memory), not results."""


def close_dicts(got: dict, want: dict, rel: float = 1e-6, skip: tuple[str, ...] = ()) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if not k.endswith(skip + MEASURED) and isinstance(v, float):
            assert got[k] == pytest.approx(v, rel=rel, abs=1e-6, nan_ok=True), k


def close_weights(got: np.ndarray, want: np.ndarray, lr: float, what: str) -> None:
    """Weights after AdamW steps on gradients that are equal but for float rounding (rows
    summed in other batches): within 1e-6, but for ``1e-3 * lr`` where AdamW's step ``lr * m /
    (sqrt(v) + eps)`` magnifies the rounding of a gradient entry as small as ``eps`` (1e-8),
    whose step then lies anywhere in ``(-lr, lr)``."""
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-3 * lr, err_msg=what)
    assert np.mean(np.abs(got - want) > 1e-6) < 0.05, what  # a few entries at most


# ---------------------------------------------------------------------------------------------
# The slicer


def _random_item(rng: np.random.Generator):
    kind = rng.integers(3)
    if kind == 0:  # a sequence
        return rng.integers(0, 1 << 15, rng.integers(1, 300)).astype(np.int32)
    if kind == 1:  # a datum with some loss inputs
        n = int(rng.integers(1, 200))
        keys = [f"k{i}" * int(rng.integers(1, 4)) for i in range(int(rng.integers(1, 6)))]
        return Datum(tokens=np.zeros(n, np.int32), loss_inputs={k: rng.random(n, dtype=np.float32) for k in keys})
    seats = {f"s{i}": PolicyRef(kind=PolicyKind.ADAPTER, name="x" * int(rng.integers(1, 40))) for i in range(3)}
    return EpisodeSpec(episode_id=int(rng.integers(1 << 50)), group_id=1, game="g" * int(rng.integers(1, 60)),
                       seed=int(rng.integers(1 << 62)), seats=seats)


@pytest.mark.parametrize("seed", range(4))
def test_every_slice_is_within_its_budget_and_the_slices_are_the_items(seed: int) -> None:
    """Property test: random items (sequences, datums, episode specs) and random limits; every
    slice's message, framed with the longest header, is within margin x limits; the slices are
    the items in order; cuts fall on units and, where a slice holds ``align`` items, on
    multiples of it; and a slice cut by the budget could not have taken its successor's first
    unit but for the few bytes the size bound allows for."""
    rng = np.random.default_rng(seed)
    for _ in range(25):
        limits = Limits(max_bytes=int(rng.integers(1 << 14, 1 << 20)), max_body_bytes=int(rng.integers(2048, 1 << 14)),
                        max_buffers=int(rng.integers(8, 400)))
        unit, align = [(1, 1), (1, 8), (2, 8)][int(rng.integers(3))]

        def make(part: list) -> LogprobsRequest:
            return LogprobsRequest(adapter="a", sequences=part)  # encoded as any item list

        units = [[_random_item(rng) for _ in range(unit)] for _ in range(int(rng.integers(0, 120)))]
        items = [x for u in units if measure(make(u)).fits(budget(limits, 0.9)) for x in u]

        cap = budget(limits)
        parts = split(items, make, limits, unit=unit, align=align)
        assert [x for p in parts for x in p] == items and len(parts) >= 1
        for i, p in enumerate(parts):
            frames = encode(make(p), BIG_RID)
            cost = (len(frames[1]), len(frames) - 2, sum(map(len, frames)))
            alone = len(p) == unit  # a unit over the budget goes alone, within the limits
            top = (limits.max_body_bytes, limits.max_buffers, limits.max_bytes) if alone else (
                cap.body, cap.buffers, cap.nbytes)
            assert all(c <= t for c, t in zip(cost, top)), (cost, top)
            assert len(p) % unit == 0
            if i + 1 < len(parts) and len(p) >= align:
                assert len(p) % align == 0
            if i + 1 < len(parts) and (align == 1 or len(p) < align):  # cut by the budget: tight
                more = measure(make(p + parts[i + 1][:unit]))
                slack = LIST_SLACK + 4 * more.buffers + codec.MAX_HEADER_BYTES  # what the bound adds
                assert more.body > cap.body - slack or more.buffers > cap.buffers or more.nbytes > cap.nbytes - slack


def test_a_unit_over_the_receivers_limits_is_refused_before_sending() -> None:
    big = np.zeros(100, np.int32)
    msg = LogprobsRequest(adapter="a", sequences=[np.zeros(3, np.int32)] * 5 + [big])
    with pytest.raises(ValueError, match="item 5 .* does not fit"):
        split_request(msg, Limits(max_bytes=300))
    assert split_request(msg) == [msg]  # fits whole: the very message, no copy
    assert split_request(LogprobsRequest(adapter="a", sequences=[]), TINY) == [LogprobsRequest(adapter="a", sequences=[])]


def test_slices_of_many_sequences_are_whole_engine_batches() -> None:
    seqs = [np.arange(1, 2 + i % 9, dtype=np.int32) for i in range(5000)]
    parts = split_request(LogprobsRequest(adapter=None, sequences=seqs))
    assert not fits(LogprobsRequest(adapter=None, sequences=seqs), codec.DEFAULT_LIMITS)
    assert [len(p.sequences) for p in parts] == [2048, 2048, 904]
    assert all(len(p.sequences) % ENGINE_ROWS == 0 for p in parts[:-1])


def test_forward_backward_metrics_merge_as_the_trainer_merges_its_chunks() -> None:
    a = ForwardBackwardResult(loss=0.5, metrics={"n_tokens": 2.0, "clip_frac": 0.5, "logp_diff_max": 0.1,
                                                 "term/ppo": 0.4, "term/value": 0.1, "value/n_tokens": 1.0,
                                                 "value/value_mse": 2.0, "kl_k3/n_tokens": 2.0, "kl_k3/kl_mean": 1.0})
    b = ForwardBackwardResult(loss=0.25, metrics={"n_tokens": 6.0, "clip_frac": 0.0, "logp_diff_max": 0.3,
                                                  "term/ppo": 0.2, "term/value": 0.05, "value/n_tokens": 3.0,
                                                  "value/value_mse": 4.0, "kl_k3/n_tokens": 6.0, "kl_k3/kl_mean": 3.0})
    m = merge_forward_backward([a, b])
    assert m.loss == 0.75
    assert m.metrics == pytest.approx({"n_tokens": 8.0, "clip_frac": 0.125, "logp_diff_max": 0.3, "term/ppo": 0.6,
                                       "term/value": 0.15, "value/n_tokens": 4.0, "value/value_mse": 3.5,
                                       "kl_k3/n_tokens": 8.0, "kl_k3/kl_mean": 2.5})
    pair = merge_forward_backward([ForwardBackwardResult(loss=1.0, metrics={"n_pairs": 1.0, "reward_accuracy": 1.0}),
                                   ForwardBackwardResult(loss=1.0, metrics={"n_pairs": 3.0, "reward_accuracy": 0.0})])
    assert pair.metrics == {"n_pairs": 4.0, "reward_accuracy": 0.25}


# ---------------------------------------------------------------------------------------------
# Offline jobs: a scheduler that takes only tiny messages


def _trajectories(n_groups: int, rng: np.random.Generator) -> list[Trajectory]:
    """Per group, four trajectories of one start with rewards -1, 0, 1, 2 (preference pairs)."""
    ref = PolicyRef(kind=PolicyKind.ADAPTER, name="main", version=1)
    out = []
    for g in range(n_groups):
        for k in range(4):
            sampled = rng.integers(10, 4000, int(rng.integers(1, 5)))
            turn = Turn(obs_tokens=rng.integers(10, 4000, int(rng.integers(2, 8))).astype(np.int32),
                        sampled_tokens=sampled.astype(np.int32), sampler_logprobs=np.full(len(sampled), -3.0, np.float32),
                        policy=ref, stop_reason=StopReason.STOP, parse=ParseOutcome.OK, reward=k - 1.0)
            out.append(Trajectory(episode_id=4 * g + k, group_id=g, seat="player_0", seed=g, policy="main",
                                  turns=[turn], total_reward=k - 1.0, step=1))
    return out


def _offline(tmp_path: Path, name: str, data: str, kind: str, batch: int, steps: int,
             tiny_path: str, stop=None) -> tuple[dict, list[dict], dict]:
    from opentinker.control.runtime import Job
    from opentinker.eval.report import MetricsLog
    from opentinker.training.offline import run_offline

    cfg = msgspec.convert({
        "name": name, "game": "kuhn_poker_v0", "out_dir": str(tmp_path), "seed": 3,
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE},
        "runtime": {"backend": "local", "timeout_s": 60},
        "train": {"lr": 1e-2},
        "offline": {"kind": kind, "data": data, "steps": steps, "batch_size": batch, "min_reward": -0.5},
        "policies": [{"name": "main", "lora_rank": 2}],
    }, JobConfig)
    run_dir = tmp_path / name
    run_dir.mkdir()
    log = MetricsLog(run_dir / "metrics.jsonl", tensorboard=False)
    job = Job(cfg, tiny_path, run_dir=str(run_dir.resolve()), scheduler_only=True)
    try:
        summary = run_offline(cfg, run_dir, job.scheduler_endpoint, job.scheduler_credentials, log, stop)
    finally:
        job.shutdown()
    weights = load_file(str(run_dir / "adapters" / "main" / "adapter_model.safetensors"))
    return summary, log.rows, weights


def test_an_offline_job_asked_to_stop_ends_after_its_step_and_saves_the_adapter(tmp_path, tiny_path) -> None:
    """Ctrl-C's first press on an offline job (``stop`` says yes after step 1 of 3): no step
    after it, the adapter so far evaluated and saved, the summary saying so."""
    from opentinker.training import trajectory_log

    path = tmp_path / "main.jsonl"
    trajectory_log.append(path, _trajectories(10, np.random.default_rng(1)), "kuhn_poker_v0")
    asked = []
    summary, rows, weights = _offline(tmp_path, "stopped", str(path), "sft", 16, 3, tiny_path,
                                      stop=lambda: asked.append(1) or True)
    assert summary["stopped"] is True and summary["steps"] == 1 and len(asked) == 1
    assert [(r["step"], r["kind"]) for r in rows] == [(0, "eval"), (1, "train"), (1, "eval")]
    assert summary["last_eval"] != summary["first_eval"] and weights
    full, full_rows, _ = _offline(tmp_path, "whole", str(path), "sft", 16, 3, tiny_path, stop=lambda: False)
    assert full["stopped"] is False and full["steps"] == 3 and len(full_rows) == 5


WHOLE_BATCHES = Limits(max_body_bytes=16384, max_buffers=256)
"""Slices of 64 sft datums (2 arrays each) or 128 sequences: the engine's batches of 64 rows."""
OFFLINE = {
    # name: (kind, groups of 3 units (sft) / 6 pairs (dpo), batch size, steps, limits, bit for bit)
    "sft_tiny": ("sft", 10, 16, 2, TINY, False),
    "dpo_tiny": ("dpo", 10, 16, 2, TINY, False),
    "sft_whole_batches": ("sft", 60, 160, 2, WHOLE_BATCHES, True),
}


@pytest.mark.parametrize("case", OFFLINE)
def test_an_offline_job_on_a_scheduler_of_small_limits_learns_the_same(case, tmp_path, tiny_path, monkeypatch) -> None:
    """The same job on a scheduler of default limits (one request each) and of small ones
    (slices): the data set's losses, the steps' metrics (the gradient's norm among them) and
    the adapter are the same: to the bit where slices are whole engine batches, else within
    float rounding (see :func:`close_weights`)."""
    from opentinker.bus.sync import SyncClient
    from opentinker.training import trajectory_log

    kind, groups, batch, steps, limits, exact = OFFLINE[case]
    path = tmp_path / "main.jsonl"
    trajectory_log.append(path, _trajectories(groups, np.random.default_rng(1)), "kuhn_poker_v0")
    want, want_rows, want_w = _offline(tmp_path, "whole", str(path), kind, batch, steps, tiny_path)

    sent: dict[str, int] = {}
    request = SyncClient.request

    def counting(self, msg, *args, **kwargs):
        assert fits(msg, limits), type(msg).__name__
        sent[type(msg).__name__] = sent.get(type(msg).__name__, 0) + 1
        return request(self, msg, *args, **kwargs)

    monkeypatch.setattr(codec, "DEFAULT_LIMITS", limits)  # what senders assume a server takes
    monkeypatch.setattr(bus_server, "DEFAULT_LIMITS", limits)  # what the job's scheduler takes
    monkeypatch.setattr(SyncClient, "request", counting)
    got, got_rows, got_w = _offline(tmp_path, "sliced", str(path), kind, batch, steps, tiny_path)
    evals = 2 + (kind != "sft")  # before and after training; the reference's log-probs
    assert sent["ForwardBackward"] >= 2 * steps and sent["LogprobsRequest"] >= 2 * evals, sent
    if exact:  # batches of 160 datums as 64 + 64 + 32, 180 sequences as 128 + 52
        assert sent["ForwardBackward"] == 3 * steps and sent["LogprobsRequest"] == 2 * evals, sent
    for key in ("first_eval", "last_eval"):
        if exact:
            assert got[key] == want[key]
        else:
            close_dicts(got[key], want[key])
    assert len(got_rows) == len(want_rows) == 2 + steps
    for g, w in zip(got_rows, want_rows):
        # A preference loss's reward accuracy counts margins > 0: at the first step the policy is
        # the reference, every margin is 0 up to float rounding, and slicing the batch rounds
        # differently; the margins themselves are compared.
        close_dicts(g, w, skip=("reward_accuracy",) if g.get("step") == 1 else ())
    assert set(got_w) == set(want_w)
    for k in want_w:
        if exact:
            np.testing.assert_array_equal(got_w[k], want_w[k], err_msg=k)
        else:
            close_weights(got_w[k], want_w[k], lr=1e-2, what=k)


# ---------------------------------------------------------------------------------------------
# The learner: a GAE step (values, policy, value and KL terms) in slices


def _rollouts(policy: str, n: int) -> list[Trajectory]:
    rng = np.random.default_rng(7)
    ref = PolicyRef(kind=PolicyKind.ADAPTER, name=policy, version=0)
    out = []
    for e in range(n):
        turns = []
        for t in range(2):
            sampled = rng.integers(10, 4000, int(rng.integers(1, 4))).astype(np.int32)
            turns.append(Turn(obs_tokens=rng.integers(10, 4000, int(rng.integers(1, 5))).astype(np.int32),
                              sampled_tokens=sampled, sampler_logprobs=(-10.0 - rng.random(len(sampled))).astype(np.float32),
                              policy=ref, stop_reason=StopReason.STOP, parse=ParseOutcome.OK, reward=float(t == e % 2)))
        out.append(Trajectory(episode_id=e, group_id=e // 4, seat="player_0", seed=e, policy=policy,
                              turns=turns, total_reward=float(sum(t.reward for t in turns)), step=1))
    return out


def test_a_learner_step_in_slices_trains_as_one_request(scheduler, tmp_path, monkeypatch) -> None:
    from opentinker.training.learner import Learner

    n = 30
    loss_config = {"value": 0.5, "value_clip": 0.2, "kl_k3": 0.05}
    learners = {p: Learner(p, scheduler.endpoint, "gae", "ppo", loss_config, AdamParams(lr=0.02),
                           {"gamma": 0.9, "lam": 0.8}, game="g") for p in ("whole", "sliced")}
    sent: list[msgspec.Struct] = []
    request = Client.request

    async def spying(self, msg, *args, **kwargs):
        if self.name.startswith("learner-sliced"):
            sent.append(msg)
        return await request(self, msg, *args, **kwargs)

    monkeypatch.setattr(Client, "request", spying)

    async def body(ctx: zmq.asyncio.Context, endpoints: dict[str, tuple[str, str]]) -> dict:
        c = Client(ctx, scheduler.endpoint, name="test")
        out = {}
        try:
            for p, (ep, pull) in endpoints.items():
                await c.request(CreateAdapter(name=p, spec=LoraSpec(rank=2, seed=5, value_head=True)))
                pusher, step = Pusher(ctx, pull), Client(ctx, ep, name=f"test-{p}")
                try:
                    for t in _rollouts(p, n):
                        await pusher.send(t)
                    with monkeypatch.context() as m:
                        if p == "sliced":
                            m.setattr(codec, "DEFAULT_LIMITS", TINY)
                        reply = await step.request(LearnerStep(step=1, expected=n, timeout_s=30), 60)
                finally:
                    pusher.close()
                    step.close()
                path = str(tmp_path / p)
                await c.request(SaveAdapter(adapter=p, path=path))
                out[p] = (reply, {f"{f.name}:{k}": v for f in sorted(Path(path).glob("*.safetensors"))
                                  for k, v in load_file(str(f)).items()})
        finally:
            c.close()
        return out

    ctx = zmq.asyncio.Context()
    try:
        out = run(body(ctx, {p: ln.start() for p, ln in learners.items()}), 60)
    finally:
        for ln in learners.values():
            ln.stop()
        ctx.destroy(0)
    kinds = [type(m).__name__ for m in sent]
    assert kinds.count("ForwardBackward") > 3 and kinds.count("ValuesRequest") > 1, kinds
    assert all(fits(m, TINY) for m in sent)
    (want, want_w), (got, got_w) = out["whole"], out["sliced"]
    assert got.version == want.version == 1
    # Exact but for float rounding; a quantile and explained variance are the slices' mean.
    close_dicts(got.metrics, want.metrics, skip=("logp_diff_p95", "explained_variance"))
    assert math.isfinite(got.metrics["loss/value/explained_variance"])
    assert set(got_w) == set(want_w) and any(k.startswith("optimizer") for k in want_w)
    for k in want_w:  # the adapter, its value head and AdamW's moments
        close_weights(got_w[k], want_w[k], lr=0.02, what=k)


# ---------------------------------------------------------------------------------------------
# The coordinator: an evaluation's episodes to a runner of tiny limits, log-probs in slices


def test_an_evaluation_in_slices_plays_and_scores_the_same(scheduler, tiny_path, monkeypatch) -> None:
    from opentinker.control.coordinator import Coordinator
    from opentinker.rollout.env_runner import EnvRunner
    from opentinker.rollout.episodes import strata_episodes

    cfg = msgspec.convert({
        "game": "kuhn_poker_v0", "seed": 2, "system_prompt": "Play.",
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE},
        "runtime": {"backend": "local", "env_runners": 1, "timeout_s": 60},
        "sampling": {"max_tokens": 3},
        "eval": {"hands_per_stratum": 1, "head_to_head_per_stratum": 0, "cross_play_per_stratum": 0},
        "policies": [{"name": "main", "lora_rank": 2, "opponents": {"random": 1}}],
    }, JobConfig)
    whole = EnvRunner("runner_whole", scheduler.endpoint, tiny_path)
    with monkeypatch.context() as m:
        m.setattr(bus_server, "DEFAULT_LIMITS", TINY)
        sliced = EnvRunner("runner_sliced", scheduler.endpoint, tiny_path)
        sliced_ep = sliced.start()
    assert sliced.server.limits == TINY
    coord = Coordinator(cfg, tiny_path, scheduler.endpoint, [whole.start()], {})
    try:
        coord.start()
        specs = strata_episodes(cfg, "main", PolicyRef(kind=PolicyKind.SCRIPTED, name="random"), 2, 1 << 41)
        league0 = coord.league_state()  # the running ratings: both evaluations start from the same table
        want_eval = coord.evaluate(1, False, 1)
        want_run = coord.loop.run(coord._run(specs, 1, train=False))
        base = dict(scheduler.server.counters)

        async def to_sliced() -> None:
            for c in coord.runners:
                c.close()
            coord.runners = [Client(coord.loop.ctx, sliced_ep, name="coordinator->sliced")]

        coord.loop.run(to_sliced())
        coord.load_league_state(league0)
        with monkeypatch.context() as m:
            m.setattr(codec, "DEFAULT_LIMITS", TINY)
            got_eval = coord.evaluate(1, False, 1)
            got_run = coord.loop.run(coord._run(specs, 1, train=False))
        assert sliced.server.counters["recv/RunEpisodes"] >= 4, dict(sliced.server.counters)
        assert scheduler.server.counters["recv/LogprobsRequest"] - base.get("recv/LogprobsRequest", 0) > 2
        assert not fits(RunEpisodes(episodes=specs, sampling=SamplingParams(), system_prompt=cfg.system_prompt), TINY)
    finally:
        coord.stop()
        whole.stop()
        sliced.stop()
    assert got_run == want_run and len(got_run) == len(specs)
    close_dicts(got_eval, want_eval, skip=("timing_s/eval",))
