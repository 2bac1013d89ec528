"""One scheduler per device (``runtime.devices``): where policies are placed, where requests
go, and a whole job on two CPU schedulers (the local backend: the real bus, schedulers, env
runners, learners and coordinator in one process)."""

from __future__ import annotations

import msgspec
import pytest
from conftest import with_overrides

from opentinker.bus.sync import SyncClient
from opentinker.config import ConfigError, JobConfig, config_from_dict
from opentinker.control.component import describe
from opentinker.control.placement import place, scheduler_devices, scheduler_resources
from opentinker.control.runtime import Job
from opentinker.rollout.routes import Routes
from protocols.messages import AdapterList, ListAdapters


def _cfg(**over) -> JobConfig:
    raw = {
        "model": {"base": "tiny-random", "threads": 1},
        "runtime": {"backend": "local", "env_runners": 2, "timeout_s": 120, "devices": ["cpu", "cpu"]},
        "train": {"groups_per_step": 2, "group_size": 2, "lr": 1e-2, "checkpoint_every": 0},
        "sampling": {"max_tokens": 4},
        "eval": {"hands_per_stratum": 1, "head_to_head_per_stratum": 1, "cross_play_per_stratum": 1},
        "policies": [{"name": "main", "opponents": {"random": 1, "other": 1, "past": 1}},
                     {"name": "other", "opponents": {"random": 1, "main": 1}}],
        "league": {"snapshot_every": 1, "keep": 2, "pool": "all"},
    }
    return msgspec.convert(with_overrides(raw, over), JobConfig)


def _policies(*specs: dict) -> list[dict]:
    return [{"opponents": {"random": 1}, **s} for s in specs]


# ----------------------------------------------------------------------------- placement


def test_policies_are_balanced_by_adapter_count_and_pinned_where_the_config_says():
    cfg = _cfg(runtime={"devices": ["cpu", "cpu", "cpu"]}, league={"snapshot_every": 0},
               policies=_policies({"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d"}))
    assert place(cfg) == {"a": 0, "b": 1, "c": 2, "d": 0}
    assert scheduler_devices(cfg) == ["cpu", "cpu", "cpu"]
    pinned = _cfg(league={"snapshot_every": 0},
                  policies=_policies({"name": "a", "device": 1}, {"name": "b", "device": 1}, {"name": "c"}))
    assert place(pinned) == {"a": 1, "b": 1, "c": 0}
    # A full-parameter policy is a whole model copy: copies are spread before adapters are.
    full = _cfg(league={"snapshot_every": 0},
                policies=_policies({"name": "a"}, {"name": "b"}, {"name": "f", "kind": "full"},
                                   {"name": "g", "kind": "full"}))
    assert place(full) == {"f": 0, "g": 1, "a": 0, "b": 1}
    # Without devices: one scheduler on model.device, every policy on it.
    one = _cfg(runtime={"devices": []}, model={"device": "cpu"})
    assert scheduler_devices(one) == ["cpu"] and set(place(one).values()) == {0}


def test_a_policy_with_a_league_counts_its_snapshots():
    cfg = _cfg(runtime={"devices": ["cpu", "cpu"]}, league={"snapshot_every": 1, "keep": 3, "pool": "own"},
               policies=_policies({"name": "a"}, {"name": "b"}, {"name": "c"}))
    # Each policy weighs 1 + 3 adapters: a, b on their own schedulers, c beside a.
    assert place(cfg) == {"a": 0, "b": 1, "c": 0}


@pytest.mark.parametrize("over, field, words", [
    ({"runtime": {"devices": ["cpu", "gpu"]}}, "runtime.devices[1]", "cpu|cuda"),
    ({"runtime": {"devices": ["cuda:0", "cuda:0"]}}, "runtime.devices", "names a GPU twice"),
    ({"runtime": {"devices": ["cuda", "cuda:0"]}}, "runtime.devices", "names a GPU twice"),
    ({"runtime": {"devices": ["cpu", "cpu"], "scheduler": "tcp://127.0.0.1:5555"}}, "runtime.devices",
     "shared scheduler"),
    ({"policies": [{"name": "main", "device": 2}]}, "policies[main].device", "not an index into runtime.devices"),
    ({"runtime": {"devices": []}, "policies": [{"name": "main", "device": 1}]}, "policies[main].device",
     "not an index"),
])
def test_bad_device_configs_name_the_field(over, field, words):
    raw = {"model": {"base": "tiny-random"}, "runtime": {"backend": "local"}}
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert e.value.field == field and any(w in str(e.value) for w in words.split("|")), str(e.value)


