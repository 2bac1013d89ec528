"""Hostile input and local security (docs/security.md): configs refused before anything
starts, run folders that stay inside ``out_dir``, log records that stay one line, and losses
that stay finite for any finite input."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from opentinker.cli import main
from opentinker.config import ConfigError, JobConfig, check_name, load_config
from opentinker.control.config_checks import _check_device, check_config, check_model
from opentinker.logs import escape_controls

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "opentinker: bad config: "


@pytest.fixture(autouse=True)
def _never_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config these tests expect refused must never start a job (a wrong expectation fails
    at once instead of running one)."""
    import opentinker.run

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a job started")

    monkeypatch.setattr(opentinker.run, "run_job", refuse)


def _refused(capsys: pytest.CaptureFixture[str], out_dir: Path, *sets: str) -> str:
    """Run ``opentinker run --set ...`` in-process; assert exit 2, one stderr line in the
    ``opentinker: bad config: <field>: <reason>`` form, no traceback and no run folder.
    Returns ``<field>: <reason>``."""
    argv = ["run", "--set", f"out_dir={out_dir}", "--set", "runtime.backend=local"]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(PREFIX) and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert not out_dir.is_dir() or not any(out_dir.iterdir()), "a refused job left a run folder"
    return err[len(PREFIX):-1]


