"""Checkpoints you can trust and resumes that keep every file consistent (issue: nothing lost
when a process dies): a manifest of checksums written last; a checkpoint whose files or values
do not check out is reported by file and skipped for the one before it; nothing is rewritten
before that; a full disk mid-checkpoint leaves the older ones intact; a resume rewinds the
metrics and the trajectories, so no record is written twice (local backend, tiny model)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from conftest import DEVICE, private_ray_tmp, run
from safetensors.numpy import load_file, save_file

from opentinker.cli import main
from opentinker.config import JobConfig
from opentinker.control import checkpoints
from opentinker.control.checkpoint_checks import MANIFEST, verify, write_manifest
from opentinker.control.checkpoints import latest_checkpoint
from opentinker.run import run_job
from opentinker.training import trajectory_log


def _cfg(tmp_path: Path, steps: int, checkpoint_every: int = 1) -> JobConfig:
    return msgspec.convert({
        "name": "rel", "out_dir": str(tmp_path),
        # Bit-for-bit resume holds on the PEFT path (the engine batches rows by arrival time).
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE, "engine": "peft"},
        "runtime": {"backend": "local", "env_runners": 1, "timeout_s": 120},
        "train": {"steps": steps, "checkpoint_every": checkpoint_every, "groups_per_step": 2, "group_size": 2,
                  "lr": 1e-2, "advantage": "role_ema"},  # a learner with baselines to carry over
        "game": "referential_v0", "system_prompt": "You play a word game.",
        "sampling": {"max_tokens": 4},
        "eval": {"every": 0, "hands_per_stratum": 1, "head_to_head_per_stratum": 0, "exact": False},
        "policies": [{"name": "main", "opponents": {"referential_heuristic": 1}}],
    }, JobConfig)


@contextlib.contextmanager
def killed_during(step: int, component: str):
    """While open, the first Ray job to reach training step ``step`` has ``component``
    (``learner_main``, ``scheduler``, ...) killed with SIGKILL just before the step (once: the
    step played again after a restart goes undisturbed); yields the pids killed."""
    from opentinker.control.runtime import Job

    real, pids = Job.supervised, []

    def supervised(self, method, *args):
        if method == "train_step" and args[0] == step and not pids:
            pid = self.info()[component]["pid"]
            os.kill(pid, signal.SIGKILL)
            pids.append(pid)
            for _ in range(200):  # gone within 10 s, so the step surely meets a dead component
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
        return real(self, method, *args)

    Job.supervised = supervised
    try:
        yield pids
    finally:
        Job.supervised = real


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_path) -> Path:
    """A 3-step run with a checkpoint after every step (the 2 newest kept: step_2, step_3)."""
    root = tmp_path_factory.mktemp("rel")
    return run_job(_cfg(root, 3), run_dir=root / "run").run_dir


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _resign(folder: Path) -> None:
    """Rewrite the manifest after a change: corruption that checksums cannot see."""
    write_manifest(folder)


def _nan(folder: Path) -> str:
    f = folder / "adapters" / "main" / "adapter_model.safetensors"
    t = load_file(str(f))
    k = min(t)
    t[k] = np.full_like(t[k], np.nan)
    save_file(t, str(f))
    _resign(folder)
    return f"{f}: tensor {k} has non-finite values"


def _huge(folder: Path) -> str:
    f = folder / "adapters" / "main" / "adapter_model.safetensors"
    t = load_file(str(f))
    k = min(t)
    t[k] = np.full_like(t[k], 1e30)
    save_file(t, str(f))
    _resign(folder)
    return f"{f}: tensor {k} has a value of magnitude 1e+30"


def _flip(folder: Path) -> str:
    f = folder / "adapters" / "main" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    return f"{f}: checksum differs"


def _json_edit(rel: str, edit, resign: bool = True):
    def corrupt(folder: Path) -> str:
        f = folder / rel
        d = json.loads(f.read_text())
        edit(d)
        f.write_text(json.dumps(d))
        if resign:
            _resign(folder)
        return str(f)
    return corrupt


def _baselines(d: dict) -> None:
    d["advantage_state"]["baselines"] = {k: 1e9 for k in d["advantage_state"]["baselines"]}


CORRUPTIONS = {
    "bit flip": _flip,
    "nan weights": _nan,
    "huge weights": _huge,
    "version -7": _json_edit("adapters/main/opentinker.json", lambda d: d.update(version=-7)),
    "step 999": _json_edit("state.json", lambda d: d.update(step=999)),
    "step -5": _json_edit("state.json", lambda d: d.update(step=-5)),
    "baselines 1e9": _json_edit("adapters/main/learner_state.json", _baselines),
    "wall_s -1": _json_edit("state.json", lambda d: d.update(wall_s=-1.0)),
    "wall_s text": _json_edit("state.json", lambda d: d.update(wall_s="an hour")),
    "wall_s_from_step 99": _json_edit("state.json", lambda d: d.update(wall_s_from_step=99)),
    "eval_due text": _json_edit("state.json", lambda d: d.update(eval_due="yes")),
    "no manifest": lambda folder: (folder / MANIFEST).unlink() or str(folder / MANIFEST),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_corrupt_checkpoint_is_reported_by_file_and_skipped(finished, tmp_path, what) -> None:
    run = _copy(finished, tmp_path)
    cfg = _cfg(tmp_path, 3)
    newest = run / "checkpoints" / "step_3"
    assert verify(newest, {"main": 1}) == []  # as written
    named = CORRUPTIONS[what](newest)
    problems = verify(newest, {"main": 1})
    assert problems and any(named in p or p.startswith(named.split(":")[0]) for p in problems), (named, problems)
    ck = latest_checkpoint(run, cfg)
    assert ck.step == 2 and ck.folder.name == "step_2"
    assert len(ck.skipped) == 1 and ck.skipped[0].startswith("step_3: ")
    # Both bad: the run stops with every problem, and nothing of the run was rewritten.
    CORRUPTIONS[what](run / "checkpoints" / "step_2")
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match="no checkpoint checks out"):
        latest_checkpoint(run, cfg)
    assert main(["run", "--resume", str(run)]) == 2
    assert (run / "metrics.jsonl").read_bytes() == before


def test_a_benchmark_goes_on_from_the_checkpoint_a_resume_takes(finished, tmp_path) -> None:
    """The benchmark scripts' ``stopped_run`` (which their ``run_or_reuse`` resumes from) names
    the checkpoint ``opentinker run --resume`` takes: a newest one that fails its checks is
    passed over for the one before it, a run whose checkpoints all fail has nothing to go on
    from (the seed starts afresh), and a listing (``verified=False``) reads only state.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from _jobs import stopped_run

    run = tmp_path / "referential_v0__rel__0__20261206-000000"  # how a run folder is named
    shutil.copytree(finished, run)
    (run / "summary.json").unlink()  # stopped before its end
    assert stopped_run(tmp_path, "rel", 0) == (run, 3)
    _nan(run / "checkpoints" / "step_3")
    assert stopped_run(tmp_path, "rel", 0) == (run, 2) == (run, latest_checkpoint(run, _cfg(tmp_path, 3)).step)
    assert stopped_run(tmp_path, "rel", 0, verified=False) == (run, 3)
    _nan(run / "checkpoints" / "step_2")
    assert stopped_run(tmp_path, "rel", 0) is None
    assert stopped_run(tmp_path, "rel", 1) is None and stopped_run(tmp_path, "other", 0) is None


