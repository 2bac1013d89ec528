"""Offline jobs (``[offline]`` in a job config): SFT or DPO/IPO on trajectories a run recorded,
or SFT on a scripted seat's play.

No model plays. The job reads ``trajectories/<policy>.jsonl`` files
(:mod:`opentinker.training.trajectory_log`), or has the scripted seat ``offline.scripted`` play
the game (:mod:`opentinker.training.scripted_data`: the same trajectories a learner's seat
gives, its replies the loss tokens), builds SFT sequences or preference pairs with the pure
functions of :mod:`learners.offline`, starts only the scheduler, and trains the first policy's
adapter through it (``CreateAdapter``, then ``ForwardBackward`` with the ``sft`` / ``dpo`` /
``ipo`` loss and ``OptimStep`` per step, then ``SaveAdapter``), exactly as online learners do.

Before the first step and after the last, the loss on the WHOLE data set is measured from
``LogprobsRequest`` s (the adapter's log-probs, and the base model's as the preference
reference), with the same loss functions: ``metrics.jsonl`` rows of kind ``eval``, so "did it
learn" is one comparison, not a noisy per-batch curve.

Requests larger than the scheduler takes in one message (the whole data set's sequences, a
large batch's datums) go in slices (:mod:`opentinker.bus.chunking`), a pair's datums in one
slice, every slice of a batch with the batch's normalizer: the results are those of one request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learners import (
    compute_loss,
    loss_token_count,
    pair_datums,
    preference_pairs,
    sft_datums,
)
from opentinker.bus import SyncClient
from opentinker.bus.auth import Credentials
from opentinker.bus.chunking import request_split
from opentinker.config import JobConfig
from opentinker.eval.report import MetricsLog
from opentinker.machine import commit_record, git_commit, job_machine
from opentinker.training import trajectory_log
from opentinker.training.scripted_data import scripted_trajectories
from protocols.messages import (
    AdamParams,
    CreateAdapter,
    Datum,
    ForwardBackward,
    ForwardBackwardResult,
    LogprobsRequest,
    LogprobsResult,
    LoraSpec,
    Message,
    OptimStep,
    OptimStepResult,
    SaveAdapter,
)


def training_units(cfg: JobConfig) -> tuple[list[list[Datum]], int]:
    """The data of an offline job: units of one datum (``sft``) or of a chosen and a rejected
    datum (``dpo``, ``ipo``), and the number of trajectories read.

    Raises:
        ValueError: no usable data (naming the file and why), or a malformed file.
    """
    oc = cfg.offline_job()
    assert oc is not None
    if oc.scripted:
        trajectories = scripted_trajectories(cfg)
    else:
        trajectories = [trajectory_log.from_record(r) for r in trajectory_log.read(oc.data)]
    if oc.kind == "sft":
        units = [[d] for d in sft_datums(trajectories, oc.min_reward)]
        why = f"no trajectory with total reward > {oc.min_reward}"
    else:
        datums = pair_datums(preference_pairs(trajectories))
        units = [datums[i : i + 2] for i in range(0, len(datums), 2)]
        why = "no two trajectories of one start (group, seed, seat) with different rewards"
    if not units:
        raise ValueError(f"offline {oc.kind}: {why} in {oc.source()} ({len(trajectories)} trajectories)")
    return units, len(trajectories)


def renumber_pairs(datums: Sequence[Datum]) -> list[Datum]:
    """Datums of consecutive pairs (chosen, rejected) with ``pair_id`` set to the pair's
    position in this batch, so a pair that occurs twice counts twice."""
    out = []
    for k, d in enumerate(datums):
        mask = np.asarray(d.loss_inputs["mask"], np.float32)
        inputs = {**d.loss_inputs, "pair_id": (mask * np.float32(k // 2)).astype(np.float32)}
        out.append(Datum(tokens=d.tokens, loss_inputs=inputs))
    return out


def batches(n_units: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` batches of unit indices: epochs of seeded permutations, read in order."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, 17])
    stream: list[int] = []
    while len(stream) < steps * min(batch_size, n_units):
        stream += rng.permutation(n_units).tolist()
    size = min(batch_size, n_units)
    return [stream[i * size : (i + 1) * size] for i in range(steps)]


def dataset_loss(
    kind: str, units: Sequence[Sequence[Datum]], policy_lp: Sequence[np.ndarray],
    ref_lp: Sequence[np.ndarray], loss_config: dict[str, float],
) -> dict[str, float]:
    """The loss of the whole data set from teacher-forced log-probs (one row per datum, in
    unit order): the registered loss on the flat loss tokens, over the job's normalizer."""
    datums = [d for unit in units for d in unit]
    picks = [np.asarray(d.loss_inputs["mask"]) != 0 for d in datums]
    logp_N = torch.as_tensor(np.concatenate([lp[m] for lp, m in zip(policy_lp, picks, strict=True)]))
    inputs = {k: torch.as_tensor(np.concatenate([np.asarray(d.loss_inputs[k])[m] for d, m in zip(datums, picks)]))
              for k in datums[0].loss_inputs if k != "mask"}
    if kind != "sft":
        inputs["ref_logprobs"] = torch.as_tensor(np.concatenate([lp[m] for lp, m in zip(ref_lp, picks)]))
    out = compute_loss(kind, logp_N, inputs, loss_config)
    normalizer = len(units) if kind != "sft" else loss_token_count(datums)
    return {"loss": out.loss_sum.item() / normalizer, **out.metrics}


