"""Exact tic-tac-toe results of trained adapters, without sampling noise: each seat's win, draw
and loss probabilities against random and against minimax, read from the policy's own move
probabilities at every history it reaches (:func:`games.tictactoe.exact_outcomes`), and the
decisions where it puts probability on a cell worth less against best play than the best one.

A sampled evaluation of 120 games a side has a 95% interval of about ±0.13 and cannot say
whether a policy that drew 92 of 120 games against minimax loses as X, as O, or where. Here
the policy at a decision is its probability of each empty cell's digit as the reply's first
token (the seat's whole conversation so far as the prompt, at the run's sampling temperature),
renormalised over the empty cells (``legal_mass`` is the share it puts on them at all: the rest
is an invalid reply, which a game forfeits); a history the policy's own choices reach with
probability below ``--prune`` is not followed (``unresolved``), every reply of the opponent's is.

    python benchmarks/tictactoe_exact.py runs/tictactoe_v0__tictactoe__0__* --json out.json
    python benchmarks/tictactoe_exact.py base --model tiny-random --quick
"""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import _machine  # noqa: F401  # isort: skip  (before torch)
import numpy as np
import torch
from _args import parse_args
from _jobs import write_result
from _machine import script_provenance
from rich.console import Console
from rich.table import Table

from games import tictactoe
from games.evaluation import record_decision
from opentinker.engine.model_specs import resolve_model
from opentinker.eval.evaluation import decision_prompt
from opentinker.rollout.render import ChatTokenizer

OPPONENTS = {"random": "random", "minimax": "tictactoe_minimax"}


@dataclass
class Args:
    paths: str = "base"
    """Comma-separated: run folders (config.toml and adapters/<policy>, or a stopped run's
    newest checkpoint), adapter folders, or ``base`` (the untrained model)."""
    labels: str = ""
    """Comma-separated names of the paths in the table and JSON (default: each folder's name)."""
    policy: str = "main"
    """The policy of a run folder to score."""
    model: str = "smollm2-135m"
    """Base model (a run folder's own ``model.base`` wins)."""
    temperature: float = 0.0
    """Sampling temperature of the scored policy; 0: the run's (1 for an adapter or the base)."""
    opponents: str = "minimax,random"
    prune: float = 1e-3
    batch: int = 32
    threads: int = 0
    quick: bool = False
    json: str = ""


def _target(path: str, policy: str, model: str) -> tuple[str, str | None, str, float, str]:
    """``(label, adapter folder or None, base model, run temperature, system prompt)``."""
    if path == "base":
        return "base", None, model, 1.0, tictactoe.EVALUATION.system_prompt
    folder = Path(path)
    if (folder / "config.toml").is_file():
        cfg = tomllib.loads((folder / "config.toml").read_text())
        if cfg.get("game") != "tictactoe_v0":
            raise SystemExit(f"{folder} is a run of {cfg.get('game')!r}, not tictactoe_v0")
        if cfg.get("game_kwargs", {}).get("brief") is not True:
            raise SystemExit(f"{folder}: only the brief messages are scored here (game_kwargs.brief = true)")
        adapter = folder / "adapters" / policy
        if not (adapter / "adapter_config.json").is_file():  # a run stopped early: its newest checkpoint
            steps = sorted((int(c.name.removeprefix("step_")), c) for c in folder.glob("checkpoints/step_*")
                           if c.name.removeprefix("step_").isdigit()
                           and (c / "adapters" / policy / "adapter_config.json").is_file())
            if not steps:
                raise SystemExit(f"{folder} has no saved adapter of policy {policy!r} (adapters/{policy} or a "
                                 f"checkpoint's)")
            adapter = steps[-1][1] / "adapters" / policy
        return (folder.name, str(adapter), cfg.get("model", {}).get("base", model),
                float(cfg.get("sampling", {}).get("temperature", 1.0)), cfg.get("system_prompt", ""))
    if (folder / "adapter_config.json").is_file():
        return folder.name, str(folder), model, 1.0, tictactoe.EVALUATION.system_prompt
    raise SystemExit(f"{path}: neither a run folder (config.toml) nor an adapter folder (adapter_config.json) nor 'base'")