def test_what_a_checksum_manifest_does_not_protect_against(finished, tmp_path) -> None:
    """docs/security.md: the manifest catches damage, not a writer who rewrites it too. Weights
    rewritten with other finite values and the manifest rewritten after them are accepted (the
    attack's "rewritten weights and manifest"); the checks of the values still refuse weights no
    training makes (1e30), whatever the manifest says; weights rewritten without the manifest
    are refused."""
    run = _copy(finished, tmp_path)
    newest = run / "checkpoints" / "step_3"
    f = newest / "adapters" / "main" / "adapter_model.safetensors"
    t = load_file(str(f))
    t = {k: (-v if v.size else v) for k, v in t.items()}  # other weights, as plausible as the first
    save_file(t, str(f))
    problems = verify(newest, {"main": 1})
    assert any(p.startswith(f"{f}: ") for p in problems), problems  # damage (size or checksum): caught
    _resign(newest)
    assert verify(newest, {"main": 1}) == []  # a consistent rewrite: a checksum cannot tell
    assert _huge(newest) in " ".join(verify(newest, {"main": 1}))  # out of range: refused, manifest or not


def test_a_full_disk_mid_checkpoint_leaves_the_older_ones_intact(finished, tmp_path, monkeypatch) -> None:
    run = _copy(finished, tmp_path)
    root = run / "checkpoints"
    before = {p.name: (p / MANIFEST).read_bytes() for p in root.iterdir()}

    def full(paths):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        checkpoints.write_checkpoint(run, 4, lambda folder: Path(folder).mkdir(parents=True) or {"main": folder},
                                     full, {}, {})
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]  # no half-written step_4, nothing dropped
    assert {p.name: (p / MANIFEST).read_bytes() for p in root.iterdir()} == before
    assert latest_checkpoint(run, _cfg(tmp_path, 4)).step == 3


def test_resume_rewinds_metrics_and_trajectories(tmp_path, tiny_path) -> None:
    """A run that died after step 3 but before its step-3 checkpoint resumes from step 2: the
    files end as an undisturbed run's (no step written twice): the same episodes and seats in the
    same order, each once. (Their contents are not always bit for bit the same: the PEFT path
    batches the requests that arrive within a few milliseconds, and a different batch rounds
    differently; about one run in three replays step 3 with other tokens.)"""
    straight = run_job(_cfg(tmp_path / "a", 3, checkpoint_every=2), run_dir=tmp_path / "a" / "run").run_dir
    crashed = run_job(_cfg(tmp_path / "b", 3, checkpoint_every=2), run_dir=tmp_path / "b" / "run").run_dir
    shutil.rmtree(crashed / "checkpoints" / "step_3")  # its last checkpoint never made it to disk
    assert main(["run", "--resume", str(crashed)]) == 0
    ours = trajectory_log.read(crashed / "trajectories" / "main.jsonl")
    keys = [(r.step, r.episode_id, r.seat) for r in ours]
    assert len(keys) == len(set(keys)) and {r.step for r in ours} == {1, 2, 3}
    theirs = trajectory_log.read(straight / "trajectories" / "main.jsonl")
    assert keys == [(r.step, r.episode_id, r.seat) for r in theirs]
    rows = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("train", 1), ("train", 2), ("train", 3), ("eval", 3)]


