"""Ctrl-C on ``opentinker run`` (a real process, SIGINT as a terminal sends it): the first stops
after the step in progress with a checkpoint, one line naming the resume command, exit 130;
``--resume`` then goes on; a run stopped before it has a checkpoint leaves no folder."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _config(tmp_path: Path, steps: int, hands: int = 1) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f'''name = "ctrlc"
out_dir = "{tmp_path / 'runs'}"
[model]
base = "tiny-random"
threads = 1
[runtime]
backend = "local"
env_runners = 1
[train]
steps = {steps}
checkpoint_every = 0
groups_per_step = 2
group_size = 2
[sampling]
max_tokens = 4
[eval]
every = 0
hands_per_stratum = {hands}
head_to_head_per_stratum = 0
''')
    return path


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "opentinker.cli", "run", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(what, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _train_steps(runs: Path) -> int:
    logs = list(runs.glob("*/metrics.jsonl"))
    if not logs:
        return 0
    return sum(1 for line in logs[0].read_text().splitlines() if json.loads(line).get("kind") == "train")


def _signal_when(args: list[str], ready, sig: int) -> tuple[subprocess.Popen, str, str]:
    """Start ``opentinker run ARGS``, send ``sig`` once ``ready()`` holds, and wait for it to
    end: (the process, its stdout, its stderr)."""
    proc = _start(args)
    try:
        _wait_for(ready)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    return proc, out, err


def _ctrl_c_after_a_step(args: list[str], runs: Path) -> tuple[subprocess.Popen, str, str]:
    """:func:`_signal_when` a training step is logged under ``runs``, with SIGINT."""
    return _signal_when(args, lambda: _train_steps(runs) >= 1, signal.SIGINT)


def test_ctrl_c_checkpoints_the_step_says_how_to_resume_and_resume_goes_on(tmp_path):
    runs = tmp_path / "runs"
    proc, out, err = _ctrl_c_after_a_step([str(_config(tmp_path, 200))], runs)
    assert proc.returncode == 130, err
    (run,) = runs.iterdir()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [(f"opentinker: stopped with the checkpoint of step {_train_steps(runs)}: continue with "
                      f"opentinker run --resume {run}")], err
    assert "Traceback" not in out + err
    step = _train_steps(runs)
    assert (run / "checkpoints" / f"step_{step}").is_dir() and step < 200
    resumed = _start(["--resume", str(run), "--set", f"train.steps={step + 1}"])
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "resumed from" in out and _train_steps(runs) == step + 1


def test_ctrl_c_before_a_checkpoint_leaves_no_folder(tmp_path, tiny_path, monkeypatch):
    """Ctrl-C during the first evaluation (delivered to this process as a terminal sends it,
    at that moment): nothing is trained, so nothing is kept, and the caller hears so."""
    from opentinker.config import load_config
    from opentinker.control.runtime import Job
    from opentinker.interrupt import Interrupted
    from opentinker.run import run_job

    supervised = Job.supervised

    def ctrl_c_in_the_first_evaluation(self, method, *args):
        if method == "evaluate":
            signal.raise_signal(signal.SIGINT)  # handled between two bytecodes, here
        return supervised(self, method, *args)

    monkeypatch.setattr(Job, "supervised", ctrl_c_in_the_first_evaluation)
    cfg = load_config(_config(tmp_path, 200))
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN under `cmd &` in a script
    with pytest.raises(Interrupted) as e:
        run_job(cfg)
    assert e.value.removed and e.value.step is None and "removed" in e.value.line()
    assert not any((tmp_path / "runs").iterdir())
    assert signal.getsignal(signal.SIGINT) is before  # the handler put back


def test_the_first_ctrl_c_says_what_the_stop_keeps():
    """The first SIGINT (raised in this process, on the main thread) is caught and said, with what
    the stop keeps; the second raises ``KeyboardInterrupt``; the handler before is put back."""
    from opentinker.interrupt import StopOnInterrupt

    said: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    stop = StopOnInterrupt(said.append, keeps="then saving the adapter")
    with stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.asked and said == ["stopping after this step, then saving the adapter (Ctrl-C again to stop at once)"]
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_sigterm_stops_at_once_and_puts_the_handler_back():
    """SIGTERM (``kill``, a batch scheduler's preemption) raises ``KeyboardInterrupt`` at once, the
    path of a second Ctrl-C, so the run's components are shut down on the way out."""
    from opentinker.interrupt import StopOnInterrupt

    said: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnInterrupt(said.append)
    with stop, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)
    assert stop.asked and said == ["terminated: stopping at once"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_on_a_run_keeps_the_newest_checkpoint_and_says_how_to_resume(tmp_path):
    """``kill`` on ``opentinker run`` once a checkpoint is written: the run stops at once (its
    components shut down), the newest checkpoint stands and one line names the resume command;
    before this, SIGTERM killed the process with no line and left its components to the OS."""
    from opentinker.control.checkpoints import latest_checkpoint

    runs = tmp_path / "runs"
    proc, out, err = _signal_when([str(_config(tmp_path, 200)), "--set", "train.checkpoint_every=1"],
                                  lambda: any(runs.glob("*/checkpoints/step_*")), signal.SIGTERM)
    assert proc.returncode == 130, err
    (run,) = runs.iterdir()
    step = latest_checkpoint(run).step
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [(f"opentinker: stopped with the checkpoint of step {step}: continue with "
                      f"opentinker run --resume {run}")], err
    assert 1 <= step < 200
    assert "terminated: stopping at once" in " ".join(out.split()), out
    assert "Traceback" not in out + err


def test_ctrl_c_on_an_offline_job_saves_its_adapter_and_exits_130(tmp_path):
    """``opentinker run tools_sft`` (tiny-random, many steps): the first Ctrl-C after a step ends
    the job after the step in progress; the adapter so far is evaluated and saved, one line says
    where, and the exit code is the shell's for SIGINT, so ``&&`` stops."""
    small = ["model.base=tiny-random", "model.threads=1", "runtime.backend=local", f"out_dir={tmp_path}",
             "offline.episodes=4", "offline.steps=100000", "offline.batch_size=2"]
    proc, out, err = _ctrl_c_after_a_step(["tools_sft", *(x for s in small for x in ("--set", s))], tmp_path)
    assert proc.returncode == 130, err
    (run,) = tmp_path.glob("calculator_v0__tools_sft__0__*")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"] is True and 1 <= summary["steps"] < 100000
    assert (run / "adapters" / "main" / "adapter_config.json").is_file()
    assert f"opentinker: stopped after step {summary['steps']} of 100000: the adapter trained so far is saved in " \
           f"{run / 'adapters' / 'main'}" in err, err
    said = " ".join(out.split())  # the console wraps long lines when it is not a terminal
    assert "stopping after this step, then evaluating and saving the adapter trained so far" in said, out
    assert "Traceback" not in out + err
