"""The rollout phase of a multi-turn game (negotiation) and of the default job (Kuhn poker):
today's path (``ModelHost(engine="peft")``: whole-request PEFT batches, every prompt prefilled
in full) against the engine (``ModelHost(engine="own")``: continuous batching over a
prefix-reusing KV cache), the same episodes and seeds, in one run on one machine.

Each job is a bundled config (``opentinker/configs/<job>.toml``). Both paths play the job's
training episodes of steps 1..``--steps`` (``train_episodes(cfg, step)``: the coordinator's
episodes, hence the same deals, seats, opponents and sampling seeds) with the single-process
loop of ``benchmarks/pipeline_pace.py``: every episode runs at once (``play_episode``, the env
runners' code) and each round of pending decisions, of all seats of all episodes, goes to the
host as one ``sample`` call; a round waits for the call to finish, on both paths alike. Before
every step the job's policy adapters are created fresh (LoRA B = 0, so the policy is the base
model; the engine forgets their cached prefixes, as after an optimizer step). Only the rollout
is timed (no training); per step the two paths take turns going first, so a change in the
machine's load hits both alike. Both hosts are warmed up first with one tiny untimed call.

Tokens per LLM turn (means over every turn of every step):

* ``prefill_tokens_per_turn``: prompt tokens whose KV is computed. Engine: the deltas of its
  ``stats.prefill_tokens`` (cached prefixes excluded) / turns. Before: PEFT prefills every
  prompt in full, except that rows of one ``sample`` call with the same adapter and the same
  prompt share one prefill; counted as the sum of the lengths of the distinct (adapter,
  prompt) rows of each call (the left padding to the call's longest prompt, which PEFT also
  computes, is left out of it: ``padded_prefill_tokens_per_turn`` includes it).
* ``new_tokens_per_turn``: from the prompts and replies themselves: a seat's first turn counts
  its whole prompt; a later turn the prompt tokens not in the seat's previous prompt + reply,
  plus 1 for the last sampled token of that reply, whose KV is never computed (the prompt
  length minus its common prefix with the previous prompt + reply, that prefix less its last
  token): what an exact prefix cache with one-token blocks would prefill.
* ``prefill_over_new``: the ratio of the two (the issue's target for the engine: at most 1.2).

    python benchmarks/rollout.py --json rollout.json          # smollm2-135m, 2 steps per job
    python benchmarks/rollout.py --quick                      # tiny-random, 1 step of 4 episodes
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from _args import parse_args
from _machine import machine as machine_info, script_provenance
from opentinker.config import JobConfig, load_config
from opentinker.engine.host import ModelHost
from opentinker.engine.model_specs import resolve_model
from opentinker.rollout.episodes import game_agents, play_episode, sample_seed, train_episodes
from opentinker.rollout.render import ChatTokenizer
from protocols.messages import EpisodeSpec, PolicyKind, PolicyRef, RunEpisodes, SampleResult, SamplingParams

PATHS = {"before": "peft", "engine": "own"}
"""Row name -> ``ModelHost(engine=...)``."""
ENGINE_STATS = ("prefill_tokens", "prompt_tokens", "cached_tokens", "twin_tokens", "decode_tokens", "steps")


@dataclass
class Args:
    model: str = "smollm2-135m"
    jobs: str = "default,negotiation"
    steps: int = 2
    groups: int = 0
    """Groups of episodes per step; 0: the job's ``train.groups_per_step``."""
    group_size: int = 0
    """Episodes per group; 0: the job's ``train.group_size``."""
    threads: int = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    device: str = "cpu"
    quick: bool = False
    json: str = ""


QUICK = {"model": "tiny-random", "steps": 1, "groups": 2, "group_size": 2}
"""What ``--quick`` changes (flags given explicitly win)."""


def parse() -> Args:
    return parse_args(Args, __doc__, QUICK)[0]


def job_config(args: Args, job: str) -> JobConfig:
    """The bundled job ``job`` on ``args.model`` and ``args.device``, with the episode counts
    of ``args`` where given."""
    train = {k: v for k, v in (("groups_per_step", args.groups), ("group_size", args.group_size)) if v}
    return load_config(job, {"model": {"base": args.model, "device": args.device}, "train": train})


# ------------------------------------------------------------------------------ one path

@dataclass
class Tally:
    """Token counts of one path over its timed steps."""

    times: list[float] = field(default_factory=list)
    episodes: int = 0
    turns: int = 0
    seats: int = 0
    prompt_tokens: int = 0
    reply_tokens: int = 0
    new_tokens: int = 0
    calls: int = 0
    peft_prefill: int = 0
    peft_padded: int = 0
    engine: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENGINE_STATS, 0))


