"""One end-to-end path through Ray: every component its own process; samples and
trajectories on the bus; the driver's Ray calls per training step do not grow with the
number of episodes per step."""

from __future__ import annotations

import os

import msgspec
import pytest
from conftest import private_ray_tmp

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


def test_local_job_listens_on_loopback(ray_session, tiny_path):
    """Every socket a local Ray job listens on, in this process and every process below it
    (Ray's GCS, raylet, agents and workers, our actors), listed while the job trains: the bus
    sockets of our components are on 127.0.0.1; what listens on other interfaces is Ray's own
    gRPC and agent servers (Ray has no option to bind them to loopback), and the cluster
    requires Ray's token authentication for them (docs/security.md)."""
    import ipaddress

    import psutil
    from ray._raylet import AuthenticationMode, get_authentication_mode

    job = Job(_cfg(1), tiny_path)
    try:
        job.coordinator("train_step", 1)  # every component up and talking
        me = psutil.Process()
        listening = set()
        tree = [me, *me.children(recursive=True)]
        for p in tree:
            try:
                name, cmd, conns = p.name(), " ".join(p.cmdline()), p.net_connections(kind="inet")
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            listening |= {(p.pid, name, cmd[:200], c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
        actors = {i["pid"] for i in job.info().values()}
        ours = [job.scheduler_endpoint]
        auth_mode = get_authentication_mode()
    finally:
        job.shutdown()
    for row in sorted(listening, key=lambda r: r[1]):
        print(row)
    assert actors <= {p.pid for p in tree}  # the actors were among the processes listed
    assert all(e.startswith("tcp://127.0.0.1:") for e in ours)
    bus_ports = {int(e.rsplit(":", 1)[1]) for e in ours}
    wide: dict[int, list] = {}
    for pid, name, cmd, ip, port in listening:
        if port in bus_ports:
            assert ip == "127.0.0.1", (name, ip, port)
        if not ipaddress.ip_address(ip).is_loopback:
            wide.setdefault(pid, []).append((name, ip, port))
    ray_servers = {"gcs_server", "raylet", "ray::RuntimeEnvAgent", "ray::DashboardAgent"}
    for pid, socks in wide.items():
        if socks[0][0] in ray_servers:
            continue
        # A Ray worker (our actors) or the driver: only Ray's core-worker gRPC server, one
        # wildcard port; every bus socket of ours is on 127.0.0.1 (a non-loopback bind needs
        # CURVE keys, which a local job never has).
        assert len(socks) == 1 and socks[0][1] in ("::", "0.0.0.0"), (pid, socks)
    assert sum(1 for pid, *_, ip, _ in listening if pid in actors and ip == "127.0.0.1") >= len(actors)  # our bus
    assert auth_mode == AuthenticationMode.TOKEN


def test_a_pettingzoo_env_named_in_a_config_trains_under_ray(ray_session, tiny_path):
    """``game = "pettingzoo.classic.connect_four_v3"``: every actor makes the bridged env from
    its name (no code), two training steps run, and it is evaluated against random."""
    cfg = msgspec.convert(
        {
            "game": "pettingzoo.classic.connect_four_v3",
            "model": {"base": "tiny-random", "threads": 1},
            "runtime": {"backend": "ray", "env_runners": 2, "timeout_s": 120},
            "train": {"groups_per_step": 2, "group_size": 2},
            "sampling": {"max_tokens": 3},
            "eval": {"head_to_head_per_stratum": 0},
            "policies": [{"name": "main", "opponents": {"random": 1, "self": 1}}],
        },
        JobConfig,
    )
    assert "connect_four_v3" in cfg.system_prompt  # the bridged env's default hook
    job = Job(cfg, tiny_path)
    try:
        metrics = [job.coordinator("train_step", s) for s in (1, 2)]
        assert [m["train/main/version"] for m in metrics] == [1, 2]
        assert sum(m["train/episodes"] for m in metrics) == 2 * 2 * 2
        assert sum(m["train/main/n_datums"] for m in metrics) >= 2 * 2 * 2
        ev = job.coordinator("evaluate", 2, False, 1)
        assert ev["eval/main/vs_random/hands"] == 6 * 2  # 6 blocks of seeds x 2 seats
        assert -1.0 <= ev["eval/main/vs_random/reward"] <= 1.0
        assert ev["eval/main/vs_random/wins"] + ev["eval/main/vs_random/draws"] + ev["eval/main/vs_random/losses"] == 12
    finally:
        job.shutdown()


def test_two_schedulers_run_as_two_ray_actors(ray_session, tiny_path):
    """``runtime.devices = ["cpu", "cpu"]`` on Ray: one scheduler process per device, each
    policy trained on its own, the runners' requests split between them."""
    cfg = msgspec.convert({
        "model": {"base": "tiny-random", "threads": 1},
        "runtime": {"backend": "ray", "env_runners": 1, "timeout_s": 120, "devices": ["cpu", "cpu"]},
        "train": {"groups_per_step": 2, "group_size": 2},
        "sampling": {"max_tokens": 3},
        "policies": [{"name": "main", "opponents": {"other": 1}}, {"name": "other", "opponents": {"main": 1}}],
    }, JobConfig)
    job = Job(cfg, tiny_path)
    try:
        info = job.info()
        assert info["scheduler"]["pid"] != info["scheduler1"]["pid"]
        m = job.coordinator("train_step", 1)
        info = job.info()
        assert m["train/main/version"] == m["train/other/version"] == 1
        for name in ("scheduler", "scheduler1"):
            assert info[name]["counters"].get("OptimStep", 0) == 1
            assert info[name]["counters"].get("recv/SampleRequest", 0) > 0
    finally:
        job.shutdown()


def test_a_stale_cluster_file_or_ray_address_is_not_joined(tmp_path):
    """A job without ``runtime.address`` starts its own Ray instance even where
    ``/tmp/ray/ray_current_cluster`` names a dead cluster (a ``ray start`` or a test's
    ``Cluster`` killed before it cleaned up) and ``RAY_ADDRESS`` is set: a plain ``ray.init()``
    would join that address and refuse ``num_cpus`` (a CI run failed so, every Ray test)."""
    import subprocess
    import sys

    with private_ray_tmp() as root:
        (root / "ray").mkdir()
        (root / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
        env = {**os.environ, "RAY_TMPDIR": str(root), "RAY_ADDRESS": "127.0.0.1:1"}
        code = ("import ray; from opentinker.control.placement import init_ray; "
                "print('started', init_ray(''), ray.is_initialized()); ray.shutdown()")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "started True True" in proc.stdout
        assert (root / "ray" / "ray_current_cluster").read_text() == "127.0.0.1:1\n"  # left as it was
