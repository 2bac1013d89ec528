"""PPO with a learned critic: the value head beside an adapter (created, read, trained, saved,
snapshotted, dropped), the ``values`` operation over the bus, the value loss through
``forward_backward`` (exact gradient, micro-batch split, sum of its parts), datum assembly at
the decision positions (literal token ids), and the Learner's GAE step end to end."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import zmq.asyncio
from conftest import DEVICE, run

from learners import (
    ADVANTAGES,
    assemble,
    decision_positions,
    explained_variance,
    gae_1d,
    trajectory_tokens,
)
from opentinker.engine import value_head
from opentinker.bus import Client, Pusher, RemoteError
from opentinker.config import CRITIC_ADVANTAGES, JobConfig
from protocols.messages import (
    AdamParams,
    CreateAdapter,
    Datum,
    ErrorCode,
    LearnerStep,
    LogprobsRequest,
    LoraSpec,
    ParseOutcome,
    PolicyKind,
    PolicyRef,
    StopReason,
    Trajectory,
    Turn,
    ValuesRequest,
)

CRITIC = LoraSpec(rank=4, seed=5, value_head=True)
ADAM = AdamParams(lr=0.02)


@pytest.fixture(scope="module")
def host(tiny_path):
    from opentinker.engine.host import ModelHost

    return ModelHost(tiny_path, threads=1, device=DEVICE)


def _datums(seed: int = 0, n: int = 4) -> list[Datum]:
    """``n`` two-turn datums sharing a 3-token prompt: replies at 5..7 and 10..11, the critic
    trained at the decision positions 5 and 10 (states that differ between datums) with
    targets that differ per datum."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(10, 2000, 3)
    out = []
    for i in range(n):
        tokens = np.concatenate([prompt, rng.integers(10, 2000, 9)]).astype(np.int32)
        mask = np.zeros(12, np.float32)
        mask[5:8] = mask[10:] = 1.0
        vmask = np.zeros(12, np.float32)
        vmask[[5, 10]] = 1.0
        out.append(Datum(tokens=tokens, loss_inputs={
            "mask": mask,
            "advantages": mask * np.float32((-1) ** i),
            "sampler_logprobs": mask * np.float32(-10.8),
            "value_mask": vmask,
            "value_targets": vmask * np.array([0] * 5 + [i - 1.5] + [0] * 4 + [1.0 - i] + [0], np.float32),
            "old_values": vmask * np.float32(0.1),
        }))
    return out


def _grads(host, name: str) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                      for p in host.adapters[name].params]).cpu().clone()


def _zero(host, name: str) -> None:
    for p in host.adapters[name].params:
        p.grad = None


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    scale = want.abs().max().item()
    assert scale > 0
    assert (got - want).abs().max().item() <= rel * scale


def _critic(host, name: str, steps: int = 1) -> None:
    """A critic adapter moved off its zero initialisation (head and LoRA B nonzero)."""
    host.create_adapter(name, CRITIC)
    for _ in range(steps):
        host.forward_backward(name, _datums(9), "ppo", {"value": 1.0, "value_clip": 0.0}, 20.0,
                              value_normalizer=8.0)
        host.optim_step(name, ADAM)


def _fix_old_values(host, name: str, datums: list[Datum]) -> list[Datum]:
    """``datums`` with ``old_values`` set to the critic's current values (as a learner does)."""
    values = host.values(name, [d.tokens for d in datums])
    return [Datum(tokens=d.tokens, loss_inputs={**d.loss_inputs, "old_values": v * d.loss_inputs["value_mask"]})
            for d, v in zip(datums, values)]


# ---------------------------------------------------------------------------------------------
# The value head on the host


