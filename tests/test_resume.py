"""Checkpoints and --resume: two steps in one go and one step plus a resumed one end with
bit-identical adapters (weights and optimizer state) and learner states; a stop during a
step's evaluation keeps the step, and the resume only evaluates it."""

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
from opentinker.control.runtime import Job
from opentinker.interrupt import Interrupted
from opentinker.run import run_job


def _cfg(tmp_path, steps: int, eval_every: int = 0) -> JobConfig:
    return msgspec.convert({
        "name": "resume", "out_dir": str(tmp_path),
        # Bit-for-bit resume holds on the PEFT path (the engine batches rows by arrival time).
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE, "engine": "peft"},
        "runtime": {"backend": "local", "env_runners": 1, "timeout_s": 120},
        "train": {"steps": steps, "checkpoint_every": 1, "groups_per_step": 2, "group_size": 2, "lr": 1e-2,
                  "advantage": "reinforce_ema"},  # a learner with state to carry over
        "game": "referential_v0", "system_prompt": "You play a word game.",
        "sampling": {"max_tokens": 4},
        "eval": {"every": eval_every, "hands_per_stratum": 2, "head_to_head_per_stratum": 0, "exact": False},
        "policies": [{"name": "main", "opponents": {"referential_heuristic": 1}}],
    }, JobConfig)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


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
    rows = _rows(half.run_dir)
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


@pytest.mark.slow
def test_a_stop_during_an_evaluation_keeps_the_step_and_a_resume_only_evaluates(tmp_path, tiny_path, monkeypatch,
                                                                                 one_request_per_batch):
    """Stopped at once (as a second Ctrl-C) during the last step's evaluation, the run keeps
    that step's checkpoint, written before the evaluation; ``--resume`` trains nothing, runs
    that evaluation once, and ends as a run that never stopped: the same adapters, evaluations
    and rows."""
    straight = run_job(_cfg(tmp_path / "a", 2, eval_every=1), run_dir=tmp_path / "a" / "run")
    supervised, calls = Job.supervised, []

    def stop_in_the_last_evaluation(self, method, *args):
        if method == "evaluate" and args[0] == 2:
            raise KeyboardInterrupt  # what a second Ctrl-C raises, there
        return supervised(self, method, *args)

    monkeypatch.setattr(Job, "supervised", stop_in_the_last_evaluation)
    run_dir = tmp_path / "b" / "run"
    with pytest.raises(Interrupted) as e:
        run_job(_cfg(tmp_path / "b", 2, eval_every=1), run_dir=run_dir)
    assert e.value.step == 2 and not (run_dir / "summary.json").exists()
    ckpt = latest_checkpoint(run_dir)
    assert ckpt.step == 2 and ckpt.eval_due
    success = "eval/main/vs_referential_heuristic/success"  # the evaluation before it, step 1's
    assert ckpt.last_eval[success] == next(r[success] for r in _rows(run_dir) if r["kind"] == "eval" and r["step"] == 1)
    assert [(r["step"], r["kind"]) for r in _rows(run_dir)] == [(0, "eval"), (1, "train"), (1, "eval"), (2, "train")]

    # Had the evaluation logged its row before the stop, the resume drops it for its own.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "kind": "eval", success: -1.0}) + "\n")

    def recorded(self, method, *args):
        calls.append((method, args[0]) if method in ("train_step", "evaluate") else method)
        return supervised(self, method, *args)

    monkeypatch.setattr(Job, "supervised", recorded)
    resumed = run_job(_cfg(tmp_path / "b", 2, eval_every=1), resume=run_dir)
    assert [c for c in calls if isinstance(c, tuple)] == [("evaluate", 2)]
    assert not latest_checkpoint(run_dir).eval_due and (run_dir / "summary.json").is_file()
    a, b = _rows(straight.run_dir), _rows(run_dir)
    assert [(r["step"], r["kind"]) for r in b] == [(r["step"], r["kind"]) for r in a]
    eval_keys = [k for k in a[-1] if k.startswith("eval/")]  # all but its time (timing_s/eval)
    assert eval_keys and {k: b[-1][k] for k in eval_keys} == {k: a[-1][k] for k in eval_keys}
    assert resumed.last_eval.keys() == straight.last_eval.keys()
    ta, tb = _tensors(straight.run_dir / "adapters" / "main"), _tensors(run_dir / "adapters" / "main")
    assert ta.keys() == tb.keys() and all((ta[n][k] == tb[n][k]).all() for n in ta for k in ta[n])
    tb_events = read_tensorboard(run_dir / "tb")  # the step's training kept, its evaluation once
    assert [s for s, _ in tb_events["eval/main/vs_referential_heuristic/success"]] == [0, 1, 2]
    assert [s for s, _ in tb_events["train/main/reward"]] == [1, 2]


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text('name = "x"\n')
    assert main(["run", "--resume", str(tmp_path / "run")]) == 2
    assert "has no checkpoint to resume from" in capsys.readouterr().err
    assert main(["run", "default", "--resume", str(tmp_path / "run")]) == 2