def test_cuda_on_ray_may_repeat_and_asks_ray_for_a_gpu_each():
    cfg = config_from_dict({"model": {"base": "tiny-random"},
                                 "runtime": {"backend": "ray", "devices": ["cuda", "cuda"]}})
    assert [scheduler_resources(cfg, d) for d in scheduler_devices(cfg)] == [{"GPU": 1.0}, {"GPU": 1.0}]
    pinned = config_from_dict({"model": {"base": "tiny-random"},
                                    "runtime": {"backend": "ray", "devices": ["cuda:0", "cuda:1"]}})
    assert [scheduler_resources(pinned, d) for d in scheduler_devices(pinned)] == [{}, {}]  # chosen by hand
    assert describe("scheduler1") == "scheduler 1" and describe("scheduler") == "the scheduler"


def test_routes_send_a_snapshot_to_its_policys_scheduler():
    routes = Routes("tcp://a", {"main": "tcp://a", "other": "tcp://b"})
    assert routes("other") == routes("other__s12") == "tcp://b"
    assert routes("main__s3") == routes(None) == routes("stranger") == "tcp://a"
    assert routes.endpoints() == ["tcp://a", "tcp://b"]
    assert Routes("tcp://a").endpoints() == ["tcp://a"]


# ----------------------------------------------------------------------------- a job on two schedulers


def _adapters(endpoint: str) -> set[str]:
    with SyncClient(endpoint, "test") as client:
        reply = client.request(ListAdapters())
    assert isinstance(reply, AdapterList)
    return {a.name for a in reply.adapters}


def test_a_job_on_two_cpu_schedulers_trains_plays_across_them_and_saves(tiny_path, tmp_path):
    job = Job(_cfg(), tiny_path, run_dir=str(tmp_path))
    try:
        assert job.placement == {"main": 0, "other": 1} and len(set(job.scheduler_endpoints)) == 2
        first, second = job.scheduler_endpoints
        assert _adapters(first) == {"main"} and _adapters(second) == {"other"}
        before = job.info()
        m1 = job.coordinator("train_step", 1)
        m2 = job.coordinator("train_step", 2)
        after = job.info()

        def delta(name: str, key: str) -> int:
            return after[name]["counters"].get(key, 0) - before[name]["counters"].get(key, 0)

        # Each policy trains on its own scheduler, once a step; both schedulers sampled.
        for name in ("scheduler", "scheduler1"):
            assert delta(name, "ForwardBackward") == delta(name, "OptimStep") == 2
            assert delta(name, "recv/SampleRequest") > 0
        assert m2["train/main/version"] == m2["train/other/version"] == 2
        # The runners' requests all went somewhere, and the step's engine metrics count both schedulers.
        samples = sum(delta(f"env_runner{i}", "client/sent/SampleRequest") for i in range(2))
        assert samples == delta("scheduler", "recv/SampleRequest") + delta("scheduler1", "recv/SampleRequest")
        decoded = sum(delta(n, "engine/decode_tokens") for n in ("scheduler", "scheduler1"))
        assert m1["perf/engine/decode_tokens"] + m2["perf/engine/decode_tokens"] == decoded > 0
        # The league's snapshots live beside their policies; main's pool ("all") plays other's.
        assert _adapters(first) == {"main", "main__s1", "main__s2"}
        assert _adapters(second) == {"other", "other__s1", "other__s2"}
        # Cross-play between the schedulers, and the game's exact measure through main's.
        ev = job.coordinator("evaluate", 2, True, 1)
        assert ev["eval/main/vs_other/hands"] > 0 and ev["eval/other/vs_main/hands"] > 0
        assert ev["eval/main/version"] == ev["eval/other/version"] == 2
        # Saved from, and loaded back into, the scheduler each adapter lives on.
        saved = job.coordinator("save_adapters", str(tmp_path / "ckpt"))
        assert set(saved) == {"main", "other"}
        assert sorted(p.name for p in (tmp_path / "ckpt" / "league").iterdir()) == [
            "main__s1", "main__s2", "other__s1", "other__s2"]
        versions = job.coordinator("load_adapters", str(tmp_path / "ckpt"), 2)
        assert versions == {"main": 2, "other": 2}
        assert _adapters(first) == {"main", "main__s1", "main__s2"}
        assert _adapters(second) == {"other", "other__s1", "other__s2"}
    finally:
        job.shutdown()


def test_a_scheduler_only_job_starts_one_scheduler(tiny_path):
    """Evaluation, play and offline jobs of a run on several devices talk to one scheduler."""
    job = Job(_cfg(), tiny_path, scheduler_only=True)
    try:
        assert job.devices == ["cpu"] and len(job.scheduler_endpoints) == 1
        assert set(job.info()) == {"scheduler"} and set(job.routes.values()) == {job.scheduler_endpoint}
    finally:
        job.shutdown()