def test_bad_files_of_a_run_are_named_before_a_resume_rewrites_them(finished, tmp_path, capsys) -> None:
    run = _copy(finished, tmp_path)
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + "{not json\n")
    assert main(["run", "--resume", str(run)]) == 2
    assert f"{metrics}:" in capsys.readouterr().err
    assert metrics.read_text().endswith("{not json\n")  # not rewritten
    run2 = _copy(finished, tmp_path / "2")
    traj = run2 / "trajectories" / "main.jsonl"
    traj.write_text(traj.read_text() + '{"game": 3}\n')
    assert main(["run", "--resume", str(run2)]) == 2
    assert f"{traj}:" in capsys.readouterr().err


def _rss() -> int:
    """This process's resident memory after a garbage collection and glibc's trim (so freed
    heap pages are not counted)."""
    import ctypes
    import gc

    import psutil

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return psutil.Process().memory_info().rss


def test_load_64_clients(scheduler, chat_tok) -> None:
    """64 clients at once against one scheduler, twice: every request answered exactly once
    with its own seeded reply (the same as one client asking alone), nothing lost or
    duplicated in the server's counts, no error, no request left in flight, and no memory
    growth from the first round to the second."""
    import asyncio

    import zmq.asyncio
    from conftest import run

    from opentinker.bus import Client
    from opentinker.rollout.render import SeatRenderer
    from protocols.messages import SampleRequest, SamplingParams

    r = SeatRenderer(chat_tok, "You are a poker player.")
    r.observe("Kuhn poker. You have the K. Reply with one word: check or bet.")
    prompt = r.prompt()
    clients, per = 64, 3

    def params(i: int, j: int) -> SamplingParams:
        return SamplingParams(max_tokens=3, stop_token_ids=(chat_tok.eos_id,), seed=1000 * i + j)

    async def one(ctx, i: int) -> list[list[int]]:
        c = Client(ctx, scheduler.endpoint, name=f"load{i}")
        try:
            return [(await c.request(SampleRequest(adapter=None, prompts=[prompt], params=params(i, j)), 60)
                     ).tokens[0].tolist() for j in range(per)]
        finally:
            c.close()

    async def load() -> list[list[list[int]]]:
        ctx = zmq.asyncio.Context()
        try:
            return await asyncio.gather(*(one(ctx, i) for i in range(clients)))
        finally:
            ctx.destroy(0)

    async def alone() -> list[list[int]]:
        ctx = zmq.asyncio.Context()
        try:
            c = Client(ctx, scheduler.endpoint, name="alone")
            try:
                return [(await c.request(SampleRequest(adapter=None, prompts=[prompt], params=params(i, 0)), 60)
                         ).tokens[0].tolist() for i in (0, 17, 63)]
            finally:
                c.close()
        finally:
            ctx.destroy(0)

    before = dict(scheduler.counters())
    first = run(load(), 300)  # also warms up: the engine's first batches, the bus's buffers
    rss_first = _rss()
    second = run(load(), 300)
    rss_second = _rss()
    assert first == second and [len(x) for x in first] == [per] * clients
    assert [first[i][0] for i in (0, 17, 63)] == run(alone())  # batching changed no reply
    after = scheduler.counters()
    asked = 2 * clients * per + 3
    got = after.get("recv/SampleRequest", 0) - before.get("recv/SampleRequest", 0)
    sent = after.get("sent/SampleResult", 0) - before.get("sent/SampleResult", 0)
    assert got == sent == asked, (got, sent, asked)
    assert not {k: v for k, v in after.items() if k.startswith("error/") and v != before.get(k, 0)}
    assert after.get("dedup", 0) == before.get("dedup", 0)
    assert not any(scheduler.server.peers.values())  # nothing in flight for any session
    assert rss_second - rss_first < 64 << 20, (rss_first, rss_second)