def test_value_head_starts_at_zero_and_values_are_the_head_on_the_state_before_each_token(host) -> None:
    host.create_adapter("fresh", CRITIC)
    named = host.adapters["fresh"].named
    assert named["value_head.weight"].shape == (1, host.registry.lm_head.weight.shape[1])
    seqs = [d.tokens for d in _datums()]
    assert all(not v.any() for v in host.values("fresh", seqs))  # zero-initialised: no baseline
    host.drop_adapter("fresh")

    _critic(host, "crit_a")
    got = host.values("crit_a", seqs)
    with torch.no_grad(), host._select("crit_a"):
        for tokens, row in zip(seqs, got):
            h_T_H = host.registry.hidden(torch.as_tensor(tokens, dtype=torch.long, device=host.device)[None])[0][0]
            v_T = value_head.apply(named := host.adapters["crit_a"].named, h_T_H).cpu().numpy()
            assert row.dtype == np.float32 and row.shape == tokens.shape
            assert row[0] == 0.0  # no state precedes the first token
            np.testing.assert_allclose(row[1:], v_T[:-1], atol=1e-5)  # entry t: tokens < t
    assert np.ptp(np.concatenate(got)) > 1e-3 and named["value_head.weight"].abs().sum() > 0
    # One sequence alone gives the same values as in a batch (prefix sharing is exact).
    np.testing.assert_allclose(host.values("crit_a", seqs[2:3])[0], got[2], atol=1e-5)
    host.create_adapter("plain", LoraSpec(rank=4))
    with pytest.raises(ValueError, match="ValuesRequest: adapter 'plain' has no value head"):
        host.values("plain", seqs)
    with pytest.raises(ValueError, match="'value' loss: adapter 'plain' has no value head"):
        host.forward_backward("plain", _datums(), "ppo", {"value": 0.5}, 1.0)
    with pytest.raises(ValueError, match=r"needs \['value_mask', 'value_targets', 'old_values'\] \(has \['mask'\]\)"):
        host.forward_backward("crit_a", [Datum(tokens=d.tokens, loss_inputs={"mask": d.loss_inputs["mask"]})
                                         for d in _datums()], "value", {}, 1.0)
    for name in ("crit_a", "plain"):
        host.drop_adapter(name)


def test_value_loss_gradient_is_exact_and_reaches_the_head_and_the_lora_weights(host) -> None:
    _critic(host, "crit_g")
    state = host.adapters["crit_g"]
    datums = _datums(1)
    _zero(host, "crit_g")
    loss, metrics = host.forward_backward("crit_g", datums, "value", {"value_clip": 0.0, "coef": 0.5}, 1.0,
                                          value_normalizer=3.0)
    got = _grads(host, "crit_g")
    # The same loss written out: full forward per datum, head on h[t - 1] at the value positions.
    _zero(host, "crit_g")
    want_loss = torch.zeros(())
    from opentinker.engine.trainer import grad_on

    with host._select("crit_g"), grad_on(state):
        for d in datums:
            h_T_H = host.registry.hidden(torch.as_tensor(d.tokens, dtype=torch.long, device=host.device)[None])[0][0]
            pos = np.nonzero(d.loss_inputs["value_mask"])[0]
            v = value_head.apply(state.named, h_T_H[pos - 1])
            r = torch.as_tensor(d.loss_inputs["value_targets"][pos], device=host.device)
            term = 0.5 * 0.5 * ((v - r) ** 2).sum() / 3.0
            term.backward()
            want_loss = want_loss + term.detach().cpu()
    want = _grads(host, "crit_g")
    _close(got, want)
    assert loss == pytest.approx(want_loss.item(), rel=1e-5)
    assert metrics["n_tokens"] == 8.0 and metrics["term/value"] == pytest.approx(loss)
    lora, head = value_head.split(state.named)
    offsets = np.cumsum([0] + [p.numel() for p in state.params])
    by_name = {k: got[offsets[i]:offsets[i + 1]] for i, k in enumerate(state.named)}
    assert all(by_name[k].abs().sum() > 0 for k in head)
    assert sum(by_name[k].abs().sum().item() for k in lora if "lora_B" in k) > 0  # shared trunk
    _zero(host, "crit_g")
    host.drop_adapter("crit_g")