def run_offline(cfg: JobConfig, run_dir: Path, endpoint: str, credentials: Credentials | None,
                log: MetricsLog, stop: Callable[[], bool] | None = None,
                commit: tuple[str, bool] | None = None) -> dict[str, Any]:
    """Train ``cfg.policies[0]`` offline on the scheduler at ``endpoint`` (started for the job
    by its driver, :func:`opentinker.run.run_job`), presenting ``credentials``; write
    ``metrics.jsonl`` rows and the adapter under ``run_dir``. Returns the summary (also written
    to ``summary.json``).

    ``stop`` (Ctrl-C's first press, :class:`~opentinker.interrupt.StopOnInterrupt`) is asked
    after every step: when it says yes the steps end there, and the adapter so far is
    evaluated and saved as at the end; the summary's ``steps`` says how many ran and
    ``stopped`` that it ended early.

    The summary records the ``machine`` and the code as a run's does: ``commit`` (the
    checkout's when the job opened, ``commit``, from :func:`~opentinker.machine.git_commit`;
    now when not given), ``dirty``, and ``commit_at_end`` when the checkout moved meanwhile."""
    commit = commit or git_commit()
    oc = cfg.offline_job()
    assert oc is not None
    t0 = time.perf_counter()
    units, n_trajectories = training_units(cfg)
    policy = cfg.policies[0]
    tc = cfg.train_for(policy.name)
    loss_config = {"sft": {}, "dpo": {"beta": oc.beta}, "ipo": {"tau": oc.tau}}[oc.kind]
    adam = AdamParams(lr=tc.lr, weight_decay=tc.weight_decay, grad_clip=tc.grad_clip)
    timeout = cfg.runtime.timeout_s
    name = policy.name
    with SyncClient(endpoint, "offline", credentials=credentials) as client:
        def ask(msg: Message, unit: int = 1) -> Message:
            """``msg``'s reply, sent in slices the scheduler takes (a pair's datums together)."""
            return request_split(lambda m: client.request(m, timeout), msg, unit)

        spec = LoraSpec(rank=policy.lora_rank, alpha=policy.lora_alpha,
                        target_modules=tuple(policy.target_modules), seed=cfg.seed, full=policy.kind == "full")
        client.request(CreateAdapter(name=name, spec=spec), timeout)
        seqs = [d.tokens for unit in units for d in unit]
        ref_lp = []
        if oc.kind != "sft":
            ref = ask(LogprobsRequest(adapter=None, sequences=seqs))
            assert isinstance(ref, LogprobsResult)
            ref_lp = ref.logprobs

        def evaluate(step: int) -> dict[str, float]:
            res = ask(LogprobsRequest(adapter=name, sequences=seqs))
            assert isinstance(res, LogprobsResult)
            m = dataset_loss(oc.kind, units, res.logprobs, ref_lp, loss_config)
            row = {f"eval/{name}/{oc.kind}/{k}": v for k, v in m.items()}
            log.write(step, "eval", row)
            return row

        first = evaluate(0)
        done, stopped = 0, False
        for step, index in enumerate(batches(len(units), oc.batch_size, oc.steps, cfg.seed), 1):
            batch = [d for i in index for d in units[i]]
            if oc.kind != "sft":  # a unit drawn twice (across an epoch) is two pairs, not one
                batch = renumber_pairs(batch)
            normalizer = float(len(index) if oc.kind != "sft" else loss_token_count(batch))
            t_step = time.perf_counter()
            # The normalizer is the whole batch's: the slices' gradients add up to the batch's.
            fb = ask(ForwardBackward(adapter=name, datums=batch, loss=oc.kind, loss_config=loss_config,
                                     normalizer=normalizer), len(units[0]))
            opt = client.request(OptimStep(adapter=name, params=adam), timeout)
            assert isinstance(fb, ForwardBackwardResult) and isinstance(opt, OptimStepResult)
            log.write(step, "train", {
                f"train/{name}/loss": fb.loss, f"train/{name}/grad_norm": opt.grad_norm,
                f"train/{name}/version": opt.version, f"train/{name}/learn_s": time.perf_counter() - t_step,
                **{f"train/{name}/loss/{k}": v for k, v in fb.metrics.items()},
            })
            done = step
            if stop is not None and stop() and step < oc.steps:
                stopped = True
                break
        last = evaluate(done)
        path = str((run_dir / "adapters" / name).resolve())
        client.request(SaveAdapter(adapter=name, path=path), timeout)
    summary = {
        "kind": oc.kind, "data": oc.source(), "trajectories": n_trajectories,
        "units": len(units), "first_eval": first, "last_eval": last, "adapters": {name: path},
        "steps": done, "stopped": stopped,
        "wall_s": time.perf_counter() - t0,
        "machine": job_machine(cfg.model), **commit_record(commit),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