def test_trajectory_ack_resend(tiny_path, monkeypatch, tmp_path) -> None:
    """Trajectories lost on the way to the learner (dropped the first time they are pushed)
    are acknowledged as missing and pushed again by the runner that played them, before the
    learner trains; a copy that arrives twice is dropped; the step trains on each exactly once."""
    from opentinker.bus.pipeline import Pusher
    from opentinker.control.runtime import Job
    from protocols.messages import ResendTrajectories, Trajectory

    dropped: set[tuple[int, int, str]] = set()
    send = Pusher.send

    async def lossy(self, msg, timeout: float = 600.0):
        key = (getattr(msg, "step", 0), getattr(msg, "episode_id", 0), getattr(msg, "seat", ""))
        if isinstance(msg, Trajectory) and key not in dropped and len(dropped) < 2 and msg.episode_id % 2 == 0:
            dropped.add(key)  # lost: the socket "accepted" it, the learner never sees it
            return None
        return await send(self, msg, timeout)

    monkeypatch.setattr(Pusher, "send", lossy)
    cfg = msgspec.convert({**msgspec.to_builtins(_cfg(tmp_path, 2)), "runtime": {"backend": "local", "env_runners": 2,
                                                                                 "timeout_s": 60}}, JobConfig)
    job = Job(cfg, tiny_path, run_dir=str(tmp_path / "run"))
    try:
        m = job.coordinator("train_step", 1)
        assert len(dropped) == 2 and m["train/main/resent"] == 2.0 and m["train/main/duplicates_total"] == 0.0
        records = trajectory_log.read(tmp_path / "run" / "trajectories" / "main.jsonl")
        keys = [(r.episode_id, r.seat) for r in records]
        assert len(keys) == len(set(keys)) == m["train/main/n_datums"]
        assert {(1, e, s) for e, s in keys} >= dropped  # the lost ones were trained on, once
        # A runner asked to push one again after the step: the learner drops the late copy.
        e, seat = keys[0]
        runner = job._handles["env_runner0"].obj
        out = runner.loop.run(runner._handle(ResendTrajectories(step=1, keys=[(e, seat), (10**9, "x")])))
        assert out.missing == [(10**9, "x")] and out.count + len(out.missing) == 2
        m2 = job.coordinator("train_step", 2)
        assert m2["train/main/duplicates_total"] >= out.count and m2["train/main/resent"] == 0.0
    finally:
        job.shutdown()


@pytest.mark.slow
@pytest.mark.ray
def test_a_dead_component_is_named(tiny_path, tmp_path, ray_session) -> None:
    """SIGKILL one component of a Ray job: the next step fails with ComponentDied naming it
    (role, pid, node), not a bus endpoint; and the command line says so in one line, with the
    resume command."""
    from opentinker.control.component import ComponentDied
    from opentinker.control.runtime import Job

    cfg = msgspec.convert({**msgspec.to_builtins(_cfg(tmp_path, 2)),
                           "runtime": {"backend": "ray", "env_runners": 2, "timeout_s": 60}}, JobConfig)
    job = Job(cfg, tiny_path, run_dir=str(tmp_path / "run"))
    try:
        job.coordinator("train_step", 1)
        where = job.info()["env_runner1"]
        pid, node = where["pid"], re.escape(where["node"])  # the node Ray placed it on
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ComponentDied, match=rf"env runner 1 \(pid {pid}, node {node}\) stopped") as e:
            job.coordinator("train_step", 2)
        assert e.value.names == ["env_runner1"]
    finally:
        job.shutdown()


def test_the_command_line_names_a_dead_component_in_one_line(monkeypatch, capsys, tmp_path) -> None:
    import opentinker.run
    from opentinker.control.component import ComponentDied, describe

    def dies(cfg, **kwargs):
        e = ComponentDied(["learner_main"], describe("learner_main", {"pid": 7, "node": "127.0.0.1"}), EOFError())
        e.run_dir = str(tmp_path / "run")
        raise e

    monkeypatch.setattr(opentinker.run, "run_job", dies)
    assert main(["run", "--set", "train.steps=1", "--set", "model.base=tiny-random"]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    want = (f"opentinker: the learner of policy main (pid 7, node 127.0.0.1) stopped (EOFError): the run "
            f"cannot go on; its folder keeps every checkpoint written: continue with opentinker run --resume "
            f"{tmp_path / 'run'}")
    assert err == [want]


@pytest.mark.slow
@pytest.mark.ray
def test_kill_env_runner(tiny_path, tmp_path, ray_session, undisturbed) -> None:
    """SIGKILL an env runner of a Ray job in the middle of step 2 (its episodes under way): the
    step notices (ComponentDied), starts the runner again in a new process, reconnects and
    plays the step again; every episode of the step is trained on exactly once (its
    trajectories counted and unique), and a later step and an evaluation go on as before."""
    from opentinker.control.runtime import Job
    from opentinker.rollout.episodes import train_episodes

    cfg = msgspec.convert({**msgspec.to_builtins(_ray_cfg(tmp_path)), "runtime": {
        "backend": "ray", "env_runners": 2, "timeout_s": 60, "max_restarts": 1}}, JobConfig)
    job = Job(cfg, tiny_path, run_dir=str(tmp_path / "run"))
    try:
        job.supervised("train_step", 1)
        old = job.info()["env_runner1"]["pid"]
        asked = job.call("env_runner1", "counters").get("client/sent/SampleRequest", 0)
        killed = threading.Event()

        def kill_mid_step() -> None:
            """SIGKILL runner 1 once it asks for its first sample of step 2 (episodes under way)."""
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if job.call("env_runner1", "counters").get("client/sent/SampleRequest", 0) > asked:
                    os.kill(old, signal.SIGKILL)
                    killed.set()
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_mid_step, daemon=True)
        killer.start()
        m = job.supervised("train_step", 2)
        killer.join(10)
        assert killed.is_set()  # ...in step 2, which was played again (else the restart would be in step 3)
        assert job.restarts == 1 and job.info()["env_runner1"]["pid"] != old
        records = trajectory_log.read(tmp_path / "run" / "trajectories" / "main.jsonl")
        step2 = [(r.episode_id, r.seat) for r in records if r.step == 2]
        assert len(step2) == len(set(step2)) == m["train/main/n_datums"]
        assert {e for e, _ in step2} == {s.episode_id for s in train_episodes(cfg, 2)}  # every episode, once
        assert job.supervised("train_step", 3)["train/main/version"] == 3
        final = job.supervised("evaluate", 3, True, cfg.eval.final_hands_per_stratum)
        _within_interval(final, undisturbed[0].last_eval)
    finally:
        job.shutdown()


