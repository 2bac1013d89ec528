"""An exploring seat's reply (``sampling.explore``: a legal move given, not drawn, with the
policy's log-probs of it) scored two ways, in one run on one machine, over the replies of a
tic-tac-toe step (``shared_forward.py``'s batch: ``--groups`` x ``--group_size`` episodes with
the brief messages, or ``--trajectories <run>/trajectories/<policy>.jsonl --step N``, a
recorded step):

* ``dense`` (the baseline, what the runner did before): a ``LogprobsRequest`` of the whole
  conversation up to the reply, every token of it computed again;
* ``forced``: a ``SampleRequest`` with the reply as ``forced``: an engine row that finds its
  conversation's earlier turns in the prefix cache, computes the new observation and the
  reply, and leaves them cached for the seat's next turn;
* ``forced, a turn's rows together``: every episode's reply of one turn in one engine call (the
  runner's exploring rows share steps with the drawn ones).

Replies go turn by turn over the episodes, as the runner plays them; each way scores every
learner reply of the step once. The table gives the total and median time per reply, the
tokens computed and the ratio to ``dense``; both ways' log-probs agree (checked).

    python benchmarks/exploring_replies.py --model smollm2-135m --json out.json
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
from _args import parse_args
from _machine import script_provenance
from rich.console import Console
from rich.table import Table
from shared_forward import recorded_batch, tictactoe_batch

from opentinker.engine.host import ModelHost
from opentinker.engine.model_specs import resolve_model
from opentinker.rollout.render import ChatTokenizer
from protocols.messages import Datum, LoraSpec, SamplingParams

TOLERANCE = 1e-4
"""Largest difference between the two ways' log-probs of a reply token allowed."""


@dataclass
class Args:
    model: str = "smollm2-135m"
    groups: int = 8
    group_size: int = 4
    trajectories: str = ""
    step: int = 30
    threads: int = 2
    device: str = "cpu"
    seed: int = 0
    json: str = ""


def replies(d: Datum) -> list[tuple[int, int]]:
    """``(start, end)`` of each reply of an episode: the runs of its loss mask."""
    m = np.r_[0.0, np.asarray(d.loss_inputs["mask"]) > 0, 0.0].astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def by_turn(datums: list[Datum]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Turn ``k``'s ``(prompt_T, reply_R)`` of every episode that has a ``k``-th reply."""
    turns: list[list[tuple[np.ndarray, np.ndarray]]] = []
    for d in datums:
        tokens = np.asarray(d.tokens, dtype=np.int32)
        for k, (a, b) in enumerate(replies(d)):
            while len(turns) <= k:
                turns.append([])
            turns[k].append((tokens[:a], tokens[a:b]))
    return turns


def measure(host: ModelHost, adapter: str, turns: list[list[tuple[np.ndarray, np.ndarray]]]) -> dict:
    """Each way over every reply, turn by turn; returns their times, tokens and agreement."""
    eng = host.engine
    if eng is None:
        raise SystemExit("the forced way needs the engine's own forward (a model family it runs)")
    ways: dict[str, dict] = {w: {"times_s": [], "tokens": 0} for w in ("dense", "forced", "forced_turn")}
    worst = 0.0
    params = SamplingParams(max_tokens=max(len(r) for t in turns for _, r in t))
    # Each way starts from an empty prefix cache, so the forced ways find only what they cached.
    for way in ("dense", "forced", "forced_turn"):
        eng.retire(adapter)
        for k, turn in enumerate(turns):
            if way == "forced_turn":
                before = eng.stats.prefill_tokens + eng.stats.decode_tokens
                t0 = time.perf_counter()
                rows = host.sample([adapter] * len(turn), [p for p, _ in turn], [params] * len(turn),
                                   list(range(len(turn))), forced=[r for _, r in turn])
                ways[way]["times_s"].append((time.perf_counter() - t0) / len(turn))
                ways[way]["tokens"] += eng.stats.prefill_tokens + eng.stats.decode_tokens - before
                for (_, r), row in zip(turn, rows):
                    assert list(row.tokens) == list(r)
                continue
            for i, (prompt, reply) in enumerate(turn):
                if way == "dense":
                    t0 = time.perf_counter()
                    lp = host.logprobs(adapter, [np.concatenate([prompt, reply])], tail=len(reply))[0][-len(reply):]
                    ways[way]["times_s"].append(time.perf_counter() - t0)
                    ways[way]["tokens"] += len(prompt) + len(reply)
                    ways[way].setdefault("logprobs", []).append(lp)
                    continue
                before = eng.stats.prefill_tokens + eng.stats.decode_tokens
                t0 = time.perf_counter()
                (row,) = host.sample([adapter], [prompt], [params], [i], forced=[reply])
                ways[way]["times_s"].append(time.perf_counter() - t0)
                ways[way]["tokens"] += eng.stats.prefill_tokens + eng.stats.decode_tokens - before
                ways[way].setdefault("logprobs", []).append(row.logprobs)
    for a, b in zip(ways["dense"].pop("logprobs"), ways["forced"].pop("logprobs")):
        worst = max(worst, float(np.abs(a - b).max()))
    if worst > TOLERANCE:
        raise AssertionError(f"the forced replies' log-probs differ from the dense ones by {worst:.2e}")
    n = sum(len(t) for t in turns)
    out = {"replies": n, "turns": len(turns), "max_logprob_diff": worst, "ways": {}}
    base = sum(ways["dense"]["times_s"])
    # forced_turn holds one mean per turn: weight it by the turn's rows
    for w, r in ways.items():
        total = (sum(t * len(turn) for t, turn in zip(r["times_s"], turns)) if w == "forced_turn"
                 else sum(r["times_s"]))
        out["ways"][w] = {"total_s": total, "median_per_reply_s": statistics.median(r["times_s"]),
                          "tokens_computed": r["tokens"], "speedup": base / total}
    return out


LABELS = {"dense": "dense (LogprobsRequest)", "forced": "forced, one row", "forced_turn": "forced, a turn's rows together"}


def main() -> None:
    args = parse_args(Args, __doc__)[0]
    path = resolve_model(args.model)
    host = ModelHost(path, threads=args.threads, device=args.device)
    host.create_adapter("bench", LoraSpec(rank=8, seed=args.seed))
    tok = ChatTokenizer(path)
    datums = (recorded_batch(args.trajectories, args.step, args.seed) if args.trajectories
              else tictactoe_batch(tok, args.groups, args.group_size, args.seed))
    r = measure(host, "bench", by_turn(datums))
    r["batch"] = f"recorded step {args.step}" if args.trajectories else f"{args.groups} x {args.group_size} episodes"
    table = Table(title=f"{r['replies']} exploring tic-tac-toe replies ({r['batch']}, {r['turns']} turns), "
                        f"{args.model}: log-probs agree within {r['max_logprob_diff']:.1e}")
    for col in ("way", "total s", "median s / reply", "tokens computed", "ratio"):
        table.add_column(col, justify="right")
    for w, m in r["ways"].items():
        table.add_row(LABELS[w], f"{m['total_s']:.3f}", f"{m['median_per_reply_s']:.4f}", str(m["tokens_computed"]),
                      f"{m['speedup']:.2f}x")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, args.threads, args.device), "result": r}, f, indent=1)


if __name__ == "__main__":
    main()