class Rollout:
    """One path: a model host, and the single-process rollout loop of ``pipeline_pace.py``."""

    def __init__(self, path: str, cfg: JobConfig, model_path: str, tok: ChatTokenizer, threads: int) -> None:
        m = cfg.model
        self.path, self.cfg, self.tok = path, cfg, tok
        self.host = ModelHost(model_path, device=m.device, threads=threads, engine=PATHS[path],
                              engine_options={"kv_budget_bytes": m.kv_budget_mb << 20, "block_size": m.kv_block_size,
                                              "max_batch_tokens": m.max_batch_tokens})
        self.host.sample([None], [np.asarray(tok.encode("warm up"), dtype=np.int32)],
                         [SamplingParams(max_tokens=2)], [0])  # untimed warm-up
        self.tally = Tally()

    def fresh_adapters(self) -> None:
        for p in self.cfg.policies:
            if p.name in self.host.adapters:
                self.host.drop_adapter(p.name)
            self.host.create_adapter(p.name, self.cfg.lora_spec(p.name))

    async def _play(self, msg: RunEpisodes, turns: dict, calls: list) -> None:
        queue: list[tuple[PolicyRef, np.ndarray, SamplingParams, asyncio.Future]] = []

        async def sample(ref: PolicyRef, prompt: np.ndarray, params: SamplingParams) -> SampleResult:
            fut = asyncio.get_running_loop().create_future()
            queue.append((ref, prompt, params, fut))
            return await fut

        games_ = asyncio.gather(*(play_episode(spec, msg, self.tok, sample) for spec in msg.episodes))
        while not games_.done():
            await asyncio.sleep(0)
            if queue:
                batch, queue[:] = list(queue), []
                adapters = [r.name if r.kind is PolicyKind.ADAPTER else None for r, *_ in batch]
                prompts = [b[1] for b in batch]
                rows = self.host.sample(adapters, prompts, [b[2] for b in batch], [b[2].seed for b in batch])
                calls.append((adapters, prompts))
                for (ref, prompt, params, fut), row, a in zip(batch, rows, adapters):
                    turns[params.seed] = (prompt, row.tokens)
                    fut.set_result(SampleResult(tokens=[row.tokens], logprobs=[row.logprobs], stop_reasons=[row.stop_reason],
                                                adapter_version=self.host.version(a), batch_id=0))
        await games_

    def step(self, step: int) -> None:
        """Play step ``step``'s episodes (timed) and add its counts to the tally."""
        cfg, s = self.cfg, self.cfg.sampling
        self.fresh_adapters()
        msg = RunEpisodes(
            episodes=train_episodes(cfg, step),
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens),
            system_prompt=cfg.system_prompt, learners={p.name: "" for p in cfg.policies}, step=step,
        )
        turns: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        calls: list[tuple[list, list]] = []
        eng = self.host.engine
        before = {k: getattr(eng.stats, k) for k in ENGINE_STATS} if eng is not None else {}
        t = time.perf_counter()
        asyncio.run(self._play(msg, turns, calls))
        self.tally.times.append(time.perf_counter() - t)
        tl = self.tally
        if eng is not None:
            for k in ENGINE_STATS:
                tl.engine[k] += getattr(eng.stats, k) - before[k]
        tl.episodes += len(msg.episodes)
        tl.calls += len(calls)
        for adapters, prompts in calls:
            distinct = {(a, np.asarray(p).tobytes()): len(p) for a, p in zip(adapters, prompts)}
            tl.peft_prefill += sum(distinct.values())
            tl.peft_padded += len(distinct) * max(len(p) for p in prompts)
        count_turns(msg.episodes, turns, tl)


def count_turns(specs: list[EpisodeSpec], turns: dict[int, tuple[np.ndarray, np.ndarray]], tl: Tally) -> None:
    """Walk every seat's turns in order (a turn is found by its sampling seed, a function of
    (episode, seat, turn)) and add its prompt, reply and new tokens to ``tl``."""
    found = 0
    for spec in specs:
        for i, _ in enumerate(game_agents(spec.game, spec.game_kwargs)):
            prev: np.ndarray | None = None
            t = 0
            while (key := sample_seed(spec.seed, spec.episode_id, i, t)) in turns:
                prompt, reply = (np.asarray(x, dtype=np.int64) for x in turns[key])
                if prev is None:
                    new = len(prompt)
                else:
                    m = min(len(prev), len(prompt))
                    diff = np.flatnonzero(prev[:m] != prompt[:m])
                    common = int(diff[0]) if diff.size else m
                    new = len(prompt) - min(common, len(prev) - 1)  # the last sampled token's KV is never computed
                tl.new_tokens += new
                tl.prompt_tokens += len(prompt)
                tl.reply_tokens += len(reply)
                prev = np.concatenate([prompt, reply])
                t += 1
            found += t
            tl.seats += t > 0
    assert found == len(turns), f"{len(turns) - found} sampled turns belong to no seat of the step's episodes"
    tl.turns += found