def test_policy_plus_value_is_the_sum_of_its_parts_and_a_split_changes_nothing(host) -> None:
    _critic(host, "crit_s")
    datums = _fix_old_values(host, "crit_s", _datums(2, n=5))
    config = {"clip_low": 0.2, "value": 0.5, "value_clip": 0.2}

    def grad(parts, loss, cfg, vnorm) -> tuple[torch.Tensor, list[dict]]:
        _zero(host, "crit_s")
        ms = [host.forward_backward("crit_s", p, loss, cfg, 25.0, chunk=2, value_normalizer=vnorm)[1] for p in parts]
        return _grads(host, "crit_s"), ms

    whole, (m,) = grad([datums], "ppo", config, 10.0)
    split, _ = grad([datums[:2], datums[2:]], "ppo", config, 10.0)
    _close(split, whole)
    policy, _ = grad([datums], "ppo", {"clip_low": 0.2}, 0.0)
    critic, _ = grad([datums], "value", {"coef": 0.5, "value_clip": 0.2}, 10.0)
    _close(policy + critic, whole)
    assert policy.abs().sum() > 0 and critic.abs().sum() > 0
    # Metrics: the policy's unprefixed, the critic's under value/, exact explained variance.
    values = host.values("crit_s", [d.tokens for d in datums])
    at = [np.nonzero(d.loss_inputs["value_mask"])[0] for d in datums]
    v_N = np.concatenate([v[p] for v, p in zip(values, at)])
    r_N = np.concatenate([d.loss_inputs["value_targets"][p] for d, p in zip(datums, at)])
    assert m["value/n_tokens"] == 10.0 and m["n_tokens"] == 25.0
    assert m["value/value_mean"] == pytest.approx(v_N.mean(), abs=1e-5)
    assert m["value/target_mean"] == pytest.approx(r_N.mean(), abs=1e-6)
    assert m["value/explained_variance"] == pytest.approx(1 - np.var(r_N - v_N) / np.var(r_N), rel=1e-4)
    assert m["value/value_clip_frac"] == 0.0  # old values are the current ones
    assert m["term/value"] == pytest.approx(0.5 * 0.5 * ((v_N - r_N) ** 2).sum() / 10.0, rel=1e-4)
    assert {"clip_frac", "approx_kl", "entropy", "logp_diff_p95", "term/ppo"} <= set(m)
    _zero(host, "crit_s")
    host.drop_adapter("crit_s")


def test_the_critic_learns_a_fixed_batch(host) -> None:
    host.create_adapter("crit_l", CRITIC)
    losses, ev = [], []
    for _ in range(8):  # value-only steps; old values refreshed each step, as a learner does
        datums = _fix_old_values(host, "crit_l", _datums(3))
        loss, m = host.forward_backward("crit_l", datums, "value", {"value_clip": 0.0}, 8.0)
        losses.append(loss)
        ev.append(m["explained_variance"])
        host.optim_step("crit_l", AdamParams(lr=0.005))
    assert losses[-1] < 0.25 * losses[0], losses
    assert ev[0] == 0.0 and ev[-1] > 0.8, ev  # a zero critic explains nothing
    host.drop_adapter("crit_l")


def test_save_and_load_keep_the_value_head_and_its_moments(host, tmp_path) -> None:
    _critic(host, "crit_o", steps=2)
    path = tmp_path / "ckpt"
    assert host.save("crit_o", str(path)) == 2
    assert {p.name for p in path.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                               "value_head.safetensors", "optimizer.safetensors",
                                               "opentinker.json"}
    assert host.load(str(path), "crit_c") == 2 and host.adapters["crit_c"].spec.value_head
    seqs = [d.tokens for d in _datums(4)]
    for a, b in zip(host.values("crit_c", seqs), host.values("crit_o", seqs), strict=True):
        np.testing.assert_array_equal(a, b)
    for name in ("crit_o", "crit_c"):  # equal after one more step only if the moments came back
        host.forward_backward(name, _datums(5), "ppo", {"value": 1.0}, 20.0, value_normalizer=8.0)
        host.optim_step(name, ADAM)
    for key, p in host.adapters["crit_o"].named.items():
        torch.testing.assert_close(host.adapters["crit_c"].named[key], p, rtol=0, atol=0)
    assert host.adapters["crit_o"].optimizer.state[host.adapters["crit_o"].named["value_head.weight"]]
    (path / "value_head.safetensors").unlink()
    with pytest.raises(ValueError, match="missing value_head.safetensors"):
        host.load(str(path), "crit_broken")
    assert "crit_broken" not in host.adapters
    for name in ("crit_o", "crit_c"):
        host.drop_adapter(name)


