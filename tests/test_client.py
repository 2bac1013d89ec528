"""The Tinker-shaped Python client against a real scheduler (tiny-random, in this process and
one a job started)."""

from __future__ import annotations

import numpy as np
import pytest

from opentinker.client import RequestFailed, ServiceClient
from protocols.messages import AdamParams, Datum, SamplingParams


def _datums(rows, prompt: np.ndarray) -> list[Datum]:
    """Each sampled reply after ``prompt`` as a datum: the reply is the loss tokens,
    advantages +1 for the first row, -1 for the others."""
    out = []
    for i, (tokens, logprobs) in enumerate(zip(rows.tokens, rows.logprobs)):
        seq = np.concatenate([prompt, tokens]).astype(np.int32)
        mask = np.zeros(len(seq), np.float32)
        mask[len(prompt):] = 1
        lp = np.zeros(len(seq), np.float32)
        lp[len(prompt):] = logprobs
        out.append(Datum(tokens=seq, loss_inputs={"mask": mask, "advantages": mask * (1.0 if i == 0 else -1.0),
                                                  "sampler_logprobs": lp}))
    return out


@pytest.fixture(scope="module")
def service(tiny_path):
    with ServiceClient(model=tiny_path, threads=1) as s:
        yield s


def test_sample_train_and_snapshot(service, tmp_path):
    policy = service.create_lora_training_client("main", rank=4, seed=3)
    prompt = np.arange(10, 30, dtype=np.int32)
    rows = policy.sample([prompt], SamplingParams(max_tokens=5, seed=7), num_samples=3).result()
    assert len(rows.tokens) == 3 and all(len(t) == 5 for t in rows.tokens) and rows.adapter_version == 0
    # Teacher-forced log-probs of a sampled reply are the sampler's (the same forward).
    scored = policy.compute_logprobs([np.concatenate([prompt, rows.tokens[0]])]).result()[0]
    np.testing.assert_allclose(scored[len(prompt):], rows.logprobs[0], atol=1e-4)
    frozen = policy.save_weights_for_sampler("main_v0")
    # Requests pipeline: both are on the wire before either reply is read.
    fb = policy.forward_backward(_datums(rows, prompt), "importance_sampling")
    step = policy.optim_step(AdamParams(lr=0.05))
    assert np.isfinite(fb.result().loss) and step.result().version == 1
    after = np.concatenate([prompt, rows.tokens[0]])
    live = policy.compute_logprobs([after]).result()[0]
    still = frozen.compute_logprobs([after]).result()[0]
    np.testing.assert_allclose(still, scored, atol=1e-5)  # the snapshot did not move
    assert np.abs(live - scored).max() > 1e-3  # the policy did
    # Saved and loaded back: the same weights and version.
    saved = policy.save_state(str(tmp_path / "main")).result()
    assert saved.version == 1
    policy.optim_step(AdamParams(lr=0.05)).result()
    assert policy.load_state(str(tmp_path / "main")).result().version == 1
    np.testing.assert_allclose(policy.compute_logprobs([after]).result()[0], live, atol=1e-5)
    other = service.create_training_client_from_state(str(tmp_path / "main"), "copy")
    np.testing.assert_allclose(other.compute_logprobs([after]).result()[0], live, atol=1e-5)


def test_a_full_parameter_policy_and_the_base_model(service):
    full = service.create_full_training_client("whole", seed=1)
    base = service.create_sampling_client()
    seq = np.arange(40, 60, dtype=np.int32)
    # Untrained, both are the base model.
    np.testing.assert_allclose(full.compute_logprobs([seq]).result()[0], base.compute_logprobs([seq]).result()[0],
                               atol=1e-5)


def test_refused_calls_name_the_call_and_the_reason(service):
    ghost = service.create_sampling_client("nobody")
    with pytest.raises(RequestFailed, match=r"sample from nobody: .*nobody"):
        ghost.sample([np.arange(5)], SamplingParams(max_tokens=2)).result()
    policy = service.create_lora_training_client("refuse")
    with pytest.raises(RequestFailed, match="forward_backward on 'refuse'"):
        policy.forward_backward([Datum(tokens=np.arange(6, dtype=np.int32),
                                       loss_inputs={"mask": np.ones(6, np.float32)})], "no_such_loss").result()
    with pytest.raises(RequestFailed, match="create adapter 'bad': .*rank"):
        service.create_lora_training_client("bad", rank=0)
    # The client goes on serving after refusals.
    assert len(policy.sample([np.arange(5)], SamplingParams(max_tokens=2)).result().tokens) == 1


