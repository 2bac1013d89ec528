"""One scheduler for many jobs (``opentinker serve``): tenants, attached jobs, status.

The OpenAI-compatible endpoint has its own tests (``tests/test_openai_api.py``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import start_serve
from safetensors.numpy import load_file

from opentinker.bus.auth import Credentials, run_secret, run_user
from opentinker.bus.common import RemoteError
from opentinker.bus.sync import SyncClient
from opentinker.engine.service import SchedulerService
from opentinker.engine.tenants import Tenants
from protocols.messages import (
    AdamParams,
    AdapterInfo,
    CloseJob,
    CreateAdapter,
    Datum,
    DropAdapter,
    ForwardBackward,
    ListAdapters,
    ListJobs,
    LoadAdapter,
    LoraSpec,
    OpenJob,
    OptimStep,
    SampleRequest,
    SamplingParams,
    SaveAdapter,
    Shutdown,
    SnapshotAdapter,
)

ROOT = Path(__file__).resolve().parents[1]
P = np.arange(3, 9, dtype=np.int32)
PARAMS = SamplingParams(max_tokens=6, seed=3)


def _train_once(c: SyncClient, adapter: str) -> None:
    tokens = np.arange(5, 15, dtype=np.int32)
    mask = np.r_[np.zeros(5), np.ones(5)].astype(np.float32)
    c.request(ForwardBackward(adapter=adapter, datums=[Datum(tokens=tokens, loss_inputs={"mask": mask})], loss="sft",
                              normalizer=5.0))
    c.request(OptimStep(adapter=adapter, params=AdamParams(lr=0.05)))


def _refused(c: SyncClient, msg, code: str, words: str) -> None:
    with pytest.raises(RemoteError) as e:
        c.request(msg, 30)
    assert e.value.error.code.value == code and words in str(e.value), str(e.value)


def test_jobs_are_tenants_with_their_own_names_folders_and_credentials(tiny_path, tmp_path):
    s = SchedulerService(tiny_path, tenants=Tenants())
    ep = s.start()
    try:
        with SyncClient(ep, "owner") as owner:
            a = owner.request(OpenJob(name="alpha", roots=[str(tmp_path / "a")]))
            b = owner.request(OpenJob(name="beta", roots=[str(tmp_path / "b")]))
            assert (a.job, b.job) == ("j1_alpha", "j2_beta") and a.secret != b.secret
            ca = SyncClient(ep, "coordinator", credentials=Credentials(a.job, a.secret))
            cb = SyncClient(ep, "coordinator", credentials=Credentials(b.job, b.secret))
            # Both jobs name their adapter "main": two adapters, each job's own.
            assert ca.request(CreateAdapter(name="main", spec=LoraSpec())) == AdapterInfo(name="main", version=0)
            assert cb.request(CreateAdapter(name="main", spec=LoraSpec(seed=1))) == AdapterInfo(name="main", version=0)
            _train_once(ca, "main")
            assert [x.name for x in ca.request(ListAdapters()).adapters] == ["main"]
            assert [(x.name, x.version) for x in ca.request(ListAdapters()).adapters] == [("main", 1)]
            assert [(x.name, x.version) for x in cb.request(ListAdapters()).adapters] == [("main", 0)]
            assert [x.name for x in owner.request(ListAdapters()).adapters] == ["j1_alpha/main", "j2_beta/main"]
            # Another job's adapter is reachable by its full name for sampling and snapshots ...
            mine = ca.request(SampleRequest(adapter="main", prompts=[P], params=PARAMS))
            theirs = cb.request(SampleRequest(adapter="j1_alpha/main", prompts=[P], params=PARAMS))
            own_b = cb.request(SampleRequest(adapter="main", prompts=[P], params=PARAMS))
            assert theirs.adapter_version == 1 and np.array_equal(mine.tokens[0], theirs.tokens[0])
            assert np.allclose(mine.logprobs[0], theirs.logprobs[0], atol=1e-5)
            assert not np.allclose(own_b.logprobs[0][: len(mine.logprobs[0])], mine.logprobs[0][: len(own_b.logprobs[0])],
                                   atol=1e-3)
            assert cb.request(SnapshotAdapter(adapter="j1_alpha/main", name="alpha_copy")).name == "alpha_copy"
            # ... never for training, dropping, saving or making one in its namespace.
            for msg in (OptimStep(adapter="j1_alpha/main", params=AdamParams()), DropAdapter(name="j1_alpha/main"),
                        SaveAdapter(adapter="j1_alpha/main", path=str(tmp_path / "b" / "x")),
                        CreateAdapter(name="j1_alpha/extra", spec=LoraSpec())):
                _refused(cb, msg, "invalid", "belongs to job 'j1_alpha'")
            # An unknown name reads as the job names it, with no other job's adapters listed.
            _refused(cb, SampleRequest(adapter="nosuch", prompts=[P], params=PARAMS), "not_found", "'nosuch'")
            with pytest.raises(RemoteError) as e:
                cb.request(SampleRequest(adapter="nosuch", prompts=[P], params=PARAMS))
            assert "j1_alpha" not in str(e.value) and "known:" not in str(e.value)
            # Folders: each job's own.
            _refused(cb, SaveAdapter(adapter="main", path=str(tmp_path / "a" / "x")), "invalid", "outside the folders")
            assert cb.request(SaveAdapter(adapter="main", path=str(tmp_path / "b" / "x"))).version == 0
            _refused(ca, LoadAdapter(path=str(tmp_path / "b" / "x"), name="stolen"), "invalid", "outside the folders")
            # Only the owner opens, lists and closes jobs, and stops the scheduler.
            for msg in (ListJobs(), OpenJob(name="gamma"), CloseJob(job="j1_alpha")):
                _refused(cb, msg, "invalid", "for the scheduler's owner")
            _refused(cb, Shutdown(reason="x"), "invalid", "Shutdown is only for its owners")
            jobs = {j.job: j for j in owner.request(ListJobs()).jobs}
            assert jobs["j1_alpha"].adapters == ["main"] and sorted(jobs["j2_beta"].adapters) == ["alpha_copy", "main"]
            assert jobs["j1_alpha"].compute_ms > 0 and jobs["j1_alpha"].state == "running"
            # Closing a job frees its adapters and refuses its credentials from then on.
            closed = owner.request(CloseJob(job="j1_alpha"))
            assert closed.state == "closed" and closed.adapters == []
            assert [x.name for x in owner.request(ListAdapters()).adapters] == ["j2_beta/alpha_copy", "j2_beta/main"]
            _refused(ca, ListAdapters(), "invalid", "may no longer connect")
            _refused(cb, SampleRequest(adapter="j1_alpha/main", prompts=[P], params=PARAMS), "not_found", "j1_alpha")
            # The copy outlives its source's job: it is job beta's.
            assert cb.request(SampleRequest(adapter="alpha_copy", prompts=[P], params=PARAMS)).tokens[0].tolist() == \
                mine.tokens[0].tolist()
            _refused(owner, OpenJob(name="../x"), "invalid", "OpenJob.name")
            _refused(owner, OpenJob(name="ok", roots=["relative"]), "invalid", "not an absolute path")
            ca.close()
            cb.close()
    finally:
        s.stop()


def test_a_wrong_job_secret_gets_nothing(tiny_path):
    s = SchedulerService(tiny_path, tenants=Tenants())
    ep = s.start()
    try:
        with SyncClient(ep, "owner") as owner:
            a = owner.request(OpenJob(name="alpha"))
        with pytest.raises(TimeoutError):
            SyncClient(ep, "forger", credentials=Credentials(a.job, "x" * 43), connect_timeout=1.5)
        assert s.server.counters["auth_denied"] >= 1
    finally:
        s.stop()


def test_a_job_is_opened_only_where_the_scheduler_sees_its_folders(tiny_path, tmp_path):
    """``OpenJob.probe``: the scheduler reads the file the job wrote in its root and opens the
    job only when it holds the job's text there (a job on another machine whose out_dir the
    service's machine does not share is refused at once, not when it first saves); a probe
    outside the job's roots is refused too. ``attach`` writes and removes the probe itself."""
    from opentinker.control.attach import ServiceInfo, attach

    s = SchedulerService(tiny_path, tenants=Tenants())
    ep = s.start()
    root = tmp_path / "runs"
    root.mkdir()
    (root / "probe").write_text("seen-here")
    (tmp_path / "outside").write_text("seen-here")
    try:
        with SyncClient(ep, "owner") as owner:
            assert owner.request(OpenJob(name="ok", roots=[str(root)], probe=str(root / "probe"),
                                         probe_text="seen-here")).job.startswith("j1_ok")
            for probe, text in ((root / "probe", "written-elsewhere"), (root / "missing", "seen-here"),
                                (tmp_path / "outside", "seen-here")):
                with pytest.raises(RemoteError, match=r"OpenJob.probe: this scheduler does not see .* as the job "
                                                      r"wrote it: a job on another machine needs its out_dir on a "
                                                      r"file system both machines share"):
                    owner.request(OpenJob(name="far", roots=[str(root)], probe=str(probe), probe_text=text))
        info = ServiceInfo(endpoint=ep, model_path=tiny_path, user=run_user(), secret=run_secret().decode())
        info.write(tmp_path / "service.json")
        a = attach(str(tmp_path / "service.json"), "attached", tiny_path, [str(root)], [])
        assert a.job.startswith("j2_attached") and not list(root.glob(".opentinker-probe-*"))  # probe removed
        a.close()
    finally:
        s.stop()