def test_a_snapshot_keeps_its_critic_and_a_drop_frees_it(host) -> None:
    _critic(host, "crit_src")
    seqs = [d.tokens for d in _datums(6)]
    before = host.values("crit_src", seqs)
    assert host.snapshot("crit_src", "crit_snap") == 1
    _critic_step = host.forward_backward("crit_src", _datums(7), "value", {"value_clip": 0.0}, 8.0)
    host.optim_step("crit_src", ADAM)
    after = host.values("crit_src", seqs)
    assert max(np.abs(a - b).max() for a, b in zip(after, before)) > 1e-4
    for a, b in zip(host.values("crit_snap", seqs), before, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="'crit_snap' is frozen"):
        host.forward_backward("crit_snap", _datums(), "value", {}, 1.0)
    head = host.adapters["crit_snap"].named["value_head.weight"]
    host.drop_adapter("crit_snap")
    assert all(p is not head for s in host.adapters.values() for p in s.params)
    with pytest.raises(ValueError, match="unknown adapter 'crit_snap'"):
        host.values("crit_snap", seqs)
    host.drop_adapter("crit_src")


# ---------------------------------------------------------------------------------------------
# Assembly at the decision positions (literal token ids)


def _turn(obs: list[int], sampled: list[int], reward: float = 0.0) -> Turn:
    return Turn(obs_tokens=np.array(obs, np.int32), sampled_tokens=np.array(sampled, np.int32),
                sampler_logprobs=np.full(len(sampled), -1.0, np.float32),
                policy=PolicyRef(kind=PolicyKind.ADAPTER, name="main", version=0),
                stop_reason=StopReason.STOP, parse=ParseOutcome.OK, reward=reward)


def _traj(episode_id: int, turns: list[Turn], total: float, seat: str = "player_0") -> Trajectory:
    return Trajectory(episode_id=episode_id, group_id=0, seat=seat, seed=episode_id, policy="main",
                      turns=turns, total_reward=total)


def test_gae_assembly_reads_values_at_the_decision_positions() -> None:
    # tokens 11 12 13 | 14 15 | 16 | 17 18 19: turn 0 decides at 3, turn 1 at 6.
    two = _traj(7, [_turn([11, 12, 13], [14, 15], reward=0.5), _turn([16], [17, 18, 19])], total=2.0)
    one = _traj(3, [_turn([21, 22], [23])], total=-1.0)
    assert trajectory_tokens(two).tolist() == [11, 12, 13, 14, 15, 16, 17, 18, 19]
    assert decision_positions(two).tolist() == [3, 6] and decision_positions(one).tolist() == [2]
    values = [np.arange(9, dtype=np.float32) * 10.0, np.array([5.0, 6.0, 7.0], np.float32)]  # given order
    datums, metrics, _ = assemble([two, one], "gae", {"gamma": 0.5, "lam": 0.5}, values=values)
    d_one, d_two = datums  # sorted by episode id
    # Trajectory 7: rewards [0.5, 1.5] (the rest of the total lands on the last turn), V = [30, 60, 0].
    d1 = 1.5 + 0.5 * 0.0 - 60.0
    d0 = 0.5 + 0.5 * 60.0 - 30.0
    a = [d0 + 0.25 * d1, d1]
    li = d_two.loss_inputs
    assert li["value_mask"].tolist() == [0, 0, 0, 1, 0, 0, 1, 0, 0]
    assert li["old_values"].tolist() == [0, 0, 0, 30, 0, 0, 60, 0, 0]
    np.testing.assert_allclose(li["value_targets"][[3, 6]], [a[0] + 30.0, a[1] + 60.0], rtol=1e-6)
    np.testing.assert_allclose(li["advantages"], np.array([0, 0, 0, a[0], a[0], 0, a[1], a[1], a[1]]), rtol=1e-6)
    assert li["mask"].tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1]
    # Trajectory 3: one turn deciding at 2, V = [7, 0]: A = -1 - 7, target -1.
    assert d_one.loss_inputs["old_values"].tolist() == [0, 0, 7]
    assert d_one.loss_inputs["value_targets"].tolist() == [0, 0, -1]
    assert d_one.loss_inputs["advantages"].tolist() == [0, 0, -8]
    assert metrics["n_value_positions"] == 3.0
    with pytest.raises(ValueError, match="values of shape"):
        assemble([two, one], "gae", {}, values=values[::-1])
    with pytest.raises(ValueError, match="needs critic values"):
        assemble([two], "gae", {})
    with pytest.raises(ValueError, match="turn 0: no sampled tokens"):
        decision_positions(_traj(1, [_turn([1, 2], [])], 0.0))