def _model_folder(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --------------------------------------------------------------------------- numbers

@pytest.mark.parametrize("item, message", [
    ("train.lr=inf", "train.lr: expected `float` <= 10.0, got inf"),
    ("train.lr=nan", "train.lr: expected `float` > 0.0, got nan"),
    ("train.lr=-1e-3", "train.lr: expected `float` > 0.0, got -0.001"),
    (f"train.steps={10**30}", f"train.steps: expected `int` <= 1000000, got {10**30}"),
    (f"train.groups_per_step={10**9}", f"train.groups_per_step: expected `int` <= 100000, got {10**9}"),
    ("train.group_size=10000", "train.groups_per_step: 16 groups of 10000 episodes is more than 16384 episodes"),
    (f'policies=[{{"name": "main", "lora_rank": {10**7}}}]',
     f"policies[main].lora_rank: expected `int` <= 4096, got {10**7}"),
    ('policies=[{"name": "main", "opponents": {"random": Infinity}}]', "policies[main].opponents[...]: expected `float`"),
    ('policies=[{"name": "p", "train": {"lr": Infinity}}]', "policies[p].train.lr: expected `float` <= 10.0, got inf"),
    (f"seed={2**64}", f"seed: expected `int` <= 4294967295, got {2**64}"),
    ("seed=-1", "seed: expected `int` >= 0, got -1"),
    ("sampling.temperature=0", "sampling.temperature: expected `float` >= 0.0001, got 0"),
    (f"sampling.max_tokens={10**9}", f"sampling.max_tokens: expected `int` <= 131072, got {10**9}"),
    ("runtime.timeout_s=inf", "runtime.timeout_s: expected `float` <= 604800.0, got inf"),
    ('game_kwargs={"deal": NaN}', "game_kwargs.deal: must be finite, got nan"),
    ("train.dual_clip=0.5", "train.dual_clip: must be 0 (off) or > 1, got 0.5"),
    ("train.lrr=1", "train.lrr: unknown field (did you mean 'lr'?)"),
    ("runtime.backend=slurm", "runtime.backend: invalid enum value 'slurm' (one of: local, ray)"),
])
def test_numbers_and_fields_are_refused_with_the_field(item, message, tmp_path, capsys):
    assert _refused(capsys, tmp_path / "runs", item).startswith(message)


def test_a_toml_file_with_inf_is_refused_by_the_real_command(tmp_path):
    """The installed entry point's path, in a fresh process: exit 2, one line, no folder."""
    job = tmp_path / "job.toml"
    job.write_text(f'out_dir = "{tmp_path / "runs"}"\n[train]\nlr = inf\n')
    done = subprocess.run([sys.executable, "-m", "opentinker.cli", "run", str(job)], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == PREFIX + "train.lr: expected `float` <= 10.0, got inf\n"
    assert not (tmp_path / "runs").exists()


def test_a_run_folder_given_must_be_new_and_directly_inside_out_dir(tmp_path, capsys):
    """``opentinker run --run-dir DIR`` (what the job queue uses to know a run's folder): DIR
    directly inside ``out_dir`` and not there yet, else one bad-config line and no folder."""
    runs = tmp_path / "runs"
    base = ["run", "--set", f"out_dir={runs}", "--set", "runtime.backend=local"]
    for where, reason in ((tmp_path / "elsewhere", "is not a folder directly inside out_dir"),
                          (runs / "a" / "b", "is not a folder directly inside out_dir")):
        assert main([*base, "--run-dir", str(where)]) == 2
        assert capsys.readouterr().err.startswith(f"{PREFIX}--run-dir: '{where}' {reason}")
    (runs / "taken").mkdir(parents=True)
    assert main([*base, "--run-dir", str(runs / "taken")]) == 2
    assert "exists (continue a run with --resume)" in capsys.readouterr().err
    assert [p.name for p in runs.iterdir()] == ["taken"] and not (tmp_path / "elsewhere").exists()


def test_cluster_addresses_are_checked(tmp_path, capsys):
    """``runtime.address``: a Ray address, on the Ray backend, not with a shared scheduler (which
    binds loopback), all before anything starts; ``runtime.scheduler_resources`` the same, with
    names and amounts that can be Ray resources."""
    runs = tmp_path / "runs"
    assert _refused(capsys, runs, 'runtime.address="10.0.0.1"') == (
        "runtime.address: '10.0.0.1' is not a Ray address (auto, HOST:PORT or ray://HOST:PORT)")
    assert _refused(capsys, runs, 'runtime.address="head:99999"').startswith("runtime.address: 'head:99999' is not")
    assert _refused(capsys, runs, 'runtime.address="auto"', "runtime.backend=local") == (
        'runtime.address: a cluster needs runtime.backend = "ray"')
    assert _refused(capsys, runs, 'runtime.address="ray://10.0.0.1:10001"', "runtime.backend=ray",
                    f'runtime.scheduler="{tmp_path}"') == (
        "runtime.address: a shared scheduler (runtime.scheduler) is reachable from its own machine only: leave "
        "one of the two empty")
    assert _refused(capsys, runs, 'runtime.scheduler_resources={"GPU": 1}', "runtime.backend=local") == (
        'runtime.scheduler_resources: places the job\'s own scheduler on a Ray node: it needs runtime.backend = "ray" '
        "and no shared scheduler (runtime.scheduler)")
    assert _refused(capsys, runs, 'runtime.scheduler_resources={"GPU": -1}') == (
        "runtime.scheduler_resources[...]: expected `float` >= 0.0")
    assert _refused(capsys, runs, 'runtime.scheduler_resources={"memory": 1}') == (
        "runtime.scheduler_resources: 'memory' is not a resource an actor can ask for (CPU, GPU, or a custom "
        "resource a node was started with)")
    assert _refused(capsys, runs, 'runtime.scheduler_resources={"": 1}') == (
        "runtime.scheduler_resources: each key: expected `str` of length >= 1, got keys ['']")


# --------------------------------------------------------------------------- games, models, devices

def test_games_and_their_kwargs_are_checked(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert _refused(capsys, runs, "game=chess_v0").startswith("game: 'chess_v0' is not a registered game; known: ")
    assert _refused(capsys, runs, "game=kuhn_poker").startswith("game: 'kuhn_poker' is not a registered game; "
                                                                "did you mean 'kuhn_poker_v0'?")
    assert _refused(capsys, runs, 'game_kwargs={"players": 4}') == (
        "game_kwargs.players: kuhn_poker_v0 takes no 'players'; it takes deal, render_mode, forfeit_chips")
    assert _refused(capsys, runs, "game=liars_dice_v0", 'game_kwargs={"num_players": 40}').startswith(
        "game_kwargs: liars_dice_v0 refuses {'num_players': 40}: num_players must be an integer in 2..6")


def test_model_specs_resolve_locally_or_are_refused(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 8)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        "": "model.base: empty: give smollm2-135m, tiny-random, a model folder or a hub id (org/name)",
        "/no/such/model": "model.base: '/no/such/model': no such folder (a path is never looked up on the Hugging Face hub)",
        "./missing": "model.base: './missing': no such folder",
        "~/missing": "model.base: '~/missing': no such folder ('~' is not expanded)",
        "models/missing": "model.base: 'models/missing': no such folder",  # "models" is a local folder
        "a/b/c": "model.base: 'a/b/c': no such folder",
        "smollm2-135": "model.base: 'smollm2-135' is not a known model spec: did you mean 'smollm2-135m'?",
        "bad name!": "model.base: 'bad name!' is none of smollm2-135m, tiny-random, a model folder or a hub id",
        str(weights): f"model.base: '{weights}' is a file; give the model's folder (with its config.json)",
        str(empty): f"model.base: '{empty}' has no config.json (not a Hugging Face model folder)",
    }
    for spec, message in cases.items():
        assert _refused(capsys, runs, f"model.base={spec}").startswith(message), spec
    # A well-formed hub id that is not cached is left to the hub (nothing here says otherwise),
    # unless the hub is off.
    assert check_model("some-org/some-model").family is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"):
        check_model("some-org/some-model")


def test_devices_are_checked(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    assert _refused(capsys, runs, "model.device=gpu") == (
        "model.device: 'gpu' is not a device: use cpu, cuda or cuda:<index>")
    assert _refused(capsys, runs, "model.device=cuda:999").startswith(
        "model.device: 'cuda:999': this machine has ")
    _check_device("cuda:999", "ray", "10.0.0.7:6379")  # a cluster's GPUs are not this machine's
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    with pytest.raises(ConfigError, match="this machine has"):  # RAY_ADDRESS is not a cluster the job joins
        _check_device("cuda:999", "ray", "")


def test_target_modules_are_checked_against_the_architecture(tmp_path, capsys):
    runs = tmp_path / "runs"
    qwen = _model_folder(tmp_path, "qwen", {"model_type": "qwen2", "max_position_embeddings": 512})
    gpt2 = _model_folder(tmp_path, "gpt2", {"model_type": "gpt2"})
    def lora(*modules: str) -> str:
        return "policies=" + json.dumps([{"name": "main", "target_modules": list(modules)}])

    assert _refused(capsys, runs, "model.base=tiny-random", lora("q_proj", "lm_head")) == (
        "policies[main].target_modules: llama has no 'lm_head' to adapt; it has q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj (with model.engine = peft also lm_head, embed_tokens)")
    assert _refused(capsys, runs, f"model.base={qwen}", lora("w1")).startswith(
        "policies[main].target_modules: qwen2 has no 'w1' to adapt")
    assert _refused(capsys, runs, f"model.base={qwen}", "model.engine=peft", lora("c_attn")).startswith(
        "policies[main].target_modules: qwen2 has no 'c_attn' to adapt")
    assert _refused(capsys, runs, lora()) == (
        "policies[main].target_modules: empty: name at least one projection, e.g. q_proj")
    assert _refused(capsys, runs, f"model.base={gpt2}", "model.engine=own") == (
        "model.engine: 'own' runs llama, qwen2, qwen3; this model is 'gpt2' (use auto or peft)")
    assert _refused(capsys, runs, "model.engine=peft", 'policies=[{"name": "main", "kind": "full"}]') == (
        "policies[main].kind: 'full' needs the engine's own forward (model.engine = auto or own)")
    assert _refused(capsys, runs, f"model.base={qwen}", "sampling.max_tokens=512") == (
        "sampling.max_tokens: 512 leaves no room for a prompt in the model's context of 512 tokens")
    # What the architecture has passes; an architecture we do not know is left to PEFT.
    base = load_config(None, {"out_dir": str(runs), "model": {"base": str(qwen), "engine": "peft"},
                              "policies": [{"name": "main", "target_modules": ["q_proj", "lm_head"]}]})
    check_config(base)
    check_config(load_config(None, {"out_dir": str(runs), "model": {"base": str(gpt2)},
                                    "policies": [{"name": "main", "target_modules": ["c_attn"]}]}))


def test_algorithms_offline_data_and_out_dir_are_checked(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert _refused(capsys, runs, "train.loss=dpo_typo").startswith(
        "train.loss: 'dpo_typo' is not a policy loss; known: ['cispo', 'importance_sampling', 'ppo']")
    assert _refused(capsys, runs, 'offline={"kind": "sft", "data": "/no/such.jsonl"}') == (
        "offline.data: '/no/such.jsonl': no such file or folder")
    assert _refused(capsys, runs, 'offline={"kind": "sft", "scripted": "calc_tool_user"}') == (
        "offline.scripted: 'calc_tool_user' is not a scripted seat of kuhn_poker_v0 (its own: random, kuhn_equilibrium)")
    assert _refused(capsys, runs, 'offline={"kind": "sft", "scripted": "nope"}') == (
        "offline.scripted: 'nope' is not a scripted policy; kuhn_poker_v0's are random, kuhn_equilibrium")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert _refused(capsys, a_file, "train.steps=1") == f"out_dir: '{a_file}' exists and is not a folder"
    assert _refused(capsys, runs, "out_dir=") == "out_dir: must be a non-empty path without control characters, got ''"


def test_every_bundled_job_passes_the_checks(tmp_path):
    from opentinker.config import bundled_configs

    for name in bundled_configs():
        cfg = load_config(name, {"out_dir": str(tmp_path / "runs")})
        if any(p.init and not os.path.isdir(p.init) for p in cfg.policies):
            # A warm start from a run not made yet (tools_warm: tools_sft's adapter) is refused by name.
            with pytest.raises(ConfigError, match=r"^policies\[main\].init: '.*/runs/tools_sft/adapters/main': no such folder"):
                check_config(cfg)
            cfg = load_config(name, {"out_dir": str(tmp_path / "runs"), "policies": [{"name": "main", "init": ""}]})
        check_config(cfg)
    assert not (tmp_path / "runs").exists()


def test_run_job_checks_before_making_its_folder(tmp_path, monkeypatch):
    """``run_job`` called directly (as the tests and benchmarks do) refuses a config the
    decoder let through (a game is only checked against the registry) and makes nothing."""
    monkeypatch.undo()  # the real run_job
    from opentinker.run import run_job

    raw = {"out_dir": str(tmp_path / "runs"), "game": "../../escape", "model": {"base": "tiny-random"}}
    with pytest.raises(msgspec.ValidationError, match=r"^game: '../../escape' is not a registered game"):
        msgspec.convert(raw, JobConfig)  # the decoder, when it needs the game's own system prompt
    cfg = msgspec.convert({**raw, "system_prompt": "x"}, JobConfig)
    with pytest.raises(ConfigError, match=r"^game: '../../escape' is not a registered game"):
        run_job(cfg)
    assert not (tmp_path / "runs").exists() and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- names and run folders

@pytest.mark.parametrize("name", [
    "x/../../y", "../y", "..", ".", ".hidden", "/abs", "a/b", "a\\b", "a\0b", "a\nb", "a\rb", "a\x1b[31mb",
    "a\x85b", "a\u2028b", "-rf", "", " ", "a b", "a" * 129, "é" * 65,
])
def test_unsafe_job_names_are_refused(name, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, {"name": name, "out_dir": str(tmp_path)})
    assert e.value.field == "name" and str(e.value).startswith("name: ")
    assert escape_controls(str(e.value)) == str(e.value), "the message quotes the name escaped"


@pytest.mark.parametrize("name", ["default", "exp-1.2+lr3e-4", "run_7", "a" * 128, "実験"])
def test_safe_job_names_make_a_run_folder_inside_out_dir(name, tmp_path):
    check_name(name)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    cfg = load_config(None, {"name": name, "out_dir": str(tmp_path / "link")})
    run_dir = cfg.run_dir()
    assert run_dir.resolve().parent == real.resolve()
    assert len(run_dir.name.encode()) <= 255


# --------------------------------------------------------------------------- logs

def test_escape_controls_leaves_one_line():
    every_control = "".join(map(chr, [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]))
    escaped = escape_controls(f"ok {every_control} ok")
    assert escaped.isprintable() and escaped.startswith("ok \\x00") and escaped.endswith(" ok")
    assert escape_controls("a\nb\rc\td\x1b[2J") == "a\\nb\\rc\\td\\x1b[2J"
    assert escape_controls("plain text, ünïcödé and \\ stay") == "plain text, ünïcödé and \\ stay"


def test_project_log_records_are_one_line_in_pytests_capture(caplog):
    """Where the application has root handlers (here pytest's), they get the escaped record."""
    log = logging.getLogger("opentinker.bus.server")  # the logger the bus server writes to
    hostile = "evil\nWARNING opentinker.bus.server: forged line\r\x1b[2J"
    with caplog.at_level(logging.WARNING):
        log.warning("%s: peer %s lost", "scheduler", hostile)
        try:
            raise ValueError("bad frame\nsecond line")
        except ValueError:
            log.exception("dispatch failed for %r", "peer\n")
    lines = caplog.text.splitlines()
    assert len(lines) == 2, lines
    assert "peer evil\\nWARNING opentinker.bus.server: forged line\\r\\x1b[2J lost" in lines[0]
    assert "Traceback (most recent call last):\\n" in lines[1] and "ValueError: bad frame\\nsecond line" in lines[1]


def test_log_records_are_one_line_on_a_bare_stderr():
    """A process that configured no logging (the CLI, a Ray actor): the package's own handler
    writes each record as one escaped line, as Python's last-resort handler would (WARNING+)."""
    code = ("import logging, opentinker\n"
            "log = logging.getLogger('opentinker.training.learner')\n"
            "log.info('not shown')\n"
            "log.warning('learner %s: dropped %s', 'main', 'Trajectory\\nERROR forged\\x1b[31m')\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    log.exception('step\\rfailed')\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "WARNING opentinker.training.learner: learner main: dropped Trajectory\\nERROR forged\\x1b[31m"
    assert lines[1].startswith("ERROR opentinker.training.learner: step\\rfailed\\nTraceback")


# --------------------------------------------------------------------------- finite losses

LOG_RATIOS = (0.0, 1e-3, -1.0, 5.0, 19.0, 21.0, 88.0, 89.0, -89.0, 100.0, -100.0, 1e4, -1e4)
"""Per-token log-ratios the property test draws from: the normal range, both sides of the
clamp, both sides of float32's exp range, and far beyond."""


def _inputs(needs: frozenset[str], n: int, gen, scale: float) -> dict:
    """Random finite inputs for a loss that reads ``needs``, ``n`` tokens."""
    import torch

    def ratios() -> torch.Tensor:
        pick = torch.randint(len(LOG_RATIOS), (n,), generator=gen)
        return torch.tensor(LOG_RATIOS)[pick] + torch.randn(n, generator=gen) * (pick == 0)

    def values() -> torch.Tensor:
        zero = torch.rand(n, generator=gen) < 0.3  # some exact zeros (an advantage of 0)
        return torch.where(zero, 0.0, torch.randn(n, generator=gen) * scale)

    out: dict = {}
    for key in sorted(needs):
        if key in ("sampler_logprobs", "ref_logprobs"):
            out[key] = ratios()  # the loss's first argument is drawn near 0, so these set the log-ratio
        elif key in ("advantages", "value_targets", "old_values"):
            out[key] = values()
        elif key == "entropy":
            out[key] = torch.rand(n, generator=gen) * scale
        elif key == "pair_id":
            out[key] = torch.arange(n) // 2
        elif key == "pair_sign":
            out[key] = torch.tensor([1.0, -1.0]).repeat(n // 2)
        elif key == "move_tokens":  # [n, 3]: decisions of 1-3 legal moves, continuations, rows without moves
            out[key] = torch.randint(-1, 50, (n, 3), generator=gen).float()
        elif key == "move_logprobs":  # the full vocabulary's log-probs of those tokens: <= 0, maybe far below
            out[key] = -torch.rand(n, 3, generator=gen) * scale * (torch.rand(n, 3, generator=gen) * 10)
        elif key == "move_weights":  # each decision's values minus their mean; a continuation's 1
            w = torch.randn(n, 3, generator=gen) * scale
            out[key] = torch.where(torch.rand(n, 1, generator=gen) < 0.3, torch.tensor([1.0, 0.0, 0.0]),
                                   w - w.mean(dim=1, keepdim=True))
        else:
            raise AssertionError(f"the property test cannot build input {key!r}: teach it")
    return out


CONFIGS = ({}, {"clip_low": 1.0, "clip_high": 10.0, "dual_clip": 1e3}, {"dual_clip": 3.0, "is_truncation": 1e6,
                                                                        "eps_low": 0.0, "eps_high": 10.0})


def test_every_registered_loss_is_finite_with_finite_gradients():
    import torch

    from learners import LOSSES

    gen = torch.Generator().manual_seed(0)
    for name, spec in sorted(LOSSES.items()):
        needs = spec.needs | ({"entropy"} if spec.kind.value == "policy" else frozenset())
        for trial in range(24):
            n = (0, 2, 8, 32)[trial % 4]  # 0: every mask zero
            scale = (1.0, 100.0, 1e4)[trial % 3]
            first = (torch.randn(n, generator=gen) * (scale if spec.kind.value == "value" else 1.0)).requires_grad_()
            # What the runtime differentiates: the first argument (log-probs, or a critic's
            # values), the entropies and the moves' log-probs; the other inputs are data.
            inputs = {k: v.requires_grad_() if k in ("entropy", "move_logprobs") else v
                      for k, v in _inputs(needs, n, gen, scale).items()}
            wrt = [first, *(v for v in inputs.values() if v.requires_grad)]
            for config in CONFIGS:
                out = LOSSES[name](first, inputs, config)
                where = f"{name} trial {trial} config {config}"
                assert torch.isfinite(out.loss_sum).item(), where
                assert all(math.isfinite(v) for v in out.metrics.values()), (where, out.metrics)
                if out.loss_sum.requires_grad:
                    grads = torch.autograd.grad(out.loss_sum, wrt, allow_unused=True)
                    assert all(g is None or bool(torch.isfinite(g).all()) for g in grads), where


def test_ppo_stays_finite_past_the_exp_range_and_unchanged_inside_it():
    import torch

    from learners import LOSSES
    from learners.losses import K3_CLAMP, LOG_RATIO_CLAMP

    assert K3_CLAMP == LOG_RATIO_CLAMP
    for log_ratio in (88.0, 89.0, 100.0, 1e4):
        for advantage in (0.0, -1.0, 1.0):
            logp = torch.tensor([log_ratio], requires_grad=True)
            out = LOSSES["ppo"](logp, {"advantages": torch.tensor([advantage]), "sampler_logprobs": torch.zeros(1)}, {})
            out.loss_sum.backward()
            assert math.isfinite(out.loss_sum.item()) and math.isfinite(logp.grad.item()), (log_ratio, advantage)
    # Inside the clamp: exactly the textbook surrogate and its gradient, in float64.
    gen = torch.Generator().manual_seed(1)
    log_ratio = torch.empty(256).uniform_(-LOG_RATIO_CLAMP + 0.5, LOG_RATIO_CLAMP - 0.5, generator=gen)
    adv = torch.randn(256, generator=gen)
    logp = log_ratio.clone().double().requires_grad_()
    out = LOSSES["ppo"](logp, {"advantages": adv, "sampler_logprobs": torch.zeros(256)}, {"dual_clip": 3.0})
    out.loss_sum.backward()
    ref = log_ratio.clone().requires_grad_()
    r = ref.exp()
    surrogate = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    surrogate = torch.where((adv < 0) & (3.0 * adv > surrogate.detach()), 3.0 * adv, surrogate)
    (-surrogate.sum()).backward()
    torch.testing.assert_close(out.loss_sum.float(), -surrogate.sum().detach(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(logp.grad.float(), ref.grad, rtol=1e-5, atol=1e-6)


def test_clip_bounds_a_config_allows_stay_inside_the_clamp():
    from learners.losses import LOG_RATIO_CLAMP
    from opentinker.config import MAX_CLIP_HIGH, MAX_DUAL_CLIP

    assert math.log(1 + MAX_CLIP_HIGH) < LOG_RATIO_CLAMP and math.log(MAX_DUAL_CLIP) < LOG_RATIO_CLAMP


# --------------------------------------------------------------------------- mirrors kept current

def test_the_configs_mirrors_of_the_engine_are_current(tiny_path):
    from opentinker.control.config_checks import ENGINE_FAMILIES, ENGINE_MODULES, KNOWN_MODELS
    from opentinker.engine.model.config import SUPPORTED
    from opentinker.engine.model.lora_weights import MODULES
    from opentinker.engine.model_specs import cache_root

    assert ENGINE_MODULES == MODULES
    assert set(ENGINE_FAMILIES) == set(SUPPORTED.values())
    config = json.loads((Path(tiny_path) / "config.json").read_text())
    assert KNOWN_MODELS["tiny-random"] == (config["model_type"], config["max_position_embeddings"])
    built = sorted((cache_root() / "models").glob("smollm2-135m-*/config.json"))
    if built:  # the default model is converted on first use; its numbers when it has been
        config = json.loads(built[-1].read_text())
        assert KNOWN_MODELS["smollm2-135m"] == (config["model_type"], config["max_position_embeddings"])
    assert os.path.isdir(tiny_path) and check_model(tiny_path).family == "llama"


# ------------------------------------------------------------------------------ adapter paths

def test_adapter_paths_stay_inside_the_schedulers_folders(tiny_path, tmp_path):
    """A scheduler given its run's folder saves and loads adapters there only: a path outside
    it, reached through `..` or a symbolic link, or relative, is refused as `invalid` with the
    same words whether or not it exists, and nothing is written outside; the scheduler keeps
    serving."""

    from conftest import DEVICE, run, with_client
    from opentinker.bus import RemoteError
    from opentinker.engine.service import SchedulerService
    from protocols.messages import CreateAdapter, ErrorCode, LoadAdapter, LoraSpec, SaveAdapter

    run_dir, outside, warm = tmp_path / "run", tmp_path / "outside", tmp_path / "warm"
    run_dir.mkdir()
    outside.mkdir()
    (outside / "secret_folder").mkdir()
    (run_dir / "link").symlink_to(outside)
    s = SchedulerService(tiny_path, threads=1, device=DEVICE, adapter_roots=[str(run_dir)], read_roots=[str(warm)])
    s.start()
    try:
        async def body(c):
            await c.request(CreateAdapter(name="pol", spec=LoraSpec(rank=2)))
            saved = await c.request(SaveAdapter(adapter="pol", path=str(run_dir / "ckpt" / "pol")))
            assert saved.version == 0 and (run_dir / "ckpt" / "pol" / "adapter_config.json").is_file()
            await c.request(LoadAdapter(path=str(run_dir / "ckpt" / "pol"), name="copy"))
            # A warm start's folder is read-only: loaded from, never written to.
            shutil.copytree(run_dir / "ckpt" / "pol", warm)
            info = await c.request(LoadAdapter(path=str(warm), name="warm", fresh=True))
            assert info.version == 0
            with pytest.raises(RemoteError, match="outside the folders this scheduler reads and writes"):
                await c.request(SaveAdapter(adapter="pol", path=str(warm / "overwritten")))
            refused = {}
            for what, path in {
                "outside": outside / "pol", "dotdot": run_dir / ".." / "outside" / "pol",
                "symlink": run_dir / "link" / "pol", "relative": Path("pol"), "root": Path("/"),
            }.items():
                with pytest.raises(RemoteError) as e:
                    await c.request(SaveAdapter(adapter="pol", path=str(path)))
                assert e.value.error.code is ErrorCode.INVALID
                refused[what] = e.value.error.message
            for path in (outside / "secret_folder", outside / "no_such_folder"):
                with pytest.raises(RemoteError) as e:
                    await c.request(LoadAdapter(path=str(path), name="stolen"))
                refused[path.name] = e.value.error.message.replace(str(path), "<path>")
            return refused

        refused = run(with_client(s, body))
    finally:
        s.stop()
    assert all("outside the folders this scheduler reads and writes" in m for k, m in refused.items() if k != "relative")
    assert "must be an absolute path" in refused["relative"]
    assert refused["secret_folder"] == refused["no_such_folder"]  # existence is not revealed
    assert sorted(p.name for p in outside.iterdir()) == ["secret_folder"]  # nothing written outside
    assert not (warm / "overwritten").exists()
    assert not Path("pol").exists()


@pytest.fixture()
def run_scheduler(tiny_path, tmp_path):
    """A scheduler whose only folder is ``run`` (as a job's), with an adapter ``pol``; a run
    folder's own files beside it; a folder ``outside``."""
    from conftest import DEVICE

    from opentinker.bus import SyncClient
    from opentinker.engine.service import SchedulerService
    from protocols.messages import CreateAdapter, LoraSpec

    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    outside.mkdir()
    (run_dir / "config.toml").write_text("name = 'x'\n")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "checkpoints" / "step_2" / "state.json").write_text("{}")
    s = SchedulerService(tiny_path, threads=1, device=DEVICE, adapter_roots=[str(run_dir)])
    s.start()
    with SyncClient(s.endpoint, name="owner") as c:
        c.request(CreateAdapter(name="pol", spec=LoraSpec(rank=2)), 60)
    yield s, run_dir, outside
    s.stop()


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_save_cannot_replace_the_run_folder_or_its_files(run_scheduler):
    """``SaveAdapter(path=<run folder>)`` replaced checkpoints, config and metrics with four
    adapter files. The run's folder itself, its files and its folders that are not saved
    adapters are refused as targets, and left as they were; a saved adapter is replaced whole."""
    from opentinker.bus import RemoteError, SyncClient
    from protocols.messages import ErrorCode, SaveAdapter

    s, run_dir, _ = run_scheduler
    before = _tree(run_dir)
    refused = {}
    with SyncClient(s.endpoint, name="peer") as c:
        for target in (run_dir, run_dir / "config.toml", run_dir / "checkpoints", run_dir / "checkpoints" / "step_2",
                       run_dir / "checkpoints" / ".." / "metrics.jsonl"):
            with pytest.raises(RemoteError) as e:
                c.request(SaveAdapter(adapter="pol", path=str(target)), 60)
            assert e.value.error.code is ErrorCode.INVALID, e.value
            refused[target.name] = e.value.error.message
        assert _tree(run_dir) == before
        assert "the run's folder itself" in refused["run"]
        assert all("not a saved adapter" in m for k, m in refused.items() if k != "run"), refused
        for _ in range(2):  # a saved adapter is replaced whole
            assert c.request(SaveAdapter(adapter="pol", path=str(run_dir / "adapters" / "pol")), 60).version == 0
    assert sorted(p.name for p in (run_dir / "adapters").iterdir()) == ["pol"]
    assert (run_dir / "adapters" / "pol" / "opentinker.json").is_file()


def test_a_race_on_the_path_cannot_put_a_save_outside(run_scheduler):
    """The attack: 60 saves to ``run/race/aN`` while another thread flips ``run/race`` between
    a folder and a symbolic link to a folder outside put a complete adapter outside (and 35
    internal errors on the way). Now nothing lands outside, and every save is saved inside or
    refused as ``invalid``."""
    import threading

    from opentinker.bus import RemoteError, SyncClient
    from protocols.messages import ErrorCode, SaveAdapter

    s, run_dir, outside = run_scheduler
    race = run_dir / "race"
    race.mkdir()
    stop, flips = threading.Event(), [0]

    def flip() -> None:  # the folder moves away (whatever is in it), a link takes its name, then a folder again
        for i in range(100_000):  # bounded; stops with the saves
            if stop.is_set():
                return
            kept = run_dir / f"kept{i}"
            for step in (lambda: os.rename(race, kept), lambda: os.symlink(outside, race),  # noqa: B023 - called at once
                         lambda: race.is_symlink() and os.unlink(race), lambda: os.mkdir(race)):
                try:
                    step()
                except OSError:  # the scheduler made run/race meanwhile
                    pass
            flips[0] += 1

    codes = []
    t = threading.Thread(target=flip)
    t.start()
    try:
        with SyncClient(s.endpoint, name="racer") as c:
            for i in range(60):
                try:
                    c.request(SaveAdapter(adapter="pol", path=str(race / f"a{i}")), 60)
                    codes.append("saved")
                except RemoteError as e:
                    codes.append(e.error.code.value)
    finally:
        stop.set()
        t.join(30)
    print(f"{flips[0]} flips; {codes.count('saved')} saved, {codes.count(ErrorCode.INVALID.value)} refused")
    assert list(outside.iterdir()) == []
    assert flips[0] > 0 and len(codes) == 60
    assert set(codes) <= {"saved", ErrorCode.INVALID.value}, codes  # never an internal error
    saved = [p for p in run_dir.rglob("opentinker.json") if p.parent.name.startswith("a")]
    assert len(saved) >= codes.count("saved") // 2  # saves that were not moved away mid-write are complete


def test_a_weights_file_that_is_a_link_is_refused(run_scheduler):
    """A saved adapter whose weights file is a symbolic link to a file outside (or one inside)
    is refused as ``invalid``, naming the file; the folder as saved loads."""
    from opentinker.bus import RemoteError, SyncClient
    from protocols.messages import ErrorCode, LoadAdapter, SaveAdapter

    s, run_dir, outside = run_scheduler
    folder = run_dir / "adapters" / "pol"
    with SyncClient(s.endpoint, name="peer") as c:
        c.request(SaveAdapter(adapter="pol", path=str(folder)), 60)
        assert c.request(LoadAdapter(path=str(folder), name="copy"), 60).version == 0
        weights = folder / "adapter_model.safetensors"
        data = weights.read_bytes()
        for target in (outside / "weights.safetensors", run_dir / "weights.safetensors"):
            target.write_bytes(data)
            weights.unlink()
            weights.symlink_to(target)
            with pytest.raises(RemoteError) as e:
                c.request(LoadAdapter(path=str(folder), name=f"linked_{target.parent.name}"), 60)
            assert e.value.error.code is ErrorCode.INVALID
            assert "adapter_model.safetensors: a symbolic link" in e.value.error.message, e.value.error.message


def test_pruning_unlinks_a_symlinked_checkpoint_and_keeps_what_it_points_to(tmp_path):
    """A symlinked checkpoint made pruning crash with a traceback: now the link is removed, never
    followed, and the folder it pointed to (outside the run) is untouched."""
    from opentinker.control.checkpoints import write_checkpoint

    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    (outside / "adapters").mkdir(parents=True)
    (outside / "precious.txt").write_text("keep me")
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_1").symlink_to(outside)
    (run_dir / "checkpoints" / "step_5").symlink_to(outside)  # the next step's own name: replaced, not followed

    def save_adapters(folder: str) -> dict[str, str]:
        Path(folder, "main").mkdir(parents=True)
        Path(folder, "main", "opentinker.json").write_text("{}")
        return {"main": str(Path(folder, "main"))}

    for step in (2, 3, 5):
        write_checkpoint(run_dir, step, save_adapters, lambda paths: None, {}, {}, keep=2)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3", "step_5"]
    assert not (run_dir / "checkpoints" / "step_5").is_symlink()
    assert (outside / "precious.txt").read_text() == "keep me" and sorted(p.name for p in outside.iterdir()) == [
        "adapters", "precious.txt"]


def test_infer_refuses_deeply_nested_json_in_one_line(tmp_path, capsys):
    """``opentinker infer`` on a line of 10,000 nested arrays ended in a ``RecursionError``
    traceback: now one line naming the line, exit 2, nothing written."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n' + "[" * 10_000 + "]" * 10_000 + "\n")
    assert main(["infer", str(prompts), "--out", str(tmp_path / "out.jsonl"), "--model", "tiny-random"]) == 2
    err = capsys.readouterr().err
    assert err == f"opentinker infer: {prompts}, line 2: not JSON this reader takes (nested too deep)\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]


def test_repeated_log_lines_are_one_per_second(caplog):
    """A reply-drop line was written once per message (17,997 lines in 3.4 s). A client that
    has 400 replies dropped (each over its bound) logs one line, then one a second with the
    count of those it left out, and every request still fails alone as ``too_large``."""
    import asyncio
    import time as _time

    import numpy as np
    import zmq.asyncio
    from conftest import run

    from opentinker.bus import Client, RemoteError, Server
    from protocols.messages import ErrorCode, LogprobsRequest, LogprobsResult

    async def handler(msg):
        # Four 3.2 KB arrays: each frame under the bound, the message over it (cut by the reader).
        return LogprobsResult(logprobs=[np.zeros(800, np.float32)] * 4, adapter_version=0)

    async def main() -> tuple[list[RemoteError], float]:
        ctx = zmq.asyncio.Context()
        server = Server(handler, name="big")
        ep = await server.start(ctx)
        client = Client(ctx, ep, name="small", max_bytes=4096)
        t0 = _time.monotonic()
        try:
            results = await asyncio.gather(*(client.request(LogprobsRequest(adapter=None, sequences=[
                np.arange(3, dtype=np.int32)]), 60) for _ in range(400)), return_exceptions=True)
            return results, _time.monotonic() - t0
        finally:
            client.close()
            await server.stop()
            ctx.destroy(0)

    with caplog.at_level(logging.WARNING, logger="opentinker.bus.client"):
        results, took = run(main())
    assert all(isinstance(r, RemoteError) and r.error.code is ErrorCode.TOO_LARGE for r in results), {
        repr(r)[:200] for r in results}
    lines = [r for r in caplog.records if "dropped a reply" in r.getMessage()]
    print(f"{len(lines)} log lines for 400 dropped replies in {took:.2f} s")
    assert 1 <= len(lines) <= 2 + took  # one, then at most one a second


# ------------------------------------------------------------------------------ timeouts

@pytest.mark.slow
@pytest.mark.parametrize("engine", ["own", "peft"])
def test_a_timed_out_job_shuts_down_cleanly(engine, tmp_path):
    """A job whose rollout outlasts runtime.timeout_s (1,500-token replies, a 2 s timeout) stops
    every component and exits with status 3 and one line saying what timed out; before, the
    process aborted (exit 134, "terminate called without an active exception") with the
    scheduler's compute thread still inside torch."""
    out = subprocess.run(
        [sys.executable, "-m", "opentinker.cli", "run", "--set", "model.base=tiny-random",
         "--set", "runtime.backend=local", "--set", f"model.engine={engine}", "--set", "runtime.timeout_s=2",
         "--set", "sampling.max_tokens=1500", "--set", "train.steps=2", "--set", f"out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in out.stderr.splitlines() if line.startswith("opentinker: timed out:")]
    assert out.returncode == 3, out.stderr[-3000:]
    assert len(lines) == 1 and "no reply to RunEpisodes" in lines[0] and "runtime.timeout_s = 2 s" in lines[0]
    assert "Traceback" not in out.stderr and "terminate called" not in out.stderr


# ------------------------------------------------------------------- the HTTP endpoint under load

ATTACK_PROMPT_BYTES = 20 << 20
"""The attack's prompt: 20 MB to /v1/completions (every client waited 25.2 s, memory 400 -> 3,039 MB)."""


@pytest.fixture(scope="module")
def endpoint(tiny_path):
    """A real scheduler (tiny-random) behind the endpoint on 127.0.0.1, on uvicorn."""
    from conftest import DEVICE

    from opentinker.engine.service import SchedulerService
    from opentinker.serve.openai_api import make_app, start_http

    s = SchedulerService(tiny_path, threads=1, device=DEVICE)
    s.start()
    app = make_app(s.endpoint, tiny_path, timeout_s=120)
    server = start_http(app)
    yield server, app
    server.stop()
    s.stop()


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def test_a_huge_prompt_is_refused_before_parsing_and_others_are_served(endpoint):
    """The attack's 20 MB prompt is a 413 (declared or streamed without a length), read no
    further; a 1 MB prompt, under the body bound, is refused by its length before it is
    tokenized; memory stays put and a small request is answered meanwhile (before: every
    client waited 25.2 s and the service grew by 2.6 GB)."""
    import threading

    import httpx2

    server, _ = endpoint
    small = {"model": "base", "prompt": "Bet or check?", "max_tokens": 2}
    assert httpx2.post(server.url + "/v1/completions", json=small, timeout=60).status_code == 200
    before = _rss_mb()
    huge = b'{"model": "base", "max_tokens": 1, "prompt": "' + b"a" * ATTACK_PROMPT_BYTES + b'"}'
    answers: dict[str, httpx2.Response] = {}

    def send(name: str, content) -> None:
        answers[name] = httpx2.post(server.url + "/v1/completions", content=content, timeout=120,
                                    headers={"content-type": "application/json"})

    def chunks():  # no Content-Length: the bound is applied to the bytes as they arrive
        for i in range(0, len(huge), 1 << 20):
            yield huge[i:i + (1 << 20)]

    threads = [threading.Thread(target=send, args=(n, c)) for n, c in (("declared", huge), ("streamed", chunks()))]
    for t in threads:
        t.start()
    small_answer = httpx2.post(server.url + "/v1/completions", json=small, timeout=60)
    for t in threads:
        t.join(120)
    assert small_answer.status_code == 200
    for name in ("declared", "streamed"):
        r = answers[name]
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", (name, r.text[:300])
    grew = _rss_mb() - before
    print(f"memory grew {grew:.0f} MB while two 20 MB prompts were refused (the attack: +2,639 MB)")
    assert grew < 500  # the bodies themselves (this test holds 20 MB of them) but no parse or tokens of them
    # Under the body bound but longer than any prompt the context holds: refused by its length.
    r = httpx2.post(server.url + "/v1/completions", json={**small, "prompt": "a" * (1 << 20)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert "characters cannot fit the model's context of 2048 tokens" in r.json()["error"]["message"]
    r = httpx2.post(server.url + "/v1/chat/completions", timeout=60,
                    json={"model": "base", "messages": [{"role": "user", "content": "a" * (1 << 20)}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]


def test_a_client_without_the_key_is_refused_before_its_body_is_read(tiny_path):
    """With a key, a request without it is a 401 as soon as its headers arrive: a client that
    announces a 1 MB body (under the bound) and sends none gets its answer (before, the body
    was read first: the server waited for it, holding the connection and what had come)."""
    import socket

    from conftest import DEVICE

    from opentinker.engine.service import SchedulerService
    from opentinker.serve.openai_api import make_app, start_http

    s = SchedulerService(tiny_path, threads=1, device=DEVICE)
    s.start()
    server = start_http(make_app(s.endpoint, tiny_path, api_key="k" * 32))
    try:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {1 << 20}\r\n\r\n".encode())
            head = c.recv(4096)  # no body sent: only an answer that needs none can come
        assert head.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in head, head[:300]
    finally:
        server.stop()
        s.stop()


def test_tokenizing_runs_off_the_event_loop(endpoint):
    """While a prompt is being tokenized (held inside the tokenizer, in a worker thread), the
    event loop answers ``/v1/models`` from another client; the tokenizing request then ends."""
    import threading

    import httpx2

    server, app = endpoint
    tok = app.state.api.tok
    inside, release = threading.Event(), threading.Event()
    real = tok.encode

    def held(text, *args, **kwargs):
        if "HOLD-ME" in text:
            inside.set()
            release.wait(60)
        return real(text, *args, **kwargs)

    tok.encode = held
    try:
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(httpx2.post(
            server.url + "/v1/completions", timeout=120,
            json={"model": "base", "prompt": "HOLD-ME x y", "max_tokens": 1}).status_code))
        t.start()
        assert inside.wait(60), "the prompt never reached the tokenizer"
        r = httpx2.get(server.url + "/v1/models", timeout=30)  # answered while the tokenizer is held
        assert r.status_code == 200 and not out
        release.set()
        t.join(120)
        assert out == [200]
    finally:
        release.set()
        tok.encode = real


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 10**30), ("max_tokens", 0), ("max_tokens", 2**31 - 1), ("max_tokens", 5000), ("n", 10**9), ("seed", -1), ("seed", 2**64), ("top_k", 2**70),
    ("top_p", 0), ("temperature", -1), ("temperature", 1e300), ("prompt", [2**40]), ("prompt", [-1]),
    ("prompt", [49152]), ("prompt", [[1, 2], [2**40]]), ("stop", "x" * 5000),
])
def test_numbers_out_of_range_are_400_naming_the_field(endpoint, field, value):
    """``max_tokens = 10**30`` and a token id of ``2**40`` were a 500 with a traceback: every
    number is range-checked into a 400 that names the field and no class of ours; the service
    answers the next request."""
    import httpx2

    server, _ = endpoint
    body = {"model": "base", "prompt": [1, 2, 3], "max_tokens": 2, field: value}
    r = httpx2.post(server.url + "/v1/completions", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400, r.text[:500]
    assert field in err["message"] and err["param"] in (field, None), err
    assert not any(w in err["message"] for w in ("Traceback", "Error:", "int32", "numpy", "pydantic", "SamplingParams"))
    good = {k: v for k, v in body.items() if k != field}
    r = httpx2.post(server.url + "/v1/completions", json={"prompt": [1, 2], **good}, timeout=60)
    assert r.status_code == 200


def test_non_finite_numbers_are_400():
    """``Infinity`` and ``NaN`` (which Python's JSON reads) are refused as the field's error."""
    from opentinker.serve.openai_bodies import ApiError, CompletionBody, parse_body

    for raw in (b'{"model": "base", "prompt": "a", "temperature": Infinity}',
                b'{"model": "base", "prompt": "a", "top_p": NaN}'):
        with pytest.raises(ApiError) as e:
            parse_body(raw, CompletionBody)
        assert e.value.status == 400 and e.value.body["error"]["param"] in ("temperature", "top_p")


def test_one_client_cannot_hold_the_endpoint(endpoint):
    """The attack: sixteen parallel requests of ``n = 128`` and ``max_tokens = 256`` from one
    client (here 127.0.0.2, another loopback address) made a legitimate request time out at
    300 s. Now one of them runs and the rest are a 429 at once, and another client's small
    request (from 127.0.0.1) is answered while that one is still drawing its 256 tokens."""
    import threading
    import time as _time

    import httpx2

    server, app = endpoint
    admission = app.state.admission
    flood = httpx2.Client(transport=httpx2.HTTPTransport(local_address="127.0.0.2"), timeout=300)
    body = {"model": "base", "prompt": "Bet", "n": 128, "max_tokens": 256, "seed": 1}
    done: dict[int, tuple[int, float]] = {}

    def attack(i: int) -> None:
        r = flood.post(server.url + "/v1/completions", json=body)
        done[i] = (r.status_code, _time.monotonic())

    threads = [threading.Thread(target=attack, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    deadline = _time.monotonic() + 60
    while admission.running.rows < 128 and _time.monotonic() < deadline:  # the flood's first request runs
        _time.sleep(0.01)
    assert admission.clients.get("127.0.0.2") is not None
    r = httpx2.post(server.url + "/v1/completions", json={"model": "base", "prompt": "Bet", "max_tokens": 3},
                    timeout=120)
    answered = _time.monotonic()
    for t in threads:
        t.join(300)
    flood.close()
    statuses = sorted(s for s, _ in done.values())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert statuses.count(429) >= 14 and set(statuses) <= {200, 429}, statuses
    finished = [t for s, t in done.values() if s == 200]
    assert finished and answered < min(finished), "the small request waited for the flood"
    assert admission.running.rows == 0 and not admission.clients  # everything given back


def test_clients_waiting_for_room_go_fewest_rows_first():
    """When all clients together are at the bound, the next room goes to the waiting client
    that runs the fewest rows, not to the one that asked first; a client over its own bound is
    a 429; a request that waits past ``wait_s`` is a 503."""
    import asyncio

    from opentinker.serve.admission import Admission, Limits, Refused

    async def body() -> list[str]:
        adm = Admission(Limits(client_rows=4, total_rows=4, client_tokens=100, total_tokens=100, wait_s=5))
        first = await adm.admit("a", 2, 2)
        second = await adm.admit("a", 2, 2)  # a runs 4: all there is
        with pytest.raises(Refused) as e:
            await adm.admit("a", 1, 1)
        assert e.value.status == 429
        granted: list[str] = []

        async def wait(client: str, rows: int) -> None:
            (await adm.admit(client, rows, rows)) and granted.append(client)

        waiting = [asyncio.ensure_future(wait("c", 2))]
        await asyncio.sleep(0.01)
        waiting.append(asyncio.ensure_future(wait("b", 2)))
        await asyncio.sleep(0.01)
        first.release()  # room for 2: c and b both wait, both run nothing: the older (c) goes
        await asyncio.sleep(0.01)
        assert granted == ["c"]
        second.release()  # a runs nothing now, and b gets the room
        await asyncio.sleep(0.01)
        assert granted == ["c", "b"]
        await asyncio.gather(*waiting)
        slow = Admission(Limits(client_rows=4, total_rows=1, client_tokens=9, total_tokens=9, wait_s=0.05))
        await slow.admit("x", 1, 1)
        with pytest.raises(Refused) as e:
            await slow.admit("y", 1, 1)
        assert e.value.status == 503 and "y" not in slow.clients
        return granted

    assert asyncio.run(body()) == ["c", "b"]


def test_a_service_makes_an_api_key_only_its_user_can_read(tiny_path, tmp_path):
    """``opentinker serve`` on loopback: every local user reaches 127.0.0.1, so the endpoint
    needs a key there too; the service makes one and writes it to its file (mode 0600)."""
    import stat

    import httpx2

    from opentinker.serve.service import Service

    file = tmp_path / "svc" / "service.json"
    service = Service(tiny_path, service_file=file, budget_mb=64)
    info = service.start()
    try:
        assert stat.S_IMODE(file.stat().st_mode) == 0o600 and len(info.api_key) >= 32
        assert json.loads(file.read_text())["api_key"] == info.api_key
        assert httpx2.get(info.http + "/v1/models", timeout=60).status_code == 401
        r = httpx2.get(info.http + "/v1/models", headers={"Authorization": f"Bearer {info.api_key}"}, timeout=60)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "base"
    finally:
        service.stop()


# ------------------------------------------------------------------------------ the job queue

def _job_toml(tiny_path: str, out_dir: str, **extra: object) -> str:
    """A small run's config as ``opentinker jobs submit`` sends it (``train.steps=400``: it
    runs until stopped)."""
    from opentinker.overrides import parse_overrides
    from opentinker.config import to_toml

    sets = {"model.base": tiny_path, "model.threads": 1, "runtime.backend": "local", "runtime.env_runners": 1,
            "train.steps": 400, "train.groups_per_step": 2, "eval.every": 0, "sampling.max_tokens": 3,
            "out_dir": out_dir, **extra}
    return to_toml(load_config(None, parse_overrides([f"{k}={v}" for k, v in sets.items()]))).decode()


def _job_pids(file: Path) -> list[int]:
    """The pids of the jobs a service's queue started (``proc.json`` in each job's folder)."""
    return [json.loads(p.read_text())["pid"] for p in sorted(file.parent.glob("jobs-*/q*/proc.json"))]


def _alive(pid: int) -> bool:
    from opentinker.serve.job_procs import proc_stat

    stat = proc_stat(pid)
    return stat is not None and stat[1][0] != "Z"  # a zombie has ended


def test_the_queue_checks_every_number_and_confines_out_dir(tiny_path, tmp_path):
    """``--memory-mb nan``, ``-5`` and ``1e-6`` were accepted, and a job's ``out_dir=/etc/...``
    was made. Now each is refused naming the field, before anything is made; a relative
    ``out_dir`` lies in the service's runs folder; ``--budget-mb`` is checked the same way."""
    from opentinker.bus import RemoteError, SyncClient
    from opentinker.serve.service import Service
    from protocols.messages import CancelQueued, ErrorCode, SubmitJob

    for bad in (math.nan, -5.0, 1e-6, math.inf, 1e12):
        with pytest.raises(ValueError, match="--budget-mb must be 0"):
            Service(tiny_path, http_port=None, service_file=tmp_path / "never" / "service.json", budget_mb=bad)
    file, runs, outside = tmp_path / "svc" / "service.json", tmp_path / "runs", tmp_path / "outside"
    outside.mkdir()
    service = Service(tiny_path, http_port=None, service_file=file, budget_mb=2000, out_roots=[str(runs)])
    info = service.start()
    try:
        with SyncClient(info.endpoint, "jobs", credentials=info.credentials()) as c:
            for bad in (math.nan, -5.0, 1e-6, math.inf, -math.inf):
                with pytest.raises(RemoteError) as e:
                    c.request(SubmitJob(config=_job_toml(tiny_path, "mine"), memory_mb=bad), 60)
                assert e.value.error.code is ErrorCode.INVALID and "memory_mb must be 0" in e.value.error.message
            (runs / "link").symlink_to(outside)
            for out_dir in ("/etc/opentinker_issue36", str(outside / "x"), str(runs / "link" / "x"), "../outside/y"):
                with pytest.raises(RemoteError) as e:
                    c.request(SubmitJob(config=_job_toml(tiny_path, out_dir)), 60)
                assert "out_dir" in e.value.error.message and "outside the folders" in e.value.error.message
            assert not Path("/etc/opentinker_issue36").exists() and list(outside.iterdir()) == []
            ok = c.request(SubmitJob(config=_job_toml(tiny_path, "mine")), 60)
            c.request(CancelQueued(id=ok.id), 120)
        assert (runs / "mine").is_dir()
    finally:
        service.stop()


def test_jobs_are_charged_their_processes_and_stop_with_the_service(tiny_path, tmp_path):
    """200 jobs declared at about 1 MB each all ran at once (each is a process of hundreds of
    MB) and the kernel killed 5 processes. Now a job is charged at least its processes: six
    jobs of "1 MB" in a 700 MB budget run two at a time; stopping the service stops them all."""
    from opentinker.bus import SyncClient
    from opentinker.serve.queue import PROCESS_BYTES
    from opentinker.serve.service import Service
    from protocols.messages import ListQueue, SubmitJob

    file = tmp_path / "svc" / "service.json"
    service = Service(tiny_path, http_port=None, service_file=file, budget_mb=700)
    info = service.start()
    try:
        with SyncClient(info.endpoint, "jobs", credentials=info.credentials()) as c:
            entries = [c.request(SubmitJob(config=_job_toml(tiny_path, f"r{i}"), memory_mb=1.0), 120)
                       for i in range(6)]
            listing = c.request(ListQueue(), 60)
        assert all(e.memory_mb >= PROCESS_BYTES / 2**20 for e in entries)
        states = [e.state for e in listing.entries]
        assert states.count("running") == 2 and states.count("queued") == 4, states
        assert listing.used_mb <= 700
        pids = _job_pids(file)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        service.stop()
    assert not any(_alive(p) for p in pids)


def test_jobs_die_with_a_killed_service_and_a_new_one_cleans_up_after_a_dead_one(tiny_path, tmp_path):
    """After the service was signalled, 163 of its job processes kept running (each in a
    session of its own). Now a job dies with its service, even one killed with SIGKILL (the
    kernel's parent-death signal), and a service that starts stops the jobs a dead service's
    queue left running (their pids and start times in its folder)."""
    import signal
    import time as _time

    from opentinker.serve.job_procs import OWNER_FILE, PROC_FILE, start_time
    from opentinker.serve.service import Service

    file = tmp_path / "svc" / "service.json"
    from conftest import start_serve

    serve = start_serve(file, "--model", tiny_path, "--budget-mb", "2000", start_new_session=True)
    try:
        config = tmp_path / "job.toml"
        config.write_text(_job_toml(tiny_path, str(file.parent / "runs" / "killed")))  # in the default root
        r = subprocess.run([sys.executable, "-m", "opentinker.cli", "jobs", "submit", str(config), "--service",
                            str(file)], capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr
        pids = _job_pids(file)
        assert len(pids) == 1 and _alive(pids[0])
        os.killpg(serve.pid, signal.SIGKILL)  # no handler runs: only the kernel can stop the job now
        serve.wait(60)
        deadline = _time.monotonic() + 60
        while _alive(pids[0]) and _time.monotonic() < deadline:
            _time.sleep(0.2)
        assert not _alive(pids[0]), "a job outlived its killed service"
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        serve.communicate(timeout=60)
    # A job left running by a service that died (here a stand-in process of ours, in a group of
    # its own, recorded as the dead service's queue records its jobs) is stopped by the next one.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    orphan = subprocess.Popen(["sleep", "600"], process_group=0)
    try:
        old = file.parent / "jobs-999999"
        (old / "q1").mkdir(parents=True)
        (old / OWNER_FILE).write_text(json.dumps({"pid": gone.pid, "start_time": 1}))
        (old / "q1" / PROC_FILE).write_text(json.dumps({"pid": orphan.pid, "start_time": start_time(orphan.pid)}))
        service = Service(tiny_path, http_port=None, service_file=file, budget_mb=100)
        service.start()
        service.stop()
        assert orphan.wait(30) == -signal.SIGTERM
        assert (file.parent / "jobs-999999.ended" / "q1" / PROC_FILE).is_file()  # its records kept
    finally:
        if orphan.poll() is None:
            orphan.kill()