def test_a_resume_past_the_configured_steps_is_refused_not_rolled_back(finished, tmp_path) -> None:
    """--set train.steps=2 on a run checkpointed at step 3: an error, not a silent fall back to
    step_2 (which would cut the metrics and trajectories of step 3)."""
    run = _copy(finished, tmp_path)
    before = {p.name: p.read_bytes() for p in [run / "metrics.jsonl", *(run / "trajectories").glob("*.jsonl")]}
    with pytest.raises(ValueError, match=r"step 3 is past train.steps = 2: nothing to train"):
        latest_checkpoint(run, _cfg(tmp_path, 2))
    assert main(["run", "--resume", str(run), "--set", "train.steps=2"]) == 2
    assert {p.name: p.read_bytes() for p in [run / "metrics.jsonl", *(run / "trajectories").glob("*.jsonl")]} == before


def test_a_checkpoint_without_the_run_time_resumes_and_says_where_the_time_counts_from(finished, tmp_path,
                                                                                     capsys) -> None:
    """A checkpoint written before checkpoints recorded the run's time (``wall_s``): the run
    goes on, says so, and its summary's ``wall_s`` is marked as counted from that step, as are
    the checkpoints it writes, so a later resume keeps the mark (test_resume: one that has the
    time carries it on)."""
    run = _copy(finished, tmp_path)
    newest = run / "checkpoints" / "step_3"
    assert json.loads((newest / "state.json").read_text())["wall_s"] > 0
    _json_edit("state.json", lambda d: d.pop("wall_s"))(newest)
    assert verify(newest, {"main": 1}) == []
    assert main(["run", "--resume", str(run), "--set", "train.steps=4"]) == 0
    assert "does not record the run's time before it" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["wall_s_from_step"] == 3
    # The new checkpoint says its time counts from step 3 too, and so does the next resume's summary.
    step4 = latest_checkpoint(run)
    assert (step4.step, step4.wall_from_step) == (4, 3) and 0 < step4.wall_s <= summary["wall_s"]
    assert main(["run", "--resume", str(run), "--set", "train.steps=5"]) == 0
    assert "does not record" not in capsys.readouterr().out
    again = json.loads((run / "summary.json").read_text())
    assert again["wall_s_from_step"] == 3 and again["wall_s"] > step4.wall_s


def test_a_line_torn_by_a_crash_is_dropped_on_resume(finished, tmp_path) -> None:
    """A process killed mid-write leaves a last line without its newline: a resume drops it
    (it belongs to a step after the checkpoint) instead of refusing the run."""
    run = _copy(finished, tmp_path)
    metrics, traj = run / "metrics.jsonl", run / "trajectories" / "main.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b'{"step": 4, "kind": "tr')
    traj.write_bytes(traj.read_bytes() + traj.read_bytes().splitlines()[0][:40])
    checkpoints.check_run_files(run, 2)  # no error
    rows = checkpoints.truncate_metrics(metrics, 2)
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows) and max(r["step"] for r in rows) == 2
    dropped = trajectory_log.truncate(traj, 2)
    assert dropped >= 1 and {r.step for r in trajectory_log.read(traj)} == {1, 2}
    assert metrics.read_bytes().endswith(b"\n") and traj.read_bytes().endswith(b"\n")


def _accounting(run: Path, cfg: JobConfig) -> tuple[list, dict]:
    """A run's metrics rows ``(step, kind)`` and, per step, its trajectories (count, unique,
    the episodes the step should play) and the datums trained on."""
    from opentinker.rollout.episodes import train_episodes

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records = trajectory_log.read(run / "trajectories" / "main.jsonl")
    steps = {}
    for step in range(1, cfg.train.steps + 1):
        keys = [(r.episode_id, r.seat) for r in records if r.step == step]
        steps[step] = (len(keys), len(set(keys)), {e for e, _ in keys} == {s.episode_id for s in train_episodes(cfg, step)},
                       next(r["train/main/n_datums"] for r in rows if r["step"] == step and r["kind"] == "train"))
    return [(r["step"], r["kind"]) for r in rows], steps


