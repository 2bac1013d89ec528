"""Training log-probs three ways on the same batch, in one run on one machine: a plain padded
batch (what a PEFT training loop does), the three shared levels (common prefix, distinct
contexts, deduplicated tails: what PEFT's model gets) and the prefix tree (every distinct
prefix token once: the engine's own decoder), on two batches:

* ``kuhn``: ``--rows`` first Kuhn poker decisions with replies the model samples (one turn each:
  the three levels already share everything there is to share);
* ``tictactoe``: ``--groups`` x ``--group_size`` tic-tac-toe episodes as a step plays them, the
  brief messages rendered as the runner does: a group shares its start (the opponent's first
  move), the learner's seat plays its group's favourite cell seven times in ten and a random
  empty one otherwise, so episodes share their first turns and part ways later, as a learning
  policy's do. ``--trajectories <run>/trajectories/<policy>.jsonl --step N`` replays a recorded
  step's episodes instead.

All three compute the same loss and gradients (checked here); the table gives the time of one
``forward_backward`` (importance-sampling loss) and its ratio to the plain batch.

    python benchmarks/shared_forward.py --model smollm2-135m --json out.json
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from _args import parse_args
from _machine import script_provenance
from games import kuhn_poker, tictactoe
from opentinker.engine.host import ModelHost
from opentinker.engine.model_specs import resolve_model
from opentinker.engine.shared_forward import token_tree
from opentinker.rollout.render import ChatTokenizer, SeatRenderer
from protocols.messages import Datum, LoraSpec, SamplingParams


@dataclass
class Args:
    model: str = "smollm2-135m"
    rows: int = 64
    groups: int = 8
    group_size: int = 4
    trajectories: str = ""
    step: int = 10
    batches: str = "kuhn,tictactoe"
    repeats: int = 3
    threads: int = 2
    device: str = "cpu"
    seed: int = 0
    json: str = ""


def parse() -> Args:
    return parse_args(Args, __doc__)[0]


def kuhn_batch(host: ModelHost, tok: ChatTokenizer, rows: int, seed: int) -> list[Datum]:
    """``rows`` datums: first decisions at random information states, replies sampled from the
    model itself (so the batch has the reply diversity of early training)."""
    rng = np.random.default_rng(seed)
    dialogues = kuhn_poker.decision_dialogues()
    prompts, renderers = [], []
    for _ in range(rows):
        d = dialogues[int(rng.integers(len(dialogues)))]
        r = SeatRenderer(tok, "You are a poker player.")
        for obs, reply in zip(d.observations[:-1], d.replies):
            r.observe(obs)
            r.add_reply(tok.encode(reply) + [tok.eos_id], True)
        r.observe(d.observations[-1])
        prompts.append(r.prompt())
        renderers.append(r)
    params = SamplingParams(max_tokens=6, stop_token_ids=(tok.eos_id,))
    sampled = host.sample(["bench"] * rows, prompts, [params] * rows, list(range(seed, seed + rows)))
    datums = []
    for prompt, s in zip(prompts, sampled):
        tokens = np.concatenate([prompt, s.tokens]).astype(np.int32)
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(s.tokens))].astype(np.float32)
        lp = np.r_[np.zeros(len(prompt)), s.logprobs].astype(np.float32)
        datums.append(Datum(tokens=tokens, loss_inputs={"mask": mask, "advantages": mask * rng.normal(), "sampler_logprobs": lp}))
    return datums


def tictactoe_batch(tok: ChatTokenizer, groups: int, group_size: int, seed: int) -> list[Datum]:
    """``groups`` x ``group_size`` episodes (module docstring): the learner's replies are the
    loss tokens, each a cell digit and the end-of-turn token."""
    rng = np.random.default_rng(seed)
    datums = []
    for g in range(groups):
        seat = tictactoe.AGENTS[g % 2]
        favourite = rng.permutation(9) + 1  # the group's preference order over cells
        opening = int(rng.integers(1, 10))
        for _ in range(group_size):
            env = tictactoe.env(brief=True)
            env.reset(seed=seed + g)
            r = SeatRenderer(tok, "You are playing tic-tac-toe.")
            mask: list[float] = []
            for agent in env.agent_iter(max_iter=20):
                if env.terminations[agent] or env.truncations[agent]:
                    env.step(None)
                    continue
                board = env.infos[agent]["infostate"]
                empty = tictactoe.empty_cells(board)
                if agent == seat:
                    obs = r.observe(env.observe(agent)["text"])
                    best = next(c for c in favourite if c in empty)
                    move = best if rng.random() < 0.7 else int(rng.choice(empty))
                    reply = tok.encode(str(move)) + [tok.eos_id]
                    r.add_reply(reply, True)
                    mask += [0.0] * len(obs) + [1.0] * len(reply)
                else:  # the opponent: its opening, then the lowest optimal cell
                    move = opening if len(empty) == 9 else tictactoe.minimax_move(board, tictactoe.to_move(board))
                env.step(str(move))
            tokens = r.prompt()
            m = np.zeros(len(tokens), np.float32)
            m[len(tokens) - len(mask):] = mask
            datums.append(_datum(tokens, m, float(rng.normal())))
    return datums


def recorded_batch(path: str, step: int, seed: int) -> list[Datum]:
    """A recorded step's episodes (``trajectories/<policy>.jsonl``), random advantages."""
    from learners.assembly import trajectory_to_datum
    from opentinker.training.trajectory_log import from_record, read

    rng = np.random.default_rng(seed)
    trajs = [from_record(r) for r in read(path) if r.step == step]
    if not trajs:
        raise SystemExit(f"{path} holds no episodes of step {step}")
    return [trajectory_to_datum(t, float(rng.normal())) for t in trajs]


