"""One end-to-end path through Ray: every component its own process; samples and
trajectories on the bus; the driver's Ray calls per training step do not grow with the
number of episodes per step."""

from __future__ import annotations

import os

import msgspec
import pytest

from opentinker.config import JobConfig
from opentinker.control.runtime import Job

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _cfg(groups: int) -> JobConfig:
    return msgspec.convert(
        {
            "model": {"base": "tiny-random", "threads": 1},
            "runtime": {"backend": "ray", "env_runners": 2, "timeout_s": 120},
            "train": {"groups_per_step": groups, "group_size": 2},
            "sampling": {"max_tokens": 3},
            "policies": [{"name": "main", "opponents": {"random": 1, "self": 1}}],
        },
        JobConfig,
    )


def test_ray_job_processes_and_constant_ray_calls(ray_session, tiny_path):
    per_step = {}
    for groups in (1, 6):
        job = Job(_cfg(groups), tiny_path)
        try:
            info = job.info()
            pids = {name: i["pid"] for name, i in info.items()}
            assert len(set(pids.values())) == len(pids) == 5  # scheduler, 2 runners, learner, coordinator
            assert os.getpid() not in pids.values()
            calls0 = job.ray_calls()
            samples0 = info["scheduler"]["counters"].get("recv/SampleRequest", 0)
            steps = 2
            metrics = [job.coordinator("train_step", s) for s in range(1, steps + 1)]
            info = job.info()
            per_step[groups] = (job.ray_calls() - calls0) / steps
            samples = info["scheduler"]["counters"].get("recv/SampleRequest", 0) - samples0
            episodes = sum(m["train/episodes"] for m in metrics)
            assert episodes == steps * groups * 2
            # Samples travel on the bus: at least one SampleRequest per episode reached the
            # scheduler's socket (the first decision of the policy's seat).
            assert samples >= episodes
            assert metrics[-1]["train/main/version"] == steps
            pulled = info["learner_main"]["counters"].get("pull/recv/Trajectory", 0)
            assert pulled == sum(m["train/main/n_datums"] for m in metrics)
        finally:
            job.shutdown()
    assert per_step[1] == per_step[6] == 1.0, per_step