def row_of(r: Rollout, args: Args) -> dict:
    tl, cfg = r.tally, r.cfg
    n = max(tl.turns, 1)
    row = {
        "path": r.path, "game": cfg.game, "job": cfg.name, "model": args.model, "host_engine": PATHS[r.path],
        "steps": len(tl.times), "episodes": tl.episodes, "llm_seats": tl.seats, "llm_turns": tl.turns,
        "sample_calls": tl.calls, "s_per_step": statistics.median(tl.times) if tl.times else None,
        "step_s": tl.times, "prompt_tokens": tl.prompt_tokens, "reply_tokens": tl.reply_tokens,
        "new_tokens": tl.new_tokens, "prompt_tokens_per_turn": tl.prompt_tokens / n,
        "reply_tokens_per_turn": tl.reply_tokens / n, "new_tokens_per_turn": tl.new_tokens / n,
    }
    if r.host.engine is not None:
        e = tl.engine
        assert e["prompt_tokens"] == tl.prompt_tokens and e["decode_tokens"] == tl.reply_tokens, (e, tl)
        row["prefill_tokens"] = e["prefill_tokens"]
        row["engine_stats"] = dict(e)
        row["prefill_how"] = "engine stats.prefill_tokens deltas (prompt tokens computed, cached prefixes excluded)"
    else:
        row["prefill_tokens"] = tl.peft_prefill
        row["padded_prefill_tokens"] = tl.peft_padded
        row["padded_prefill_tokens_per_turn"] = tl.peft_padded / n
        row["prefill_how"] = ("sum of the prompt lengths of the distinct (adapter, prompt) rows of each sample call "
                              "(PEFT shares their prefill); left padding excluded")
    row["prefill_tokens_per_turn"] = row["prefill_tokens"] / n
    row["prefill_over_new"] = row["prefill_tokens"] / tl.new_tokens if tl.new_tokens else None
    return row


# ------------------------------------------------------------------------------ the run

def add_speedups(rows: list[dict]) -> None:
    """``speedup`` of every row: its job's ``before`` s/step over its own (before: 1)."""
    base = {r["job"]: r["s_per_step"] for r in rows if r["path"] == "before"}
    for r in rows:
        b = base.get(r["job"])
        r["speedup"] = b / r["s_per_step"] if b and r["s_per_step"] else None


def table(args: Args, rows: list[dict], machine: dict) -> Table:
    t = Table(title=f"rollout phase, {args.model}, {args.steps} step(s) per job, {args.threads} threads "
                    f"({machine['cpu']}, {machine['cpu_capability']})")
    for col in ("job (game)", "path", "episodes/step", "LLM turns/step", "s/step", "speedup", "prompt tok/turn",
                "prefill tok/turn", "new tok/turn", "prefill / new"):
        t.add_column(col, justify="left" if col in ("job (game)", "path") else "right")
    fmt = lambda x, f: "" if x is None else format(x, f)  # noqa: E731
    for r in rows:
        steps = max(r["steps"], 1)
        t.add_row(f"{r['job']} ({r['game']})", r["path"], f"{r['episodes'] / steps:.0f}", f"{r['llm_turns'] / steps:.1f}",
                  fmt(r["s_per_step"], ".2f"), fmt(r["speedup"], ".2f") + ("x" if r["speedup"] else ""),
                  f"{r['prompt_tokens_per_turn']:.1f}", f"{r['prefill_tokens_per_turn']:.1f}",
                  f"{r['new_tokens_per_turn']:.1f}", fmt(r["prefill_over_new"], ".2f"))
    return t


def main() -> None:
    args = parse()
    model_path = resolve_model(args.model)
    machine = machine_info(args.threads, args.device)
    tok = ChatTokenizer(model_path)
    rows: list[dict] = []
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 150)

    def write(current: list[Rollout]) -> list[dict]:
        # After every step of every path: a killed run keeps what it measured.
        out = rows + [row_of(r, args) for r in current]
        add_speedups(out)
        if args.json:
            Path(args.json).write_text(json.dumps({"provenance": script_provenance(args, args.threads, args.device), "args": asdict(args), "rows": out}, indent=1))
        return out

    for job in args.jobs.split(","):
        cfg = job_config(args, job)
        paths = [Rollout(p, cfg, model_path, tok, args.threads) for p in PATHS]
        for step in range(1, args.steps + 1):
            for r in paths if step % 2 else paths[::-1]:  # take turns going first
                console.log(f"{cfg.name} step {step}: {r.path}")
                r.step(step)
                write(paths)
        rows = write(paths)
        del paths
        gc.collect()
    console.print(table(args, rows, machine))
    print("Episodes: train_episodes(cfg, step) of each job, the same on both paths; every episode plays at once, each "
          "round of pending decisions is one host.sample call (pipeline_pace.py's single-process loop); only the "
          "rollout is timed.")
    print("prefill: engine = its stats.prefill_tokens (cached prefixes excluded); before = the prompt lengths of the "
          "distinct (adapter, prompt) rows of each call (PEFT prefills each in full; left padding not counted). "
          "new = prompt tokens not in the seat's previous prompt + reply, + 1 (the last sampled token); a seat's "
          "first turn: its whole prompt. Target: engine prefill / new <= 1.2.")


if __name__ == "__main__":
    main()
