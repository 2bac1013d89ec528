"""``opentinker eval`` on the tiny-random model: a run folder and a saved adapter, evaluated
through the coordinator's evaluation (seat-balanced strata, intervals, exact measures,
ratings), the JSON report's provenance, and the one-line errors (exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

import games
from opentinker.cli import main
from conftest import DEVICE

SAVED_VERSION = 2


def make_run(root: Path, model_path: str) -> Path:
    """A finished run's folder without the training: ``config.toml`` of a tiny-random Kuhn
    job and ``adapters/main`` as ``SaveAdapter`` writes it, at version :data:`SAVED_VERSION`."""
    from opentinker.bus import SyncClient
    from opentinker.config import JobConfig, to_toml
    from opentinker.control.runtime import Job
    from protocols.messages import (
        AdamParams,
        CreateAdapter,
        LoraSpec,
        OptimStep,
        SaveAdapter,
    )

    run = root / "kuhn_poker_v0__default__0__test"
    (run / "adapters").mkdir(parents=True)
    cfg = msgspec.convert({"game": "kuhn_poker_v0", "out_dir": str(root), "runtime": {"backend": "local"},
                           "model": {"base": "tiny-random", "threads": 1, "device": DEVICE}}, JobConfig)
    (run / "config.toml").write_bytes(to_toml(cfg))
    job = Job(cfg, model_path, run_dir=str(root.resolve()), scheduler_only=True)
    try:
        with SyncClient(job.scheduler_endpoint, "test") as client:
            client.request(CreateAdapter(name="main", spec=LoraSpec(seed=3)))
            for _ in range(SAVED_VERSION):  # no gradients: only the version moves
                client.request(OptimStep(adapter="main", params=AdamParams(lr=0.0)))
            client.request(SaveAdapter(adapter="main", path=str((run / "adapters" / "main").resolve())))
    finally:
        job.shutdown()
    return run


@pytest.fixture(scope="module")
def kuhn_run(tmp_path_factory, tiny_path) -> Path:
    return make_run(tmp_path_factory.mktemp("eval_cli"), tiny_path)


def test_eval_a_run_folder_writes_the_table_and_json(kuhn_run, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", str(kuhn_run), "--vs", "random,base", "--games-per-stratum", "2", "--threads", "1",
                 "--seed", "5", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "chips/hand (95% CI)" in printed and "base model" in printed and "exploitability" in printed
    # Off a terminal, the games are counted in plain lines, up to all of them.
    counts = [tuple(map(int, c)) for c in re.findall(r"^  games (\d+)/(\d+) \(\d+ s\)$", printed, re.M)]
    assert len(counts) >= 2 and counts[-1][0] == counts[-1][1] > 0, printed
    report = json.loads(out.read_text())
    assert report["game"] == "kuhn_poker_v0" and report["kind"] == "run" and report["model"] == "tiny-random"
    assert report["seed"] == 5 and report["games_per_stratum"] == 2 and report["unit"] == "chips"
    assert report["policies"] == {"main": str(kuhn_run / "adapters" / "main")}
    assert report["opponents"] == {"random": "random", "base": "base"}
    assert report["machine"]["cores"] >= 1 and "torch" in report["machine"]
    m = report["metrics"]
    starts = len(games.evaluation("kuhn_poker_v0").starts)
    for opp in ("random", "base"):
        k = f"eval/main/vs_{opp}/"
        # seat-balanced: every start from both seats, 2 games each
        assert m[k + "hands"] == 2 * starts * 2
        assert m[k + "wins"] + m[k + "draws"] + m[k + "losses"] == m[k + "hands"]
        assert -2.0 <= m[k + "chips"] <= 2.0 and m[k + "ci95"] >= 0.0 and 0.0 <= m[k + "invalid_rate"] <= 1.0
        assert 0.0 <= m[k + "opponent_invalid_rate"] <= 1.0
    assert m["eval/main/vs_random/opponent_invalid_rate"] == 0.0  # random always plays a legal move
    # The untrained tiny model replies invalidly (seeded: every time); the table's caption says so.
    assert m["eval/main/vs_base/opponent_invalid_rate"] > 0.5
    assert "the opponent's invalid replies" in printed and "the base model against main" in printed
    # the loaded adapter was evaluated (a fresh one would be at version 0), exactly too
    assert report["versions"] == {"main": SAVED_VERSION} and m["eval/main/version"] == SAVED_VERSION
    assert 0.0 <= m["eval/main/exploitability"] <= 1.0
    assert m["ratings/bt/random"] == 0.0 and "ratings/bt/main" in m and "ratings/bt/base" in m
    # only what was asked: the coordinator's kuhn_equilibrium pairing is not evaluated, none reported
    assert not any("vs_kuhn_equilibrium" in k for k in m)


def test_eval_a_saved_adapter_against_another(kuhn_run, tmp_path, capsys):
    adapter = kuhn_run / "adapters" / "main"
    out = tmp_path / "eval.json"
    code = main(["eval", str(adapter), "--game", "kuhn_poker_v0", "--vs", f"random,kuhn_equilibrium,{kuhn_run}",
                 "--games-per-stratum", "1", "--threads", "1", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "± n/a" in printed and "main_2" in printed
    report = json.loads(out.read_text())
    saved_on = json.loads((adapter / "opentinker.json").read_text())["base_model"]
    assert report["kind"] == "adapter" and report["model"] == saved_on  # the base it was saved on, found here
    assert report["opponents"] == {"random": "random", "kuhn_equilibrium": "kuhn_equilibrium",
                                   "main_2": str(kuhn_run / "adapters" / "main")}
    m = report["metrics"]
    for opp in ("random", "kuhn_equilibrium", "main_2"):
        assert m[f"eval/main/vs_{opp}/hands"] == 12
        assert m[f"eval/main/vs_{opp}/ci95"] is None  # one game per stratum: no interval
    assert not any(k.startswith("eval/main_2/") for k in m)  # the opponent is not reported as a policy


@pytest.mark.parametrize("argv, message", [
    (["missing"], "missing: no such file or folder"),
    (["{tmp}"], "neither a run folder (config.toml, adapters/) nor a saved adapter"),
    (["{adapter}"], "is a saved adapter: name its game with --game"),
    (["{run}", "--game", "kuhn_poker_v9"], "unknown game: 'kuhn_poker_v9' is not a registered game; did you mean"),
    (["{run}", "--vs", "random,wizard"], "unknown opponent 'wizard': not random, base, a scripted seat of"),
    (["{run}", "--vs", "liars_dice_cautious"], "unknown opponent 'liars_dice_cautious'"),
    (["{run}", "--games-per-stratum", "0"], "--games-per-stratum: between 1 and 1000, got 0"),
    (["{run}", "--timeout", "0"], "bad settings: Expected `float` > 0.0 - at `$.runtime.timeout_s`"),
])
def test_eval_errors_are_one_line(kuhn_run, tmp_path, capsys, argv, message):
    fill = {"tmp": str(tmp_path), "run": str(kuhn_run), "adapter": str(kuhn_run / "adapters" / "main")}
    assert main(["eval", *(a.format(**fill) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opentinker eval: ") and message in err and err.count("\n") == 1


def test_eval_refuses_a_model_that_is_not_here(kuhn_run, capsys):
    assert main(["eval", str(kuhn_run), "--model", "/nowhere/model", "--games-per-stratum", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opentinker eval: bad settings: model.base") and err.count("\n") == 1


def test_eval_timeout_is_the_runs_unless_given(kuhn_run, tmp_path):
    from opentinker.control.sources import job_config, read_source

    source = read_source(str(kuhn_run), set())
    run_timeout = source.config.runtime.timeout_s
    assert job_config(source, "kuhn_poker_v0", "tiny-random", None, None, None, str(tmp_path)).runtime.timeout_s == run_timeout
    cfg = job_config(source, "kuhn_poker_v0", "tiny-random", None, None, None, str(tmp_path), timeout_s=3600.0)
    assert cfg.runtime.timeout_s == 3600.0 != run_timeout