def test_a_learner_started_again_takes_over_its_step(scheduler, tmp_path) -> None:
    """A learner that died in step 2 (it left an unapplied gradient on its adapter and its step's
    trajectories in its log) is started again with ``restore=True``: it takes over its state as
    step 1 ended, discards the gradient, cuts the log back and trains step 2 exactly as an
    undisturbed twin does (same loss, gradient norm, version, baselines). A step played again
    after it trained is acknowledged and answered as trained, by it or by a successor, never
    trained twice; once the adapter has moved past that state, a successor refuses to start and
    says why; a resumed run's learner that dies before its first step leaves the log whole."""
    import zmq.asyncio

    from opentinker.bus import Client, Pusher
    from opentinker.training.learner import Learner
    from protocols.messages import (
        AdamParams,
        CreateAdapter,
        Datum,
        ForwardBackward,
        LearnerStep,
        LoraSpec,
        OptimStep,
        ParseOutcome,
        PolicyKind,
        PolicyRef,
        StopReason,
        Trajectory,
        TrajectoryAck,
        Turn,
    )

    live, record = tmp_path / "learners" / "main.live.json", tmp_path / "main.jsonl"

    def trajectories(policy: str, step: int) -> list[Trajectory]:
        rng = np.random.default_rng(step)  # both policies see the same episodes
        out = []
        for e in range(3):
            turn = Turn(obs_tokens=rng.integers(10, 2000, 5).astype(np.int32),
                        sampled_tokens=rng.integers(10, 2000, 3).astype(np.int32),
                        sampler_logprobs=np.full(3, -7.0, np.float32),
                        policy=PolicyRef(kind=PolicyKind.ADAPTER, name=policy, version=0),
                        stop_reason=StopReason.STOP, parse=ParseOutcome.OK, reward=0.0)
            out.append(Trajectory(episode_id=step * 10 + e, group_id=0, seat="player_0", seed=e, policy=policy,
                                  turns=[turn], total_reward=float(e) - step, step=step))
        return out

    def learner(policy: str, **kw) -> Learner:
        return Learner(policy, scheduler.endpoint, "reinforce_ema", "importance_sampling", {}, AdamParams(lr=0.05),
                       game="g", **kw)

    ctx = zmq.asyncio.Context()

    def admin(*msgs) -> None:
        async def body():
            client = Client(ctx, scheduler.endpoint, name="test-admin")
            try:
                for msg in msgs:
                    await client.request(msg)
            finally:
                client.close()
        run(body())

    def train(lrn: Learner, step: int, push: bool = True, msg=None):
        async def body():
            pusher, client = Pusher(ctx, lrn.pull_endpoint), Client(ctx, lrn.endpoint, name="test-step")
            try:
                for t in trajectories(lrn.policy, step) if push else []:
                    await pusher.send(t)
                return await client.request(msg or LearnerStep(step=step, expected=3, timeout_s=60), 120)
            finally:
                pusher.close()
                client.close()
        return run(body())

    def stray_update(optim: bool) -> None:
        """What a learner dying mid-step leaves: a gradient (and, past OptimStep, new weights)."""
        tokens = np.arange(10, 30, dtype=np.int32)
        mask = np.r_[np.zeros(10), np.ones(10)].astype(np.float32)
        admin(ForwardBackward(adapter="main", datums=[Datum(tokens=tokens, loss_inputs={"mask": mask})], loss="sft",
                              normalizer=10.0),
              *([OptimStep(adapter="main", params=AdamParams(lr=0.5))] if optim else []))

    admin(CreateAdapter(name="main", spec=LoraSpec(rank=4, seed=3)), CreateAdapter(name="twin", spec=LoraSpec(rank=4, seed=3)))
    started: list[Learner] = []
    try:
        twin = learner("twin")
        dying = learner("main", state_path=str(live), record_path=str(record))
        started += [twin, dying]
        twin.start()
        dying.start()
        t1, a1 = train(twin, 1), train(dying, 1)
        assert (a1.version, a1.metrics["loss"]) == (t1.version, t1.metrics["loss"]) == (1, t1.metrics["loss"])
        dying.stop()
        started.remove(dying)
        stray_update(optim=False)  # it died in step 2 after its ForwardBackward...
        trajectory_log.append(record, trajectories("main", 2), "g")  # ...and after logging the step
        successor = learner("main", state_path=str(live), record_path=str(record), restore=True)
        started.append(successor)
        successor.start()
        assert successor.last_step == 1 and successor.state_dict() == {**twin.state_dict(), "policy": "main"}
        t2, b2 = train(twin, 2), train(successor, 2)
        assert b2.version == t2.version == 2
        assert b2.metrics["loss"] == t2.metrics["loss"]
        assert b2.metrics["grad_norm"] == pytest.approx(t2.metrics["grad_norm"], rel=1e-6)  # the stray gradient gone
        assert successor.state_dict() == {**twin.state_dict(), "policy": "main"}
        assert [r.step for r in trajectory_log.read(record)] == [1, 1, 1, 2, 2, 2]  # step 2 once
        # Step 2 played again (another policy's learner died, or this one before its reply): it
        # is acknowledged and answered as trained, not trained again, by it or by a successor.
        held = train(successor, 2, push=False, msg=TrajectoryAck(step=2, expected=3, wait_s=0.1))
        assert held.held == [(20, "player_0"), (21, "player_0"), (22, "player_0")]
        assert train(successor, 2) == b2 and successor.state_dict() == {**twin.state_dict(), "policy": "main"}
        successor.stop()
        started.remove(successor)
        late = learner("main", state_path=str(live), record_path=str(record), restore=True)
        started.append(late)
        late.start()  # its predecessor had finished step 2: the file says so
        assert train(late, 2, push=False) == b2 and late.last_step == 2
        assert [r.step for r in trajectory_log.read(record)] == [1, 1, 1, 2, 2, 2]
        late.stop()
        started.remove(late)
        stray_update(optim=True)  # one that died after its OptimStep: the step cannot be made again
        with pytest.raises(RuntimeError, match=r"learner main: adapter at version 3, its state after step 2 goes "
                                               r"with version 2: the step it died in had updated it"):
            started.append(learner("main", state_path=str(live), record_path=str(record), restore=True))
            started[-1].start()
        # A run resumed from a checkpoint: its learner takes the checkpoint's state and dies before
        # its first step; its successor takes that state and leaves the trajectory log whole.
        resumed_live = tmp_path / "learners" / "resumed.live.json"
        resumed = learner("main", state_path=str(resumed_live), record_path=str(record))
        started.append(resumed)
        resumed.start()
        resumed.load_state_dict(twin.state_dict())
        resumed.stop()
        started.remove(resumed)
        heir = learner("main", state_path=str(resumed_live), record_path=str(record), restore=True)
        started.append(heir)
        heir.start()
        assert heir.state_dict() == {**twin.state_dict(), "policy": "main"}
        assert [r.step for r in trajectory_log.read(record)] == [1, 1, 1, 2, 2, 2]
    finally:
        for lrn in started:
            with contextlib.suppress(Exception):
                lrn.stop()
        ctx.destroy(0)


