"""One RL loop on one page: GRPO on the default job's two-seat card game against the random
player, top to bottom in the order a training step runs, with only the public API: the Python client's ``sample``,
``forward_backward`` and ``optim_step`` (:mod:`opentinker.client`), a PettingZoo game
(:mod:`games`), and an advantage and a loss from :mod:`learners`.

    python -m opentinker.rl_loop                     # tiny-random: a few seconds a step
    python -m opentinker.rl_loop --model smollm2-135m --steps 30 --lr 2e-4

``opentinker run`` does the same with more around it: episodes of many env runners in flight
at once, learners and a coordinator as Ray actors, leagues, evaluation, checkpoints, resume.
"""

from __future__ import annotations

import argparse

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

import games
import learners
from opentinker.client import ServiceClient, TrainingClient
from opentinker.config import JobConfig
from opentinker.rollout.render import ChatTokenizer, SeatRenderer
from protocols.messages import (
    AdamParams,
    ParseOutcome,
    PolicyKind,
    PolicyRef,
    SamplingParams,
    StopReason,
    Trajectory,
    Turn,
)

GAME = JobConfig().game
"""The default job's game (``--game`` plays another two-seat game of ``games``)."""


def play(policy: TrainingClient, tok: ChatTokenizer, game: str, deal: int, seat: int, ids: tuple[int, int, int],
         params: SamplingParams) -> tuple[Trajectory, int]:
    """One hand: the policy in ``seat``, the random player in the other; its trajectory (the
    seat's turns: observation tokens, then the reply as sampled with its log-probs) and the
    number of replies the game could not read (each one forfeits the hand)."""
    env = games.make(game)
    env.reset(seed=deal)  # the cards: the same deal for a whole group
    seat = env.possible_agents[seat]
    episode, group, step = ids
    opponent, rng = games.make_scripted("random"), np.random.default_rng(episode)
    seat_view = SeatRenderer(tok, games.evaluation(game).system_prompt)
    me = PolicyRef(kind=PolicyKind.ADAPTER, name=policy.name)
    turns: list[Turn] = []
    invalid = 0
    for agent in env.agent_iter(max_iter=100):
        obs, _, done, cut, info = env.last()
        if done or cut:
            env.step(None)
            continue
        if agent != seat:
            env.step(opponent.act(obs["text"], info, rng))
        else:
            # The prompt is the seat's whole conversation so far: a turn adds only its delta.
            new_obs = seat_view.observe(obs["text"])
            seed = episode * 1000 + len(turns)  # a row's tokens depend on its seed alone
            row = policy.sample([seat_view.prompt()], msgspec.structs.replace(params, seed=seed)).result()
            reply, stop = row.tokens[0], row.stop_reasons[0]
            seat_view.add_reply(reply, stop is StopReason.STOP)
            before = env.unwrapped.invalid_counts.get(seat, 0)
            env.step(tok.decode(reply))
            bad = env.unwrapped.invalid_counts.get(seat, 0) > before
            invalid += bad
            # Log-probs as sampled: the importance-sampling loss weighs by trainer / sampler.
            turns.append(Turn(obs_tokens=new_obs, sampled_tokens=np.asarray(reply, np.int32),
                              sampler_logprobs=np.asarray(row.logprobs[0], np.float32),
                              policy=msgspec.structs.replace(me, version=row.adapter_version), stop_reason=stop,
                              parse=ParseOutcome.INVALID if bad else ParseOutcome.OK))
        if turns and env.rewards.get(seat):  # won or lost, on whichever move it fell
            turns[-1] = msgspec.structs.replace(turns[-1], reward=turns[-1].reward + float(env.rewards[seat]))
    total = sum(t.reward for t in turns)
    return Trajectory(episode_id=episode, group_id=group, seat=seat, seed=deal, policy=policy.name, turns=turns,
                      total_reward=total, step=step), invalid


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random", help="model spec: tiny-random, smollm2-135m, a folder")
    p.add_argument("--game", default=GAME, help="a two-seat game of games")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--groups", type=int, default=4, help="groups a step; a group shares its deal")
    p.add_argument("--group_size", type=int, default=4, help="hands a group (GRPO compares them)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # One base model, one LoRA adapter on it: sampling and training share the scheduler.
    service = ServiceClient(model=args.model)
    rows: list[dict[str, float]] = []
    try:
        policy = service.create_lora_training_client("main", rank=8, seed=args.seed)
        tok = ChatTokenizer(service.model_path)
        params = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(tok.eos_id,))
        for step in range(1, args.steps + 1):
            # 1. Rollout: every hand with the adapter as it is now (on-policy).
            trajectories, invalid, turns = [], 0, 0
            for g in range(args.groups):
                deal = args.seed * 10**6 + step * 1000 + g
                for e in range(args.group_size):
                    episode = (step * args.groups + g) * args.group_size + e
                    seat = g % 2  # groups alternate seats: both roles learnt
                    traj, bad = play(policy, tok, args.game, deal, seat, (episode, g, step), params)
                    if traj.turns:
                        trajectories.append(traj)
                        invalid, turns = invalid + bad, turns + len(traj.turns)
            # 2. Advantages: each hand's reward minus its group's mean (GRPO); then datums:
            #    tokens with mask 1 on the replies, advantages and sampler log-probs per token.
            batch = learners.assemble(trajectories, "grpo", {})
            # 3. The update: gradient of the importance-sampling loss summed over reply tokens,
            #    divided by their count, then one AdamW step (the adapter's version goes up).
            fb = policy.forward_backward(batch.datums, "importance_sampling")
            opt = policy.optim_step(AdamParams(lr=args.lr))
            fb_result, opt_result = fb.result(), opt.result()
            rows.append({"step": step, "reward": batch.metrics["reward_mean"], "invalid": invalid / max(turns, 1),
                         "loss": fb_result.loss, "grad_norm": opt_result.grad_norm, "version": opt_result.version})
    finally:
        service.close()
    hook = games.evaluation(args.game)
    table = Table(title=f"GRPO on {args.game} against random, {args.model}")
    for col in ("step", f"reward ({hook.unit}/{hook.per})", "invalid replies", "loss", "grad norm", "version"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["step"]), f"{r['reward']:+.3f}", f"{100 * r['invalid']:.0f}%", f"{r['loss']:+.4f}",
                      f"{r['grad_norm']:.3g}", str(r["version"]))
    Console().print(table)
    return rows


if __name__ == "__main__":
    main()
