"""Pace of a training step through the pipeline (Ray actors and the ZeroMQ bus; the same
components in one process over the bus) against a single-process loop that calls the model
host directly (no bus, no actors, no threads), in one run on one machine.

All three play the same episodes (the job's ``train_episodes``), with the same game code
(``play_episode``), the same batching of decisions, the same learner functions and the same
model host; the ratio is the price of the runtime.

    python benchmarks/pipeline_pace.py --model smollm2-135m --steps 4 --json pace.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from learners import assemble, loss_token_count
from opentinker.config import JobConfig
from opentinker.rollout.episodes import play_episode, train_episodes
from opentinker.engine.host import ModelHost
from opentinker.engine.model_specs import resolve_model
from opentinker.rollout.render import ChatTokenizer
from opentinker.control.runtime import Job
from protocols.messages import (
    AdamParams, PolicyKind, PolicyRef, RunEpisodes, SampleResult, SamplingParams,
)


@dataclass
class Args:
    model: str = "smollm2-135m"
    steps: int = 4
    warmup: int = 1
    groups: int = 16
    group_size: int = 4
    backends: str = "single,local,ray"
    device: str = "cpu"
    json: str = ""


def parse() -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in asdict(Args()).items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    return Args(**vars(p.parse_args()))


def job_config(args: Args, backend: str) -> JobConfig:
    return msgspec.convert(
        {
            "model": {"base": args.model, "device": args.device},
            "runtime": {"backend": "local" if backend == "single" else backend},
            "train": {"groups_per_step": args.groups, "group_size": args.group_size},
            "policies": [{"name": "main", "opponents": {"random": 0.75, "self": 0.25}}],
        },
        JobConfig,
    )


class SingleProcessLoop:
    """The baseline: one process, the model host called directly, decisions of all
    episodes batched together by an in-process queue."""

    def __init__(self, cfg: JobConfig, path: str) -> None:
        self.cfg = cfg
        self.host = ModelHost(path, threads=os.cpu_count(), device=cfg.model.device)
        p = cfg.policies[0]
        self.host.create_adapter(p.name, cfg.lora_spec(p.name))
        self.tok = ChatTokenizer(path)

    async def _rollout(self, step: int):
        queue: list[tuple[PolicyRef, np.ndarray, SamplingParams, asyncio.Future]] = []

        async def sample(ref: PolicyRef, prompt: np.ndarray, params: SamplingParams) -> SampleResult:
            fut = asyncio.get_running_loop().create_future()
            queue.append((ref, prompt, params, fut))
            return await fut

        s = self.cfg.sampling
        msg = RunEpisodes(
            episodes=train_episodes(self.cfg, step),
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens),
            system_prompt=self.cfg.system_prompt, learners={"main": ""}, step=step,
        )
        games_ = asyncio.gather(*(play_episode(spec, msg, self.tok, sample) for spec in msg.episodes))
        while not games_.done():
            await asyncio.sleep(0)
            if queue:
                batch, queue[:] = list(queue), []
                adapters = [r.name if r.kind is PolicyKind.ADAPTER else None for r, *_ in batch]
                rows = self.host.sample(adapters, [b[1] for b in batch], [b[2] for b in batch], [b[2].seed for b in batch])
                for (ref, _, _, fut), row, a in zip(batch, rows, adapters):
                    fut.set_result(SampleResult(tokens=[row.tokens], logprobs=[row.logprobs], stop_reasons=[row.stop_reason],
                                                adapter_version=self.host.version(a), batch_id=0))
        return await games_

    def train_step(self, step: int) -> None:
        results = asyncio.run(self._rollout(step))
        trajectories = [t for _, ts in results for t in ts]
        tc = self.cfg.train
        datums, _, _ = assemble(trajectories, tc.advantage, tc.advantage_config())
        self.host.forward_backward("main", datums, tc.loss, tc.loss_config(), float(max(loss_token_count(datums), 1)))
        self.host.optim_step("main", AdamParams(lr=tc.lr, grad_clip=tc.grad_clip))


def measure(backend: str, args: Args, path: str) -> list[float]:
    cfg = job_config(args, backend)
    times = []
    if backend == "single":
        loop = SingleProcessLoop(cfg, path)
        step_fn = loop.train_step
        stop = lambda: None  # noqa: E731
    else:
        job = Job(cfg, path)
        step_fn = lambda s: job.coordinator("train_step", s)  # noqa: E731
        stop = job.shutdown
    try:
        for step in range(1, args.warmup + args.steps + 1):
            t = time.perf_counter()
            step_fn(step)
            if step > args.warmup:
                times.append(time.perf_counter() - t)
    finally:
        stop()
    return times


def main() -> None:
    args = parse()
    path = resolve_model(args.model)
    results: dict[str, dict] = {}
    for backend in args.backends.split(","):
        times = measure(backend, args, path)
        results[backend] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": len(times)}
        if backend == "ray":
            import ray

            ray.shutdown()
    base = results.get("single", next(iter(results.values())))["median_s"]
    table = Table(title=f"seconds per training step ({args.groups}x{args.group_size} hands, {args.model})")
    for col in ("runtime", "median", "min", "max", "vs single-process"):
        table.add_column(col, justify="right")
    names = {"single": "single-process loop (baseline)", "local": "components over the bus, one process", "ray": "Ray actors over the bus"}
    for k, r in results.items():
        r["ratio"] = r["median_s"] / base
        table.add_row(names[k], f"{r['median_s']:.2f}", f"{r['min_s']:.2f}", f"{r['max_s']:.2f}", f"{r['ratio']:.2f}x")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": asdict(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
