"""Checkpoints and --resume: two steps in one go and one step plus a resumed one end with
bit-identical adapters (weights and optimizer state) and learner states."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
from conftest import DEVICE, read_tensorboard
from safetensors.numpy import load_file

from opentinker.cli import main
from opentinker.config import JobConfig
from opentinker.control.checkpoints import latest_checkpoint
from opentinker.run import run_job


def _cfg(tmp_path, steps: int) -> JobConfig:
    return msgspec.convert({
        "name": "resume", "out_dir": str(tmp_path),
        # Bit-for-bit resume holds on the PEFT path (the engine batches rows by arrival time).
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE, "engine": "peft"},
        "runtime": {"backend": "local", "env_runners": 1, "timeout_s": 120},
        "train": {"steps": steps, "checkpoint_every": 1, "groups_per_step": 2, "group_size": 2, "lr": 1e-2,
                  "advantage": "reinforce_ema"},  # a learner with state to carry over
        "game": "referential_v0", "system_prompt": "You play a word game.",
        "sampling": {"max_tokens": 4},
        "eval": {"every": 0, "hands_per_stratum": 2, "head_to_head_per_stratum": 0, "exact": False},
        "policies": [{"name": "main", "opponents": {"referential_heuristic": 1}}],
    }, JobConfig)


def _tensors(folder):
    return {f.name: load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))}


@pytest.mark.slow
def test_resumed_run_matches_an_uninterrupted_one(tmp_path, tiny_path, monkeypatch, one_request_per_batch):
    straight = run_job(_cfg(tmp_path / "a", 2), run_dir=tmp_path / "a" / "run")
    half = run_job(_cfg(tmp_path / "b", 1), run_dir=tmp_path / "b" / "run")
    assert latest_checkpoint(half.run_dir).step == 1
    first_wall = latest_checkpoint(half.run_dir).wall_s
    assert first_wall is not None and 0 < first_wall <= json.loads((half.run_dir / "summary.json").read_text())["wall_s"]
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    assert main(["run", "--resume", str(half.run_dir), "--set", "train.steps=2"]) == 0
    resumed_s = time.perf_counter() - t0
    a, b = straight.run_dir / "adapters" / "main", half.run_dir / "adapters" / "main"
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and len(ta) >= 2  # the adapter and its optimizer state
    for name in ta:
        for key in ta[name]:
            assert (ta[name][key] == tb[name][key]).all(), (name, key)
    assert json.loads((a / "learner_state.json").read_text()) == json.loads((b / "learner_state.json").read_text())
    rows = [json.loads(line) for line in (half.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in rows if r["kind"] == "train"] == [(1, "train"), (2, "train")]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 1, 2]
    assert sorted(p.name for p in (half.run_dir / "checkpoints").iterdir()) == ["step_1", "step_2"]
    # The resumed run's time counts the first attempt's up to its checkpoint, then its own.
    step2 = next(r for r in rows if r["kind"] == "train" and r["step"] == 2)
    second_wall = latest_checkpoint(half.run_dir).wall_s
    assert first_wall + step2["timing_s/rollout"] + step2["timing_s/learn"] <= second_wall <= first_wall + resumed_s
    summary = json.loads((half.run_dir / "summary.json").read_text())
    assert second_wall <= summary["wall_s"] <= first_wall + resumed_s and "wall_s_from_step" not in summary
    tb = read_tensorboard(half.run_dir / "tb")  # two processes' event files, read as TensorBoard does
    want = {(r["step"], round(r["train/main/reward"], 5)) for r in rows if r["kind"] == "train"}
    assert {(s, round(v, 5)) for s, v in tb["train/main/reward"]} == want and len(tb["train/main/reward"]) == 2
    assert [s for s, _ in tb["eval/main/vs_referential_heuristic/success"]] == [0, 1, 2]


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text('name = "x"\n')
    assert main(["run", "--resume", str(tmp_path / "run")]) == 2
    assert "has no checkpoint to resume from" in capsys.readouterr().err
    assert main(["run", "default", "--resume", str(tmp_path / "run")]) == 2