def _ray_cfg(tmp_path: Path) -> JobConfig:
    """:func:`_cfg`'s 3 steps as a Ray job with two env runners, its final evaluation 4 hands
    per stratum (a 95% interval needs more than one)."""
    base = msgspec.to_builtins(_cfg(tmp_path, 3))
    return msgspec.convert({**base, "runtime": {"backend": "ray", "env_runners": 2, "timeout_s": 60},
                            "eval": {**base["eval"], "final_hands_per_stratum": 4}}, JobConfig)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, tiny_path, ray_session):
    """The Ray job of the kill tests, never disturbed: its result and accounting."""
    import io

    from rich.console import Console

    tmp = tmp_path_factory.mktemp("undisturbed")
    result = run_job(_ray_cfg(tmp), Console(file=io.StringIO()), run_dir=tmp / "run")
    return result, _accounting(result.run_dir, _ray_cfg(tmp))


def _within_interval(final: dict[str, float], whole: dict[str, float]) -> None:
    """A final evaluation within the undisturbed run's 95% interval against every opponent,
    on as many hands (the game's unit: ``success``)."""
    opponents = {k.removesuffix("/ci95") for k in whole if k.endswith("/ci95")}
    assert opponents and all(final[f"{k}/hands"] == whole[f"{k}/hands"] > 0 for k in opponents)
    for k in opponents:
        assert abs(final[f"{k}/success"] - whole[f"{k}/success"]) <= whole[f"{k}/ci95"] + 1e-9, k


def _killed_and_restored(component: str, tmp_path: Path, said: str, undisturbed) -> str:
    """SIGKILL ``component`` of a Ray job just before step 3: the job says what happened and
    goes on by itself (``said``: what it says after naming the component); its files account
    for every step once, as the ``undisturbed`` run's do (the same metrics rows; every episode
    of each step trained on once), step 3 logs the restart, and the final evaluation (the
    game's unit, ``success``) is within the undisturbed run's 95% interval."""
    import io

    from rich.console import Console

    from opentinker.control.component import describe

    cfg = _ray_cfg(tmp_path)
    out = io.StringIO()
    with killed_during(3, component) as pids:
        result = run_job(cfg, Console(file=out, width=400), run_dir=tmp_path / "run")
    rows, steps = _accounting(result.run_dir, cfg)
    assert len(pids) == 1
    assert rows == [(0, "eval"), (1, "train"), (2, "train"), (3, "train"), (3, "eval")]
    assert all(n == unique == 4 and configured and datums == 4 for n, unique, configured, datums in steps.values())
    assert re.search(rf"{re.escape(describe(component))} \(pid {pids[0]}, node [^)]+\) stopped \(.*\) "
                     rf"during step 3: {said}", out.getvalue()), out.getvalue()
    assert result.rows[-2]["kind"] == "train" and result.rows[-2]["runtime/restarts"] == 1.0
    assert json.loads((result.run_dir / "summary.json").read_text())["restarts"] == 1
    whole, (whole_rows, whole_steps) = undisturbed
    assert (rows, steps) == (whole_rows, whole_steps)
    _within_interval(result.last_eval, whole.last_eval)
    return out.getvalue()


@pytest.mark.slow
@pytest.mark.ray
def test_kill_scheduler(tiny_path, tmp_path, ray_session, undisturbed) -> None:
    """The scheduler dies: the job restores its newest checkpoint and goes on (the adapters,
    their optimizer states and the learners' states as checkpointed)."""
    _killed_and_restored("scheduler", tmp_path,
                         re.escape("restoring the checkpoint of step 2 and going on (restart 1 of at most 3)"), undisturbed)