def _datum(tokens: np.ndarray, mask: np.ndarray, adv: float) -> Datum:
    return Datum(tokens=tokens.astype(np.int32),
                 loss_inputs={"mask": mask, "advantages": mask * adv, "sampler_logprobs": mask * -1.0})


METHODS = {
    "plain": "plain padded batch (what a PEFT training loop does)",
    "levels": "shared prefix, distinct contexts, deduplicated tails (PEFT's model)",
    "tree": "prefix tree: every distinct prefix token once (the engine's decoder)",
}


def timed(host: ModelHost, datums: list[Datum], method: str, repeats: int) -> tuple[list[float], float, torch.Tensor]:
    """``repeats`` timings of one ``forward_backward`` over ``datums``, its loss and gradient."""
    tree = host.inference.tree
    host.inference.share_prefix = method != "plain"
    host.inference.tree = tree if method == "tree" else None
    times, loss, grad = [], 0.0, torch.zeros(0)
    normalizer = float(sum(d.loss_inputs["mask"].sum() for d in datums))
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            loss, _ = host.forward_backward("bench", datums, "importance_sampling", {}, normalizer)
            times.append(time.perf_counter() - t)
            grad = torch.cat([p.grad.flatten() for p in host.adapters["bench"].params]).cpu().clone()
            host.discard_gradients("bench")
    finally:
        host.inference.tree = tree
    return times, loss, grad


def measure(host: ModelHost, name: str, datums: list[Datum], repeats: int) -> dict:
    """Every method on one batch; raises if a method's loss or gradient differs from plain's."""
    if host.inference.tree is None:
        raise SystemExit(f"{host.model_path} runs on PEFT's model here: no prefix-tree forward to compare")
    out: dict = {"batch": name, "rows": len(datums), "tokens": sum(len(d.tokens) for d in datums),
                 "tree_tokens": len(token_tree([d.tokens for d in datums]).ids_N), "methods": {}}
    ref = None
    for method, label in METHODS.items():
        times, loss, grad = timed(host, datums, method, repeats)
        if ref is None:
            ref = (loss, grad)
        rel = float((grad - ref[1]).abs().max() / ref[1].abs().max())
        if abs(loss - ref[0]) > 1e-4 or rel > 1e-3:
            raise AssertionError(f"{name}: {method} gives loss {loss} (plain {ref[0]}), relative gradient difference {rel}")
        out["methods"][method] = {"label": label, "median_s": statistics.median(times), "times_s": times, "loss": loss,
                                  "max_grad_rel_diff": rel}
    plain = out["methods"]["plain"]["median_s"]
    for m in out["methods"].values():
        m["speedup"] = plain / m["median_s"]
    return out


def main() -> None:
    args = parse()
    path = resolve_model(args.model)
    host = ModelHost(path, threads=args.threads, device=args.device)
    host.create_adapter("bench", LoraSpec(rank=8))
    tok = ChatTokenizer(path)
    results = []
    for name in [b for b in args.batches.split(",") if b]:
        if name == "kuhn":
            datums = kuhn_batch(host, tok, args.rows, args.seed)
        elif name == "tictactoe" and args.trajectories:
            datums = recorded_batch(args.trajectories, args.step, args.seed)
        elif name == "tictactoe":
            datums = tictactoe_batch(tok, args.groups, args.group_size, args.seed)
        else:
            raise SystemExit(f"unknown batch {name!r}: kuhn or tictactoe")
        r = measure(host, f"{name}, recorded step {args.step}" if name == "tictactoe" and args.trajectories else name,
                    datums, args.repeats)
        results.append(r)
        table = Table(title=f"forward_backward on {r['rows']} {name} sequences ({r['tokens']} tokens, "
                            f"{r['tree_tokens']} distinct prefixes), {args.model}")
        for col in ("method", "median s", "ratio"):
            table.add_column(col, justify="right")
        for m in r["methods"].values():
            table.add_row(m["label"], f"{m['median_s']:.3f}", f"{m['speedup']:.2f}x")
        Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, args.threads, args.device), "batches": results}, f, indent=1)


if __name__ == "__main__":
    main()