def test_a_scheduler_on_curve_takes_each_job_by_its_key(tiny_path):
    """A shared scheduler on CURVE (a service reachable from other machines): the owner and
    each running job present a key pair the scheduler made, and are who the key says (a job's
    key cannot open jobs); the owner's PLAIN secret, a stranger's key and a closed job's key
    get nothing."""
    import zmq

    from opentinker.bus.common import CurveKeys
    from protocols.messages import CloseJob, CreateAdapter, ListAdapters, LoraSpec

    server, owner = zmq.curve_keypair(), zmq.curve_keypair()
    s = SchedulerService(tiny_path, tenants=Tenants(owner_curve=owner[0].decode()),
                  curve_keys=CurveKeys(public=server[0], secret=server[1]))
    ep = s.start()
    z = server[0].decode()
    owner_creds = Credentials(run_user(), run_secret().decode(), (owner[0].decode(), owner[1].decode(), z))
    try:
        with SyncClient(ep, "owner", credentials=owner_creds) as c:
            a = c.request(OpenJob(name="alpha"))
        assert len(a.curve_public) == len(a.curve_secret) == 40
        job = Credentials(a.job, a.secret, (a.curve_public, a.curve_secret, z))
        with SyncClient(ep, "alpha", credentials=job) as c:
            c.request(CreateAdapter(name="main", spec=LoraSpec(rank=2)))
            assert [x.name for x in c.request(ListAdapters()).adapters] == ["main"]  # its own names
            with pytest.raises(RemoteError, match="OpenJob"):
                c.request(OpenJob(name="sneaky"))  # it is the job, not the owner
        refused = s.server.counters.get("auth_denied", 0)
        stranger = zmq.curve_keypair()
        for creds in (Credentials(run_user(), run_secret().decode()),  # PLAIN: not even a handshake
                      Credentials(run_user(), run_secret().decode(), (stranger[0].decode(), stranger[1].decode(), z))):
            with pytest.raises(TimeoutError):
                SyncClient(ep, "forger", credentials=creds, connect_timeout=1.5)
        with SyncClient(ep, "owner", credentials=owner_creds) as c:
            c.request(CloseJob(job=a.job))
        with pytest.raises(TimeoutError):
            SyncClient(ep, "closed", credentials=job, connect_timeout=1.5)
        assert s.server.counters["auth_denied"] >= refused + 2
    finally:
        s.stop()