class ModelPolicy:
    """A :data:`games.tictactoe.Policy` from a causal LM: each history's prompt is the seat's
    conversation as the runner renders it (brief messages), scored in left-padded batches."""

    def __init__(self, model: torch.nn.Module, tok: ChatTokenizer, system_prompt: str, agent: str,
                 temperature: float, batch: int) -> None:
        self.model, self.tok, self.system_prompt, self.agent = model, tok, system_prompt, agent
        self.temperature, self.batch = temperature, batch
        self.digits = {str(c): tok.encode(str(c)) for c in range(1, 10)}
        if any(len(ids) != 1 for ids in self.digits.values()):
            raise SystemExit("the tokenizer does not spell each cell digit as one token")
        self.legal_mass: list[float] = []

    def prompt(self, history: tuple[str, ...], board: str, legal: Sequence[str]) -> np.ndarray:
        """``int32[T]``: the seat's conversation up to its decision after ``history`` (``board``
        the board it leads to, ``legal`` its empty cells as replies)."""
        env = tictactoe.env(brief=True)
        env.reset(seed=0)
        return decision_prompt(self.tok, self.system_prompt,
                               record_decision(env, board, self.agent, 0, history, legal))

    def __call__(self, histories: Sequence[tuple[str, ...]]) -> list[dict[str, float]]:
        boards = [tictactoe.board_after(h) for h in histories]
        legal = [[str(c) for c in tictactoe.empty_cells(b)] for b in boards]
        prompts = [self.prompt(h, b, cells) for h, b, cells in zip(histories, boards, legal)]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # little padding per batch
        out: list[dict[str, float] | None] = [None] * len(histories)
        for k in range(0, len(order), self.batch):
            part = order[k:k + self.batch]
            width = max(len(prompts[i]) for i in part)
            ids = torch.full((len(part), width), self.tok.pad_id, dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            for row, i in enumerate(part):  # left-padded: every prompt ends at the last column
                ids[row, width - len(prompts[i]):] = torch.from_numpy(prompts[i].astype(np.int64))
                mask[row, width - len(prompts[i]):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
            probs = torch.softmax(logits.float() / self.temperature, dim=-1)
            for row, i in enumerate(part):
                raw = {m: float(probs[row, self.digits[m][0]]) for m in legal[i]}
                total = sum(raw.values())
                self.legal_mass.append(total)
                out[i] = {m: v / total for m, v in raw.items()}
        return out  # type: ignore[return-value]


def score(label: str, adapter: str | None, base: str, temperature: float, system_prompt: str,
          args: Args, console: Console) -> dict:
    """Every (opponent, seat) of one policy: outcomes, the seat-balanced score, blunders."""
    from transformers import AutoModelForCausalLM

    tok = ChatTokenizer(resolve_model(base))
    model = AutoModelForCausalLM.from_pretrained(resolve_model(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    meta = Path(adapter or "") / "opentinker.json"
    version = json.loads(meta.read_text()).get("version") if adapter and meta.is_file() else None
    row: dict = {"label": label, "adapter": adapter, "version": version, "base": base, "temperature": temperature,
                 "opponents": {}}
    for name in args.opponents.split(","):
        if name not in OPPONENTS:
            raise SystemExit(f"--opponents: {name!r} is not one of {', '.join(OPPONENTS)}")
        seats = {}
        for agent in tictactoe.AGENTS:
            t0 = time.perf_counter()
            policy = ModelPolicy(model, tok, system_prompt, agent, temperature, args.batch)
            res = tictactoe.exact_outcomes(agent, OPPONENTS[name], policy, prune=args.prune)
            bad = [d for d in res.decisions if d[2] >= 0.5]
            seats[agent] = {
                "win": res.win, "draw": res.draw, "loss": res.loss, "unresolved": res.unresolved, "score": res.score,
                "decisions": len(res.decisions), "blunder_decisions": len(bad),
                "blunder_reach": sum(d[1] for d in bad),
                "legal_mass": float(np.mean(policy.legal_mass)) if policy.legal_mass else None,
                "worst": [{"history": "".join(h), "board": tictactoe.board_after(h), "reach": r, "blunder": b}
                          for h, r, b in res.blunders(8)],
                "seconds": time.perf_counter() - t0,
            }
            console.print(f"  {label} vs {name} as {agent}: win {res.win:.3f} draw {res.draw:.3f} loss {res.loss:.3f}"
                          f" (unresolved {res.unresolved:.3f}; {len(res.decisions)} decisions, "
                          f"{seats[agent]['seconds']:.0f} s)")
        row["opponents"][name] = {"score": float(np.mean([s["score"] for s in seats.values()])),
                                  "draw": float(np.mean([s["draw"] for s in seats.values()])), "seats": seats}
    return row


def main() -> None:
    args, _ = parse_args(Args, __doc__, quick={"opponents": "minimax", "prune": 0.05})
    if not 0 <= args.prune < 1:
        raise SystemExit(f"--prune must be in [0, 1), got {args.prune}")
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0 (0: the run's), got {args.temperature}")
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    paths = args.paths.split(",")
    labels = args.labels.split(",") if args.labels else [None] * len(paths)
    if len(labels) != len(paths):
        raise SystemExit(f"--labels names {len(labels)} paths, --paths has {len(paths)}")
    rows = []
    for path, name in zip(paths, labels):
        label, adapter, base, run_temp, system_prompt = _target(path, args.policy, args.model)
        label = name or label
        temperature = args.temperature or run_temp
        rows.append(score(label, adapter, base, temperature, system_prompt, args, console))
    table = Table(title="Exact tic-tac-toe results (seat-balanced: the mean of X and O)")
    for col in ("policy", "version", "vs", "score", "X win/draw/loss", "O win/draw/loss", "blunder decisions X/O"):
        table.add_column(col)
    for r in rows:
        for name, o in r["opponents"].items():
            x, oo = o["seats"]["player_x"], o["seats"]["player_o"]
            table.add_row(r["label"], str(r["version"] or "-"), name, f"{o['score']:+.3f}", f"{x['win']:.2f}/{x['draw']:.2f}/{x['loss']:.2f}",
                          f"{oo['win']:.2f}/{oo['draw']:.2f}/{oo['loss']:.2f}",
                          f"{x['blunder_decisions']}/{oo['blunder_decisions']}")
    console.print(table)
    if args.json:
        write_result({"provenance": script_provenance(args, torch.get_num_threads()), "rows": rows}, args.json)
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