def test_exact_gae_takes_the_games_values_of_the_turns_and_trains_no_critic() -> None:
    """``exact_gae``: GAE over each trajectory's turns with ``Turn.game_value`` as ``V_k`` (0
    after the last turn), no value inputs on the datums; a batch with a turn the game did not
    value, or a non-finite value, is refused naming why."""
    def valued(turn: Turn, v: float | None) -> Turn:
        return msgspec.structs.replace(turn, game_value=v)

    two = _traj(7, [valued(_turn([11, 12, 13], [14, 15], reward=0.0), 0.9),
                    valued(_turn([16], [17, 18, 19]), 0.5)], total=1.0)
    one = _traj(3, [valued(_turn([21, 22], [23]), 0.25)], total=-1.0)  # an invalid reply: -1 at once
    for lam, a7 in ((0.0, [0.5 - 0.9, 1.0 - 0.5]), (1.0, [1.0 - 0.9, 1.0 - 0.5])):
        datums, metrics, _ = assemble([two, one], "exact_gae", {"gamma": 1.0, "lam": lam})
        d_one, d_two = datums
        np.testing.assert_allclose(d_two.loss_inputs["advantages"], [0, 0, 0, a7[0], a7[0], 0, a7[1], a7[1], a7[1]],
                                   rtol=1e-6)
        np.testing.assert_allclose(d_one.loss_inputs["advantages"], [0, 0, -1.25])
        assert "value_mask" not in d_two.loss_inputs and "n_value_positions" not in metrics
    unvalued = _traj(9, [_turn([1], [2])], total=0.0)
    with pytest.raises(ValueError, match="needs the game's exact value of every turn's state"):
        assemble([two, unvalued], "exact_gae", {})
    with pytest.raises(ValueError, match="finite game_values"):
        assemble([_traj(4, [valued(_turn([1], [2]), float("nan"))], total=0.0)], "exact_gae", {})