# ------------------------------------------------------------------------ jobs attached


def _cli(*args: str, env: dict | None = None) -> list[str]:
    return [sys.executable, "-m", "opentinker.cli", *args]


@pytest.fixture(scope="module")
def service(tiny_path, tmp_path_factory):
    """``opentinker serve --ray`` in its own process (the scheduler in a Ray actor, the HTTP
    endpoint on a free port), until the module's tests end."""
    folder = tmp_path_factory.mktemp("service")
    file = folder / "service.json"
    proc = subprocess.Popen(_cli("serve", "--model", tiny_path, "--port", "0", "--service-file", str(file), "--ray"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not file.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert file.is_file(), proc.stdout.read() if proc.poll() is not None else "no service file in 120 s"
    assert (file.stat().st_mode & 0o777) == 0o600
    yield file
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert not file.exists()  # the service removes its file when it stops


def _job_args(tiny_path: str, out: Path, *extra: str) -> list[str]:
    sets = {"model.base": tiny_path, "model.threads": 1, "runtime.backend": "local", "runtime.env_runners": 1,
            "train.steps": 2, "train.groups_per_step": 4, "train.lr": 0.05, "eval.every": 0,
            "eval.hands_per_stratum": 2, "eval.final_hands_per_stratum": 3, "eval.head_to_head_per_stratum": 1,
            "sampling.max_tokens": 3, "out_dir": str(out)}
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")] + list(extra)


def _run_all(commands: list[list[str]]) -> None:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for c in commands]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


def _summary(out: Path) -> dict:
    (run,) = out.iterdir()
    return json.loads((run / "summary.json").read_text())


def _weights(summary: dict) -> dict[str, np.ndarray]:
    (path,) = summary["adapters"].values()
    return load_file(str(Path(path) / "adapter_model.safetensors"))


@pytest.mark.slow
def test_two_rl_jobs_and_an_sft_job_share_one_scheduler(service, tiny_path, tmp_path):
    rl = {"grpo": ["--set", "train.advantage=dr_grpo", "--set", "name=rl_grpo"],
          "rloo": ["--set", "train.advantage=rloo", "--set", "name=rl_rloo", "--set", "seed=1"]}
    # Alone first: each job with its own scheduler; the SFT job's data is the first job's games.
    _run_all([_cli("run", *_job_args(tiny_path, tmp_path / f"alone_{k}", *v)) for k, v in rl.items()])
    (data,) = (tmp_path / "alone_grpo").glob("*/trajectories/main.jsonl")
    sft = ["--set", "name=sft", "--set", "offline.kind=sft", "--set", f"offline.data={data}",
           "--set", "offline.min_reward=-2", "--set", "offline.steps=2", "--set", "offline.batch_size=4"]
    _run_all([_cli("run", *_job_args(tiny_path, tmp_path / "alone_sft", *sft))])
    # Then the three at once on the service.
    shared = {k: _cli("run", "--scheduler", str(service), *_job_args(tiny_path, tmp_path / f"shared_{k}", *v))
              for k, v in {**rl, "sft": sft}.items()}
    _run_all(list(shared.values()))
    for k in rl:
        alone, together = _summary(tmp_path / f"alone_{k}")["last_eval"], _summary(tmp_path / f"shared_{k}")["last_eval"]
        chips, ci = alone["eval/main/vs_random/chips"], alone["eval/main/vs_random/ci95"]
        assert abs(together["eval/main/vs_random/chips"] - chips) <= max(ci, 1e-9), (k, alone, together)
        assert together["eval/main/exploitability"] == pytest.approx(alone["eval/main/exploitability"], abs=1e-3)
        assert together["eval/main/version"] == alone["eval/main/version"] == 2
    for k in [*rl, "sft"]:  # the same training: the same weights, within the batching's rounding
        a, b = _weights(_summary(tmp_path / f"alone_{k}")), _weights(_summary(tmp_path / f"shared_{k}"))
        assert a.keys() == b.keys() and max(float(np.abs(a[n] - b[n]).max()) for n in a) < 1e-3, k
        assert max(float(np.abs(a[n]).max()) for n in a) > 1e-3  # trained: LoRA B moved off zero
    alone_sft, shared_sft = _summary(tmp_path / "alone_sft"), _summary(tmp_path / "shared_sft")
    for key, v in alone_sft["last_eval"].items():
        assert math.isclose(shared_sft["last_eval"][key], v, rel_tol=1e-3, abs_tol=1e-5), key
    # An evaluation is a job too: a run's adapters evaluated on the service.
    (run,) = (tmp_path / "shared_grpo").iterdir()
    r = subprocess.run(_cli("eval", str(run), "--vs", "random", "--games-per-stratum", "1", "--scheduler", str(service),
                            "--json", str(tmp_path / "eval.json")), capture_output=True, text=True, cwd=ROOT,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["metrics"]["eval/main/vs_random/hands"] > 0
    # Every job was opened, ran as its own tenant, and was closed: its adapters freed.
    report = json.loads(subprocess.run(_cli("status", str(service), "--json"), capture_output=True, text=True,
                                       cwd=ROOT, check=True, timeout=120).stdout)
    names = {j["name"]: j for j in report["jobs"]}
    assert {"rl_grpo", "rl_rloo", "sft", "eval"} <= set(names)
    assert all(names[n]["state"] == "closed" and names[n]["compute_s"] > 0 for n in ("rl_grpo", "rl_rloo", "sft", "eval"))
    assert report["adapters"] == [] and report["memory_mb"]["weights"] > 0 and report["tokens_per_s"]["over_s"] > 0


def test_a_bad_scheduler_address_is_a_config_error(tiny_path, tmp_path):
    env = dict(os.environ, OPENTINKER_HOME=str(tmp_path / "home"))
    for address, words in (("tcp://127.0.0.1:9", "no service file"), (str(tmp_path / "none.json"), "not a readable")):
        r = subprocess.run(_cli("run", "--scheduler", address, *_job_args(tiny_path, tmp_path / "runs")),
                           check=False, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        assert r.returncode == 2 and "bad config: runtime.scheduler" in r.stderr and words in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------ sharing compute


def test_job_share_holds_back_the_jobs_ahead_of_their_share():
    from opentinker.engine.step_worker import JobShare

    share = JobShare(window_s=1e9, slack_s=0.05)
    assert share.ahead({"a": 1.0}) == set()  # alone: never held back
    assert share.ahead({"a": 1.0, "b": 1.0}) == set()
    share.charge("a", 1.0)
    share.charge("b", 0.5)
    assert share.ahead({"a": 1.0, "b": 1.0}) == {"a"}
    assert share.ahead({"a": 2.0, "b": 1.0}) == set()  # a's priority 2: 0.5 s per unit, as b's
    assert share.ahead({"a": 4.0, "b": 1.0}) == {"b"}  # a's 0.25 s per unit: b is ahead
    share.charge("b", 0.5)
    assert share.ahead({"a": 1.0, "b": 1.0}) == set()  # within the slack of each other
    # A job back from idle starts level with the least served active one: no credit, no debt.
    assert share.ahead({"a": 1.0}) == set()
    share.charge("a", 5.0)
    assert share.ahead({"a": 1.0, "c": 1.0}) == set() and share.used["c"] == pytest.approx(6.0)
    assert share.ahead({"a": 1.0, "b": 1.0}) == set() and share.used["b"] == pytest.approx(6.0)


def test_a_job_whose_work_ran_out_keeps_its_place_for_anticipate_s():
    """A job between two requests (an RL job's next turn) still contends for ``anticipate_s``:
    the job ahead stays held back meanwhile; back within ``window_s`` it keeps what it was owed,
    and only a job away for longer starts level with the others."""
    from opentinker.engine.step_worker import JobShare

    with pytest.raises(ValueError, match="anticipate_s"):
        JobShare(anticipate_s=-1.0)
    share = JobShare(window_s=1e9, slack_s=0.05, anticipate_s=0.25)
    both = {"a": 1.0, "b": 3.0}
    assert share.contending(both, now=100.0) == both and share.wake_at(both) is None
    share.ahead(both, now=100.0)
    share.charge("a", 1.0)
    share.charge("b", 0.3)  # b: 0.1 s per unit of priority, a: 1.0
    assert share.ahead(both, now=100.0) == {"a"}
    # b's request finished; its next one is not here yet: b still contends, a stays held.
    active = share.contending({"a": 1.0}, now=100.2)
    assert active == both and share.wake_at({"a": 1.0}) == pytest.approx(100.25)
    assert share.ahead(active, now=100.2) == {"a"}
    # b is late: past anticipate_s it stops contending and a runs alone.
    active = share.contending({"a": 1.0}, now=100.3)
    assert active == {"a": 1.0} and share.wake_at({"a": 1.0}) is None
    assert share.ahead(active, now=100.3) == set()
    # Back within window_s, b keeps its deficit (not levelled up to a): a is held again.
    active = share.contending(both, now=101.0)
    assert share.ahead(active, now=101.0) == {"a"} and share.used["b"] == pytest.approx(0.3)
    # Away longer than window_s, a job starts level with the least served one.
    short = JobShare(window_s=1.0, slack_s=0.05, anticipate_s=0.0)
    short.ahead(short.contending(both, now=0.0), now=0.0)
    short.charge("a", 1.0)
    short.ahead(short.contending({"a": 1.0}, now=0.1), now=0.1)
    active = short.contending(both, now=5.0)
    assert short.ahead(active, now=5.0) == set()
    assert short.used["b"] / 3.0 == pytest.approx(short.used["a"] / 1.0)
    # No decay: a debt stays until paid, but no job is owed more than window_s per unit of priority.
    short.charge("a", 4.0)
    assert short.ahead(short.contending(both, now=5.1), now=5.1) == {"a"}
    assert short.used["a"] - short.used["b"] / 3.0 == pytest.approx(short.window_s)


def test_a_shared_schedulers_forward_backward_runs_in_parts_with_the_same_result(tiny_path):
    """On a shared scheduler a ForwardBackward runs a part of at most ``max_batch_tokens``
    tokens at a time (other work may run between parts): the loss, its metrics and the trained
    weights are those of the same call run whole on a scheduler of one user."""
    from protocols.messages import LogprobsRequest

    rng = np.random.default_rng(0)
    datums = []
    for n in (30, 50, 20, 60, 40):
        mask = (rng.random(n) < 0.5).astype(np.float32)
        datums.append(Datum(tokens=rng.integers(5, 900, n).astype(np.int32),
                            loss_inputs={"mask": mask, "advantages": rng.normal(size=n).astype(np.float32),
                                         "sampler_logprobs": np.full(n, -6.0, np.float32)}))
    fb = ForwardBackward(adapter="main", datums=datums, loss="ppo", normalizer=100.0)
    probe = LogprobsRequest(adapter="main", sequences=[d.tokens for d in datums[:2]])
    results = {}
    for shared in (False, True):
        s = SchedulerService(tiny_path, tenants=Tenants() if shared else None, engine_options={"max_batch_tokens": 64})
        ep = s.start()
        try:
            with SyncClient(ep, "owner") as c:
                c.request(CreateAdapter(name="main", spec=LoraSpec(seed=4)))
                before = s.compute_counters["op_parts"]
                out = c.request(fb)
                parts = s.compute_counters["op_parts"] - before
                c.request(OptimStep(adapter="main", params=AdamParams(lr=0.05)))
                results[shared] = (out, parts, c.request(probe).logprobs)
        finally:
            s.stop()
    (whole, n_whole, lp_whole), (split, n_split, lp_split) = results[False], results[True]
    assert n_whole == 1 and n_split == 5  # 30+50 > 64: every datum is a part of its own
    assert split.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    for k, v in whole.metrics.items():
        assert split.metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    for a, b in zip(lp_whole, lp_split):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_backlogged_jobs_get_compute_in_proportion_to_their_priorities(tiny_path):
    """Two jobs that keep the scheduler busy, priorities 1 and 3: while both wait, their compute
    counters split about 1 : 3 (a proportion of compute time, not a timing)."""
    s = SchedulerService(tiny_path, tenants=Tenants(), fair_window_s=30.0, engine_options={"max_rows": 16})  # saturated: 48 rows asked
    ep = s.start()
    prompts = [np.arange(3 + i, 40 + i, dtype=np.int32) for i in range(4)]
    params = SamplingParams(max_tokens=24, seed=1)
    try:
        with SyncClient(ep, "owner") as owner:
            opened = {p: owner.request(OpenJob(name=f"p{p}", priority=float(p))) for p in (1, 3)}
            clients = {p: SyncClient(ep, f"job{p}", credentials=Credentials(o.job, o.secret)) for p, o in opened.items()}
            for p, c in clients.items():
                c.request(CreateAdapter(name="main", spec=LoraSpec(seed=p)))
            enough, done = threading.Event(), {1: 0, 3: 0}

            def keep_busy(p: int) -> None:  # each job on its own: 6 requests in flight, each reply replaced
                c = clients[p]
                pending = [c.submit(SampleRequest(adapter="main", prompts=prompts, params=params)) for _ in range(6)]
                for _ in range(400):
                    c.result(pending.pop(0), 120)
                    done[p] += 1
                    if p == 3 and done[3] == 30:
                        enough.set()
                    if enough.is_set():
                        break
                    pending.append(c.submit(SampleRequest(adapter="main", prompts=prompts, params=params)))
                for rid in pending:
                    c.result(rid, 120)

            threads = [threading.Thread(target=keep_busy, args=(p,)) for p in clients]
            for t in threads:
                t.start()
            assert enough.wait(240)
            listed = owner.request(ListJobs()).jobs  # both still have work
            ms = {j.name: j.contended_ms for j in listed}
            assert all(0 < j.contended_ms <= j.compute_ms for j in listed)
            for t in threads:
                t.join(240)
            for c in clients.values():
                c.close()
        ratio = ms["p3"] / ms["p1"]
        assert 2.4 < ratio < 3.75, ms
    finally:
        s.stop()


@pytest.mark.slow
def test_the_endpoint_answers_while_a_job_trains_on_the_same_scheduler(service, tiny_path, tmp_path):
    import openai

    info = json.loads(service.read_text())
    client = openai.OpenAI(base_url=info["http"] + "/v1", api_key=info["api_key"], timeout=60, max_retries=0)
    job = subprocess.Popen(_cli("run", "--scheduler", str(service),
                                *_job_args(tiny_path, tmp_path, "--set", "name=served", "--set", "train.steps=6")),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    answered, deadline = [], time.monotonic() + 240
    try:
        while job.poll() is None and len(answered) < 3 and time.monotonic() < deadline:
            names = [m.id for m in client.models.list().data]
            mine = [n for n in names if n.endswith("_served/main")]
            if not mine:
                time.sleep(0.2)
                continue
            chat = client.chat.completions.create(model=mine[0], messages=[{"role": "user", "content": "Bet?"}],
                                                  max_tokens=4, seed=len(answered), logprobs=True)
            if job.poll() is None:  # answered while the job was still training
                answered.append(chat)
    finally:
        out = job.communicate(timeout=300)[0]
    assert job.returncode == 0, out[-3000:]
    assert len(answered) == 3, "no chat completion from the job's adapter while it trained"
    for chat in answered:
        lps = [t.logprob for t in chat.choices[0].logprobs.content]
        assert chat.usage.completion_tokens >= len(lps) >= 1 and all(math.isfinite(x) and x <= 0 for x in lps)
    # Once the job ended its adapter is gone: an unknown model, in OpenAI's error format.
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model=mine[0], messages=[{"role": "user", "content": "Bet?"}], max_tokens=2)
    assert e.value.code == "model_not_found"


# ------------------------------------------------------------------------ the job queue


@pytest.mark.slow
def test_a_job_attaches_to_a_service_on_curve_with_a_copy_of_its_file(tiny_path, tmp_path):
    """``serve --bus-curve`` (what ``--bus-host`` with an address other machines reach does):
    the service file carries the scheduler's CURVE key and the owner's pair, and a job given a
    copy of it (as on another machine, its run folder on a shared file system) trains and
    evaluates over CURVE; ``status`` works with the copy; the owner's PLAIN secret gets nothing."""
    file = tmp_path / "service.json"
    proc = start_serve(file, "--model", tiny_path, "--bus-curve", cwd=ROOT)
    try:
        info = json.loads(file.read_text())
        assert all(len(info[k]) == 40 for k in ("curve_server", "curve_public", "curve_secret"))
        copy = tmp_path / "elsewhere" / "service.json"
        copy.parent.mkdir()
        copy.write_text(file.read_text())
        r = subprocess.run(_cli("run", *_job_args(tiny_path, tmp_path / "runs"), "--scheduler", str(copy)),
                           capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        summary = _summary(tmp_path / "runs")
        assert summary["last_eval"]["eval/main/version"] == 2 and summary["last_eval"]["eval/main/vs_random/hands"] > 0
        report = _status(copy)
        assert [j["state"] for j in report["jobs"]] == ["closed"] and report["adapters"] == []
        with pytest.raises(TimeoutError):  # PLAIN, even with the owner's own secret
            SyncClient(info["endpoint"], "plain", credentials=Credentials(info["user"], info["secret"]),
                       connect_timeout=1.5)
    finally:
        proc.terminate()
        proc.communicate(timeout=120)


def test_sigusr1_writes_every_threads_stack_and_the_process_goes_on(tiny_path, tmp_path):
    """``kill -USR1`` on an opentinker process (here a service, waiting in its main thread)
    writes each thread's Python stack to its stderr; it keeps serving and stops as usual."""
    file = tmp_path / "service.json"
    proc = start_serve(file, "--model", tiny_path, cwd=ROOT)
    try:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        assert proc.poll() is None  # still serving
        info = json.loads(file.read_text())
        SyncClient(info["endpoint"], "plain", credentials=Credentials(info["user"], info["secret"]),
                   connect_timeout=5).close()
    finally:
        proc.terminate()
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "Current thread" in out and 'line' in out and "in wait" in out, out[-3000:]
    assert "scheduler-compute" in out or out.count("Thread 0x") >= 3, out[-3000:]


def _jobs(*args: str, service: Path) -> subprocess.CompletedProcess:
    return subprocess.run(_cli("jobs", *args, "--service", str(service)), capture_output=True, text=True, cwd=ROOT,
                          timeout=300, check=False)


def _queue(service: Path) -> dict:
    r = _jobs("list", "--json", service=service)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_the_queue_runs_jobs_within_its_budget_and_nothing_blocks_it(tiny_path, tmp_path):
    """A budget that holds one job at a time: submitted jobs run one after another; a job the
    budget can never hold is refused with the numbers; a cancelled job and a failed one free
    their room and their adapters, and the queue goes on; an evaluation and a batch inference
    queue behind them and write their report and replies."""
    file = tmp_path / "service.json"
    proc = start_serve(file, "--model", tiny_path, "--budget-mb", "600", "--out-root", str(tmp_path / "runs"), cwd=ROOT)
    try:
        big = _jobs("submit", *_job_args(tiny_path, tmp_path / "runs"), "--memory-mb", "1000", service=file)
        assert big.returncode == 2 and "needs about 1000.0 MB" in big.stderr and "budget is 600.0 MB" in big.stderr
        assert not big.stderr.startswith("opentinker jobs submit: ValueError")  # the reason, not our class
        # A job naming another model than the service's is refused, as run --scheduler refuses it.
        other = tmp_path / "other_model"
        shutil.copytree(tiny_path, other)
        wrong = _jobs("submit", *_job_args(str(other), tmp_path / "runs"), service=file)
        assert wrong.returncode == 2 and "model.base: the service serves" in wrong.stderr, wrong.stderr
        ids = []
        for i, extra in enumerate((["--set", "name=first"], ["--set", "name=crashes", "--set", "train.steps=400"],
                                   ["--set", "name=cancelled"], ["--set", "name=last"])):
            # Each is charged at least its process (300 MB): 350 MB, one at a time in 600.
            r = _jobs("submit", *_job_args(tiny_path, tmp_path / "runs", *extra), "--memory-mb", "350", service=file)
            assert r.returncode == 0, r.stderr
            ids.append(r.stdout.split()[0])
        assert ids == ["q1", "q2", "q3", "q4"]
        q = {e["id"]: e for e in _queue(file)["jobs"]}
        # One at a time: q1 runs (or has run), q3 waits.
        assert q["q1"]["state"] in ("running", "done") and q["q3"]["state"] == "queued", _jobs_report(q)
        assert _jobs("cancel", "q3", service=file).returncode == 0
        # q2 trains for long: kill its process (a crash), once it holds an adapter on the scheduler.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            q = {e["id"]: e for e in _queue(file)["jobs"]}
            if q["q2"]["state"] == "running" and any(
                    j["job"] == q["q2"]["job"] and j["adapters"] for j in _status(file)["jobs"]):
                break
            time.sleep(0.3)
        else:
            raise AssertionError("q2 never held an adapter:\n" + _jobs_report(q))
        # An evaluation of the first run, queued behind the rest (it may write only in its own folder).
        assert q["q1"]["state"] == "done" and q["q1"]["kind"] == "run" and Path(q["q1"]["output"]).is_dir()
        bad = _jobs("submit", "--eval", str(tmp_path / "nowhere"), service=file)
        assert bad.returncode == 2 and "nowhere: no such file or folder" in bad.stderr
        r = _jobs("submit", "--eval", q["q1"]["output"], "--games-per-stratum", "1", "--memory-mb", "350", service=file)
        assert r.returncode == 0 and r.stdout.startswith("q5 queued (eval_kuhn_poker_v0__first__"), r.stderr
        ids.append("q5")
        # Batch inference with the first run's adapter, queued behind it too.
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt": "Hello"}\n{"messages": [{"role": "user", "content": "Bet or check?"}]}\n')
        bad = _jobs("submit", "--infer", str(tmp_path / "none.jsonl"), service=file)
        assert bad.returncode == 2 and "none.jsonl: no such file" in bad.stderr
        infer_args = ["--adapter", q["q1"]["output"], "--max-tokens", "4", "--seed", "3"]
        r = _jobs("submit", "--infer", str(prompts), *infer_args, "--memory-mb", "350", service=file)
        assert r.returncode == 0 and r.stdout.startswith("q6 queued (infer_prompts, ~350 MB)"), r.stderr
        ids.append("q6")
        pid = _pid_of_job(q["q2"]["log"])
        os.kill(pid, 9)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and {e["state"] for e in _queue(file)["jobs"]} & {"queued", "running"}:
            time.sleep(0.5)
        q = {e["id"]: e for e in _queue(file)["jobs"]}
        assert [q[i]["state"] for i in ids] == ["done", "failed", "cancelled", "done", "done", "done"], _jobs_report(q)
        report = json.loads(Path(q["q5"]["output"]).read_text())
        assert q["q5"]["kind"] == "eval" and report["path"] == q["q1"]["output"]
        assert report["metrics"]["eval/main/vs_random/hands"] > 0 and q["q5"]["started_at"] >= q["q4"]["ended_at"]
        assert q["q3"]["job"] == "" and q["q4"]["started_at"] >= q["q2"]["ended_at"]
        # The queued inference replied as the same command run on its own does.
        alone = tmp_path / "alone.jsonl"
        r = subprocess.run(_cli("infer", str(prompts), "--out", str(alone), "--model", tiny_path, "--threads", "1",
                                *infer_args), capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
        assert r.returncode == 0, r.stderr
        queued = [json.loads(line) for line in Path(q["q6"]["output"]).read_text().splitlines()]
        own = [json.loads(line) for line in alone.read_text().splitlines()]
        assert q["q6"]["kind"] == "infer" and [x["model"] for x in queued] == ["main", "main"]
        assert [x["tokens"] for x in queued] == [x["tokens"] for x in own] and all(x["tokens"] for x in own)
        assert _queue(file)["used_mb"] == 0
        report = _status(file)
        assert report["adapters"] == [] and all(j["state"] == "closed" for j in report["jobs"])
        assert len(list((tmp_path / "runs").glob("kuhn_poker_v0__last__*/summary.json"))) == 1
    finally:
        proc.terminate()
        proc.communicate(timeout=120)


def _status(file: Path) -> dict:
    r = subprocess.run(_cli("status", str(file), "--json"), capture_output=True, text=True, cwd=ROOT, timeout=120,
                       check=True)
    return json.loads(r.stdout)


def _jobs_report(q: dict) -> str:
    """Each queued job's state, times (seconds after the first submission) and the end of its
    log, where a job still running has first written its threads' stacks (SIGUSR1): what a
    failed wait on the queue shows."""
    from opentinker.serve.job_procs import PROC_FILE

    t0 = min(e["submitted_at"] for e in q.values())
    lines = [_machine_now()]
    for e in q.values():
        record = Path(e["log"]).parent / PROC_FILE if e["log"] else None
        if e["state"] == "running" and record is not None and record.is_file():
            pid = json.loads(record.read_text())["pid"]
            lines.append(f"{e['id']} pid {pid}: {_proc_now(pid)}; 2 s later: {_proc_now(pid, 2.0)}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)
    for i, e in q.items():
        times = " ".join(f"{k}={e[k] - t0:.1f}" for k in ("submitted_at", "started_at", "ended_at") if e[k])
        tail = Path(e["log"]).read_text(errors="replace")[-6000:] if e["log"] and Path(e["log"]).is_file() else ""
        lines.append(f"{i} {e['name']} {e['state']} rc={e['returncode']} {times}\n{tail}")
    return "\n".join(lines)


def _proc_now(pid: int, after_s: float = 0.0) -> str:
    """A process's state, CPU seconds (user, system), nice, scheduling policy and resident
    memory (from /proc), after ``after_s``: a job that computes, waits or is starved."""
    from opentinker.serve.job_procs import proc_stat

    time.sleep(after_s)
    stat = proc_stat(pid)
    try:
        rss = next((x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS")), "")
    except OSError as e:
        return f"gone ({e})"
    if stat is None:
        return "gone"
    f = stat[1]
    tick = os.sysconf("SC_CLK_TCK")
    return (f"state {f[0]}, cpu {int(f[11]) / tick:.2f}+{int(f[12]) / tick:.2f} s, nice {f[16]}, "
            f"threads {f[17]}, policy {f[38]}, {' '.join(rss.split()[1:])}")


def _machine_now(window_s: float = 2.0) -> str:
    """The machine's load, available memory, (where the kernel has them) pressure, and over
    ``window_s``: where its CPU time went (user, system, idle, iowait, steal: a stalled VM
    shows steal) and the five processes that took the most of it (a hog beside the job)."""
    meminfo = dict(x.split(":", 1) for x in Path("/proc/meminfo").read_text().splitlines() if ":" in x)
    pressure = " ".join(f"{k}: {Path(f'/proc/pressure/{k}').read_text().splitlines()[0]}"
                        for k in ("cpu", "memory", "io") if Path(f"/proc/pressure/{k}").is_file())
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    before, procs_before = _cpu_ticks(), _proc_ticks()
    time.sleep(window_s)
    after, procs_after = _cpu_ticks(), _proc_ticks()
    total = max(1, sum(after) - sum(before))
    split = ", ".join(f"{n} {100 * (a - b) / total:.0f}%" for n, a, b in zip(names, after, before, strict=False))
    used = sorted(((t - procs_before.get(pid, (t, ""))[0], pid, name) for pid, (t, name) in procs_after.items()),
                  reverse=True)[:5]
    tick = os.sysconf("SC_CLK_TCK")
    hogs = ", ".join(f"{name} (pid {pid}) {d / tick:.2f} s" for d, pid, name in used if d > 0)
    return (f"load {Path('/proc/loadavg').read_text().strip()}; MemAvailable {meminfo.get('MemAvailable', '?').strip()}"
            f"; {pressure or 'no PSI'}; CPU over {window_s:.0f} s: {split}; most CPU: {hogs or 'none'}")


def _cpu_ticks() -> list[int]:
    """The machine's CPU time by kind (``/proc/stat``'s first line), in clock ticks."""
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]


def _proc_ticks() -> dict[int, tuple[int, str]]:
    """Every process's CPU time so far (user + system, clock ticks) and name, by pid."""
    from opentinker.serve.job_procs import proc_stat

    out = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and (stat := proc_stat(int(p.name))) is not None:
            name, f = stat
            out[int(p.name)] = (int(f[11]) + int(f[12]), name)
    return out


def _pid_of_job(log: str) -> int:
    """The pid of the ``opentinker run`` process writing ``log`` (its open file, from /proc)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == log for fd in (proc / "fd").iterdir()) and \
                    b"opentinker.cli\0run" in (proc / "cmdline").read_bytes():
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no process writes {log}")