@pytest.mark.slow
@pytest.mark.ray
def test_kill_learner(tiny_path, tmp_path, ray_session, undisturbed) -> None:
    """The learner dies: it is started again in its step, takes over its predecessor's state
    (written as step 2 ended), and step 3 is played again, with no checkpoint restored
    (:func:`test_a_learner_started_again_takes_over_its_step` shows the pending gradients of a
    learner that died mid-update discarded, and the step trained as if nothing happened)."""
    said = _killed_and_restored("learner_main", tmp_path, r"started again as the learner of policy main \(pid \d+, "
                                r"node [^)]+\) and step 3 made again \(restart 1 of at most 3\)", undisturbed)
    assert "restoring the checkpoint" not in said


def test_the_scheduler_is_placed_by_its_resources(tmp_path) -> None:
    """The scheduler's Ray resources: ``runtime.scheduler_resources``, else a GPU for a
    ``cuda`` model; asked of Ray as ``num_gpus`` / ``num_cpus`` / custom ``resources``, and
    refused with what each live node has when none has them (instead of an actor that waits
    forever). ``test_cluster_curve`` places one on a real cluster."""
    from opentinker.config import ConfigError
    from opentinker.control.placement import placed_on_resources, scheduler_resources

    def cfg(**model_and_runtime) -> JobConfig:
        base = msgspec.to_builtins(_cfg(tmp_path, 1))
        return msgspec.convert({**base, "model": {**base["model"], **model_and_runtime.get("model", {})},
                                "runtime": {**base["runtime"], **model_and_runtime.get("runtime", {})}}, JobConfig)

    assert scheduler_resources(cfg()) == {}
    assert scheduler_resources(cfg(model={"device": "cuda"})) == {"GPU": 1.0}
    assert scheduler_resources(cfg(model={"device": "cuda:1"})) == {}  # a device chosen by hand: left alone
    wanted = {"accelerator": 1.0, "GPU": 2.0}
    assert scheduler_resources(cfg(runtime={"backend": "ray", "scheduler_resources": wanted})) == wanted

    class ActorClass:  # what ray.remote(...) returns, as far as placement asks of it
        def options(self, **kw):
            return kw

    cpu = {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 2.0}}
    gone = {"Alive": False, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 2.0, "GPU": 2.0, "accelerator": 1.0}}
    gpu = {**gone, "Alive": True}
    actor_cls = ActorClass()
    assert placed_on_resources(actor_cls, {}, [cpu]) is actor_cls
    with pytest.raises(ConfigError, match=re.escape(
            "runtime.scheduler_resources: no live Ray node has {'accelerator': 1.0, 'GPU': 2.0} for the scheduler "
            "(nodes: 10.0.0.1: {'CPU': 2.0})")):
        placed_on_resources(actor_cls, wanted, [cpu, gone])
    assert placed_on_resources(actor_cls, wanted, [cpu, gpu]) == {"num_cpus": 0, "num_gpus": 2.0,
                                                                 "resources": {"accelerator": 1.0}}
    assert placed_on_resources(actor_cls, {"GPU": 1.0}, [gpu]) == {"num_cpus": 0, "num_gpus": 1.0}


@pytest.mark.slow
def test_cluster_curve(tmp_path) -> None:
    """A simulated cluster of two Ray nodes on this machine (its own process,
    ``tests/cluster_job.py``): a job joined to it with ``runtime.address`` puts components on
    both nodes, every one on CURVE, its scheduler on the node with the resource it asks for.
    With its learner killed (SIGKILL, before step 3) it starts the learner again in its step;
    with its scheduler killed there, it resumes from its checkpoint of step 2 on the cluster;
    both end with the accounting and the final evaluation of the undisturbed run."""
    import subprocess
    import sys

    with private_ray_tmp() as ray_tmp:  # the cluster's address file stays out of /tmp/ray
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # 127.0.0.1 stays 127.0.0.1 when joining
               "RAY_TMPDIR": str(ray_tmp)}
        proc = subprocess.run([sys.executable, str(Path(__file__).parent / "cluster_job.py"), str(tmp_path)],
                              check=False, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["nodes"] == 2 and {k: len(v) for k, v in out["killed"].items()} == {"restarted": 1, "resumed": 1}
    whole = out["whole"]
    for which in ("whole", "restarted", "resumed"):
        r = out[which]
        assert {c["bus"] for c in r["components"].values()} == {"curve"}
        assert len({c["node_id"] for c in r["components"].values()}) == 2, (which, r["components"])  # both nodes
        assert r["components"]["scheduler"]["node_id"] == out["accelerator_node"], which  # placed by its resources
        assert all(s["trajectories"] == s["unique"] == s["n_datums"] == 4 and s["episodes_as_configured"]
                   for s in r["steps"].values())
        assert (r["rows"], r["steps"]) == (whole["rows"], whole["steps"]), which
        assert r["final_eval"] == whole["final_eval"], which  # the tiny model's replies: equal, not just close
    assert whole["final_eval"]["eval/main/vs_random/hands"] > 0
    assert "during step 3: started again as the learner of policy main" in out["said"]["restarted"]  # in its step
    assert "restoring the checkpoint" not in out["said"]["restarted"]
    assert "during step 3: restoring the checkpoint of step 2 and going on" in out["said"]["resumed"]