def test_gae_assembly_ignores_arrival_order_and_batch_split() -> None:
    rng = np.random.default_rng(3)
    trajs = [_traj(e, [_turn(rng.integers(1, 99, 3).tolist(), [5, 6], reward=0.25 * e), _turn([7], [8])],
                   total=float(e % 3) - 1.0, seat=f"player_{e % 2}") for e in range(5)]
    values = [rng.normal(size=len(trajectory_tokens(t))).astype(np.float32) for t in trajs]
    config = {"gamma": 0.9, "lam": 0.7}
    whole = assemble(trajs, "gae", config, values=values).datums
    order = [3, 0, 4, 2, 1]
    shuffled = assemble([trajs[i] for i in order], "gae", config, values=[values[i] for i in order]).datums
    parts = (assemble(trajs[:2], "gae", config, values=values[:2]).datums
             + assemble(trajs[2:], "gae", config, values=values[2:]).datums)
    for other in (shuffled, parts):  # per trajectory: no group, no batch statistics
        for a, b in zip(whole, other, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist()
            for k in a.loss_inputs:
                np.testing.assert_array_equal(a.loss_inputs[k], b.loss_inputs[k])


def test_the_config_gives_a_critic_exactly_to_critic_estimators() -> None:
    assert set(CRITIC_ADVANTAGES) == {n for n, e in ADVANTAGES.items() if e.needs_values}
    cfg = msgspec.convert({"seed": 4, "policies": [
        {"name": "ppo", "lora_rank": 2, "train": {"advantage": "gae", "lam": 0.9, "value_coef": 0.25}},
        {"name": "grpo"}]}, JobConfig)
    assert cfg.lora_spec("ppo") == LoraSpec(rank=2, alpha=16.0, seed=4, value_head=True)
    assert not cfg.lora_spec("grpo").value_head
    ppo = cfg.train_for("ppo")
    assert ppo.loss_config()["value"] == 0.25 and ppo.loss_config()["value_clip"] == 0.2
    assert ppo.advantage_config()["lam"] == 0.9
    assert "value" not in cfg.train_for("grpo").loss_config()


# ---------------------------------------------------------------------------------------------
# Over the bus: the values operation, and a Learner's GAE step


def _on_policy(traj: Trajectory, logprobs_T: np.ndarray) -> Trajectory:
    """``traj`` with each turn's sampler log-probs set to the trainer's (ratios of 1)."""
    turns, at = [], 0
    for turn in traj.turns:
        at += len(turn.obs_tokens)
        turns.append(msgspec.structs.replace(turn, sampler_logprobs=logprobs_T[at : at + len(turn.sampled_tokens)]))
        at += len(turn.sampled_tokens)
    return msgspec.structs.replace(traj, turns=turns)


def test_values_over_the_bus_and_a_learner_gae_step(scheduler) -> None:
    from opentinker.training.learner import Learner

    gamma, lam = 1.0, 0.0  # targets r_k + V_{k+1}: they depend on the values read
    learner = Learner("ppo_v", scheduler.endpoint, "gae", "ppo", {"value": 1.0, "value_clip": 0.0},
                      AdamParams(lr=0.02), {"gamma": gamma, "lam": lam}, game="g")
    rng = np.random.default_rng(0)

    def trajectories(step: int) -> list[Trajectory]:
        out = []
        for e in range(3):
            turns = [_turn(rng.integers(10, 2000, 4).tolist(), rng.integers(10, 2000, 2).tolist(), reward=e * 0.5),
                     _turn(rng.integers(10, 2000, 2).tolist(), rng.integers(10, 2000, 3).tolist())]
            out.append(Trajectory(episode_id=step * 10 + e, group_id=e, seat="player_0", seed=e, policy="ppo_v",
                                  turns=turns, total_reward=e - 1.0, step=step))
        return out

    async def body(ctx: zmq.asyncio.Context, endpoints: tuple[str, str]) -> tuple:
        c = Client(ctx, scheduler.endpoint, name="test")
        pusher = Pusher(ctx, endpoints[1])
        step_client = Client(ctx, endpoints[0], name="test-step")
        errors, results = [], []
        try:
            await c.request(CreateAdapter(name="ppo_v", spec=CRITIC))
            await c.request(CreateAdapter(name="plain_v", spec=LoraSpec(rank=4)))
            for adapter in ("plain_v", "nope"):
                try:
                    await c.request(ValuesRequest(adapter=adapter, sequences=[np.arange(1, 5, dtype=np.int32)]))
                except RemoteError as e:
                    errors.append((e.error.code, e.error.message))
            for step in (1, 2):
                trajs = trajectories(step)
                seqs = [trajectory_tokens(t) for t in trajs]
                values = (await c.request(ValuesRequest(adapter="ppo_v", sequences=seqs))).values
                lp = (await c.request(LogprobsRequest(adapter="ppo_v", sequences=seqs))).logprobs
                trajs = [_on_policy(t, row) for t, row in zip(trajs, lp)]
                for t in trajs:
                    await pusher.send(t)
                reply = await step_client.request(LearnerStep(step=step, expected=len(trajs), timeout_s=60), 120)
                results.append((trajs, values, reply))
        finally:
            for closable in (c, pusher, step_client):
                closable.close()
        return errors, results

    ctx = zmq.asyncio.Context()
    try:
        errors, results = run(body(ctx, learner.start()))
    finally:
        learner.stop()
        ctx.destroy(0)
    assert [code for code, _ in errors] == [ErrorCode.INVALID, ErrorCode.NOT_FOUND]
    assert "adapter 'plain_v' has no value head" in errors[0][1] and "unknown adapter 'nope'" in errors[1][1]
    assert all(not v.any() for v in results[0][1])  # a fresh critic: zero
    for trajs, values, reply in results:
        m = reply.metrics
        want_v, want_r = [], []
        for t, v in zip(trajs, values):
            at = decision_positions(t)
            rewards = np.array([turn.reward for turn in t.turns])
            rewards[-1] += t.total_reward - rewards.sum()
            _, targets = gae_1d(rewards, np.append(v[at], 0.0), gamma, lam)
            want_v += v[at].tolist()
            want_r += targets.tolist()
        want_v, want_r = np.array(want_v), np.array(want_r)
        assert m["n_value_positions"] == m["loss/value/n_tokens"] == 6.0
        assert m["loss/value/value_mean"] == pytest.approx(want_v.mean(), abs=1e-5)
        assert m["loss/value/target_mean"] == pytest.approx(want_r.mean(), abs=1e-5)
        assert m["loss/term/value"] == pytest.approx(0.5 * np.mean((want_v - want_r) ** 2), rel=1e-4)
        assert m["loss/value/explained_variance"] == pytest.approx(explained_variance(
            torch.as_tensor(want_v), torch.as_tensor(want_r)), abs=1e-4)
        assert m["loss/logp_diff_max"] < 1e-4 and m["loss/clip_frac"] == 0.0
    assert results[1][2].version == 2
    assert np.ptp(np.concatenate([v[decision_positions(t)] for t, v in zip(results[1][0], results[1][1])])) > 0


def test_normalized_advantages_are_standardised_over_the_batch_and_targets_stay_raw() -> None:
    from learners import standardize

    rng = np.random.default_rng(5)
    trajs = [_traj(e, [_turn([1, 2], [5, 6], reward=0.5 * e), _turn([7], [8])], total=float(e % 3) - 1.0,
                   seat=f"player_{e % 2}") for e in range(6)]
    values = [rng.normal(size=len(trajectory_tokens(t))).astype(np.float32) for t in trajs]
    config = {"gamma": 0.9, "lam": 0.7}
    raw = assemble(trajs, "gae", config, values=values)
    norm = assemble(trajs, "gae", {**config, "normalize": 1.0}, values=values)

    def turn_advantages(datums):  # one value per turn: at its decision position
        return np.concatenate([d.loss_inputs["advantages"][d.loss_inputs["value_mask"] > 0] for d in datums])

    a, n = turn_advantages(raw.datums), turn_advantages(norm.datums)
    np.testing.assert_allclose(n, (a - a.mean()) / a.std(), rtol=1e-5, atol=1e-6)
    assert abs(norm.metrics["adv_mean"]) < 1e-6 and abs(raw.metrics["adv_mean"]) > 1e-3
    for r, m in zip(raw.datums, norm.datums):  # the critic's targets come from the raw advantages
        np.testing.assert_array_equal(r.loss_inputs["value_targets"], m.loss_inputs["value_targets"])
    # Order-free (exactly rounded sums); an all-equal batch is only centred.
    x, y = np.array([0.1, 0.7, 1e8]), np.array([0.2, -1e8, 0.3])
    one, other = standardize([x, y]), standardize([y, x])
    assert one[0].tolist() == other[1].tolist() and one[1].tolist() == other[0].tolist()
    assert [x.tolist() for x in standardize([np.array([2.0, 2.0]), np.array([2.0])])] == [[0.0, 0.0], [0.0]]
    cfg = msgspec.convert({"train": {"advantage": "gae", "normalize_advantages": True}}, JobConfig)
    assert cfg.train.advantage_config()["normalize"] == 1.0 and "normalize" not in JobConfig().train.advantage_config()
