"""Run outputs: every metrics row goes to metrics.jsonl and, as scalars, to TensorBoard; a
resumed writer replaces what an earlier process wrote from its first step on."""

from __future__ import annotations

import json
import math

from conftest import read_tensorboard

from opentinker.report import MetricsLog


def test_metrics_go_to_jsonl_and_tensorboard_and_a_resume_purges_the_rest(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(4):
        log.write(step, "train", {"train/main/reward": step / 10, "train/main/invalid_rate": 0.5,
                                  "train/main/kl": float("nan"), "train/main/note": "text", "train/main/n": 3})
    log.write(3, "eval", {"eval/main/vs_random/chips": -0.25})
    # No close(): each row is flushed as it is written (a run that dies loses nothing).
    tb = read_tensorboard(tmp_path / "tb")
    assert [s for s, _ in tb["train/main/reward"]] == [0, 1, 2, 3]
    assert all(math.isclose(v, s / 10, rel_tol=1e-6) for s, v in tb["train/main/reward"])
    assert tb["train/main/n"] == [(s, 3.0) for s in range(4)] and tb["eval/main/vs_random/chips"] == [(3, -0.25)]
    assert "train/main/kl" not in tb and "train/main/note" not in tb  # NaN and text stay in the JSONL only
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and rows[0]["train/main/kl"] is None and rows[0]["train/main/note"] == "text"
    log.close()

    resumed = MetricsLog(tmp_path / "metrics.jsonl", purge_step=2)  # resumed from step 1's checkpoint
    for step in (2, 3):
        resumed.write(step, "train", {"train/main/reward": 1.0 + step})
    resumed.close()
    tb = read_tensorboard(tmp_path / "tb")
    got = [(s, round(v, 6)) for s, v in tb["train/main/reward"]]
    assert got == [(0, 0.0), (1, 0.1), (2, 3.0), (3, 4.0)]
    assert "eval/main/vs_random/chips" not in tb  # step 3's eval came after the checkpoint: gone
    assert MetricsLog(tmp_path / "other.jsonl", tb_dir=None)._tb is None