def test_a_client_on_a_jobs_scheduler(tiny_path):
    """A scheduler a job started (here: one started alone, as ``opentinker eval`` does)."""
    import msgspec

    from opentinker.config import JobConfig
    from opentinker.control.runtime import Job

    cfg = msgspec.convert({"model": {"base": "tiny-random", "threads": 1}, "runtime": {"backend": "local"}}, JobConfig)
    job = Job(cfg, tiny_path, scheduler_only=True)
    try:
        with ServiceClient(job.scheduler_endpoint, model=tiny_path) as service:
            p = service.create_lora_training_client("x")
            assert len(p.sample([np.arange(8)], SamplingParams(max_tokens=3), num_samples=2).result().tokens) == 2
    finally:
        job.shutdown()


def test_the_rl_loop_on_a_page_runs_and_prints_its_table(tiny_path, capsys):
    from pathlib import Path

    from opentinker import rl_loop

    assert len(Path(rl_loop.__file__).read_text().splitlines()) <= 200  # one page
    rows = rl_loop.main(["--model", tiny_path, "--steps", "2", "--groups", "2", "--group_size", "2"])
    assert [r["version"] for r in rows] == [1, 2]
    assert all(-2.0 <= r["reward"] <= 2.0 and 0.0 <= r["invalid"] <= 1.0 and np.isfinite(r["loss"]) for r in rows)
    out = capsys.readouterr().out
    assert "GRPO on kuhn_poker_v0" in out and "chips/hand" in out


def test_opentinker_run_starts_a_job_from_python(tmp_path, tiny_path):
    import opentinker
    from opentinker.config import ConfigError

    with pytest.raises(ConfigError, match="train.steps"):
        opentinker.run({"train": {"steps": -1}})  # named before anything starts
    result = opentinker.run("default", {"model": {"base": "tiny-random", "threads": 1},
                                        "runtime": {"backend": "local", "env_runners": 1},
                                        "train": {"steps": 1, "groups_per_step": 1, "group_size": 2},
                                        "sampling": {"max_tokens": 3}, "out_dir": str(tmp_path),
                                        "eval": {"hands_per_stratum": 1, "head_to_head_per_stratum": 0}})
    assert result.run_dir.parent == tmp_path and [r["kind"] for r in result.rows] == ["eval", "train", "eval"]
    assert (result.run_dir / "adapters" / "main").is_dir()


@pytest.mark.slow
def test_a_client_on_opentinker_serve_opens_a_job_and_closes_it(tiny_path, tmp_path):
    """On ``opentinker serve`` (its service file) the client opens a job, as ``run --scheduler``
    does; its adapters live there until ``close``; a model the service does not serve is refused."""
    from conftest import start_serve

    from opentinker.bus.sync import SyncClient
    from opentinker.config import ConfigError
    from opentinker.control.attach import find_service
    from protocols.messages import ListJobs

    file = tmp_path / "service.json"
    proc = start_serve(file, "--model", tiny_path)
    try:
        with ServiceClient(str(file), model=tiny_path, job="notebook") as service:
            policy = service.create_lora_training_client("mine")
            rows = policy.sample([np.arange(8)], SamplingParams(max_tokens=3), num_samples=2).result()
            assert len(rows.tokens) == 2
            info = find_service(str(file))
            with SyncClient(info.endpoint, "check", credentials=info.credentials()) as owner:
                jobs = owner.request(ListJobs()).jobs
            assert [j.job for j in jobs if j.state == "running"] and any(
                "mine" in a for j in jobs for a in j.adapters)
        with SyncClient(info.endpoint, "check", credentials=info.credentials()) as owner:
            assert all(j.state == "closed" and not j.adapters for j in owner.request(ListJobs()).jobs)
        other = tmp_path / "other_model"
        import shutil

        shutil.copytree(tiny_path, other)
        with pytest.raises(ConfigError, match="the service serves"):
            ServiceClient(str(file), model=str(other))
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
