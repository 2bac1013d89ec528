"""benchmarks/learning_suite.py: the verdict's arithmetic (pure functions) and a smoke run on
the tiny model through the real path (``opentinker run``, then ``opentinker eval`` against
random, the scripted seat and the base model), then the same command again, which reuses the
seed's result instead of running anything; SIGINT and SIGTERM to a script running a job are
passed on to it, and a job stopped so goes on from its checkpoint the next time."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import check_provenance

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import learning_suite as ls
from _jobs import claimed, finished_run, run_or_reuse, stopped_run
from test_interrupt import _config


def test_a_policy_learned_when_the_gain_clears_its_interval() -> None:
    curve = [{"step": 0, "chips": -0.5, "ci95": 0.1}, {"step": 10, "chips": 0.2, "ci95": 0.1}]
    won = {"random": {"chips": 0.2, "ci95": 0.1}}
    out = ls.learned(curve, won, "chips", competitive=True)
    assert out["gain_vs_untrained"] == pytest.approx(0.7)
    assert out["gain_ci95"] == pytest.approx(0.1 * 2 ** 0.5)
    assert out["beats_untrained"] and out["beats_random"]
    flat = [{"step": 0, "chips": 0.0, "ci95": 0.2}, {"step": 10, "chips": 0.1, "ci95": 0.2}]
    lost = ls.learned(flat, {"random": {"chips": 0.1, "ci95": 0.2}}, "chips", competitive=True)
    assert not lost["beats_untrained"] and not lost["beats_random"]
    coop = ls.learned(curve, won, "chips", competitive=False)
    assert "beats_random" not in coop  # a cooperative game has no opponent to beat


def test_verdicts_need_every_seed_and_every_policy() -> None:
    ok = {"beats_untrained": True, "beats_random": True}
    rows = [{"job": "a", "seed": 0, "learned": {"p": ok}, "scheduler_peak_rss_mb": 900.0},
            {"job": "a", "seed": 1, "learned": {"p": ok}, "scheduler_peak_rss_mb": 1200.0},
            {"job": "b", "seed": 0, "learned": {"p": ok, "q": {**ok, "beats_random": False}},
             "scheduler_peak_rss_mb": 5000.0}]
    v = ls.verdicts(rows)
    assert v == {"a": {"seeds": [0, 1], "every_seed": True, "scheduler_peak_mb": 1200.0, "scheduler_under_budget": True},
                 "b": {"seeds": [0], "every_seed": False, "scheduler_peak_mb": 5000.0, "scheduler_under_budget": False}}


def _history(*points: dict[str, tuple[float, float, float]]) -> list[dict]:
    return [{"step": 10 * i, "ratings": {p: list(r) for p, r in pt.items()}} for i, pt in enumerate(points)]


def test_ratings_settle_when_the_last_two_intervals_overlap() -> None:
    points = [{"a": (0.0, -0.2, 0.2), "b": (0.0, -0.2, 0.2)}, {"a": (1.0, 0.7, 1.3), "b": (0.1, -0.1, 0.3)}]
    assert ls.settled(_history(*points)) is False  # a's intervals [-0.2, 0.2] and [0.7, 1.3] are apart
    still = _history(*points, {"a": (1.2, 0.9, 1.5), "b": (0.3, 0.0, 0.6)})
    assert ls.settled(still) is True
    assert ls.settled(still[:1]) is None  # one evaluation: nothing to compare
    new_player = _history({"a": (0.0, -0.2, 0.2)}, {"a": (0.0, -0.2, 0.2), "b": (0.0, -0.2, 0.2)})
    assert ls.settled(new_player) is False  # b has no earlier rating


def test_a_pair_job_gets_a_ratings_verdict_and_panel(tmp_path) -> None:
    ok = {"beats_untrained": True, "beats_random": True}
    curve = {p: [{"step": 0, "chips": -0.2, "ci95": 0.1}, {"step": 10, "chips": 0.3, "ci95": 0.1}] for p in "ab"}
    settled = _history({"a": (0.5, 0.2, 0.8), "b": (0.4, 0.1, 0.7)}, {"a": (0.6, 0.3, 0.9), "b": (0.5, 0.2, 0.8)})
    moving = _history({"a": (0.0, -0.2, 0.2), "b": (0.4, 0.1, 0.7)}, {"a": (1.0, 0.7, 1.3), "b": (0.5, 0.2, 0.8)})
    base = {"job": "pair", "game": "kuhn_poker_v0", "unit": "chips", "label": "chips/hand", "curve": curve,
            "learned": {"a": ok, "b": ok}, "scheduler_peak_rss_mb": 900.0}
    rows = [{**base, "seed": 0, "ratings": settled}, {**base, "seed": 1, "ratings": moving},
            {**base, "job": "solo", "seed": 0, "curve": {"a": curve["a"]}, "learned": {"a": ok}, "ratings": settled}]
    v = ls.verdicts(rows)
    assert v["pair"]["ratings_settled"] is False  # seed 1's a moved
    assert "ratings_settled" not in v["solo"]  # one policy: no pair to settle
    assert ls.verdicts(rows[:1])["pair"]["ratings_settled"] is True
    png = tmp_path / "suite.png"
    assert ls.plot(rows, png) == ["pair (kuhn_poker_v0)", "pair: ratings", "solo (kuhn_poker_v0)"]
    assert png.stat().st_size > 10_000


def test_targets_check_every_policy_and_the_time() -> None:
    minimax = {"wins": 0.0, "draws": 12.0, "losses": 8.0, "score": -0.4, "ci95": 0.2}
    row = {"unit": "score", "wall_s": 1700.0,
           "final": {"main": {"random": {"score": 0.65, "ci95": 0.1}, "tictactoe_minimax": minimax}}}
    ttt = ls.TARGETS["tictactoe"]
    out = ls.meets(row, ttt)
    assert out == {"main/vs_random": 0.65, "main/drawn_vs_tictactoe_minimax": pytest.approx(0.6),
                   "minutes": pytest.approx(1700 / 60), "met": True}
    assert not ls.meets({**row, "wall_s": 1900.0}, ttt)["met"]  # 31.7 minutes
    # A run resumed from a checkpoint without its time: its minutes are unknown, so not met.
    assert ls.meets({**row, "wall_s_from_step": 10}, ttt)["minutes"] is None
    assert not ls.meets({**row, "wall_s_from_step": 10}, ttt)["met"]
    few_draws = {"main": {**row["final"]["main"], "tictactoe_minimax": {**minimax, "draws": 9.0, "losses": 11.0}}}
    assert not ls.meets({**row, "final": few_draws}, ttt)["met"]  # 45% drawn
    kuhn = {"unit": "chips", "wall_s": 600.0, "final": {"main": {"random": {"chips": 0.289, "ci95": 0.096}}}}
    assert ls.meets(kuhn, ls.TARGETS["default"]) == {"main/vs_random": 0.289, "met": False}
    # The exact value of the same policy, where the row has it, decides (no sampling noise).
    exact = {**kuhn, "exact": {"main": {"value_vs_random": 0.375, "exploitability": 1 / 3}}}
    assert ls.meets(exact, ls.TARGETS["default"]) == {"main/vs_random": 0.289, "main/vs_random_exact": 0.375,
                                                      "met": True}


def test_a_neutral_field_added_since_keeps_the_hash() -> None:
    import hashlib

    from opentinker.config import load_config, to_toml

    text = to_toml(load_config("default", {})).decode()
    assert ("[train]", 'opponent_draws = "episode"') in ls.NEUTRAL_FIELDS
    without = text
    for table, line in ls.NEUTRAL_FIELDS:
        if line == table:  # an empty table: its header and the blank line after it
            assert f"\n{line}\n\n" in text and (table, "") in ls.NEUTRAL_FIELDS
            without = without.replace(f"\n{line}\n\n", "\n")
        elif line:
            assert f"\n{line}\n" in text  # each field is written out ...
            without = without.replace(f"\n{line}\n", "\n")
    assert ls.config_sha256("default") == hashlib.sha256(without.encode()).hexdigest()  # ... and not hashed
    # The committed rows were made before these fields: their jobs' hashes are unchanged.
    rows = json.loads((ROOT / "benchmarks/results/learning_suite.json").read_text())["rows"]
    assert rows and all(r["key"]["config_sha256"] == ls.config_sha256(r["job"]) for r in rows)


def test_scripted_references_play_the_real_seats() -> None:
    ttt = ls.scripted_reference("tictactoe_v0", {}, n_games=40)
    assert ttt["tictactoe_minimax with tictactoe_minimax"] == {"mean": 0.0, "ci95": 0.0, "games": 40.0}  # draws
    assert ttt["tictactoe_minimax with random"]["mean"] > 0.6  # never loses, mostly wins
    ref = ls.scripted_reference("referential_v0", {}, n_games=40)
    assert ref["referential_heuristic with referential_heuristic"]["mean"] == 1.0  # always understood
    assert 0.0 < ref["referential_heuristic with random"]["mean"] < 0.6


def test_trained_scores_sit_beside_the_scripted_seat_with_the_same_partner() -> None:
    def row(seed: int, finals: dict) -> dict:
        return {"job": "referential", "seed": seed, "unit": "success", "final": finals}

    rows = [row(0, {"main": {"random": {"success": 0.1}, "referential_heuristic": {"success": 0.4}}}),
            row(1, {"main": {"random": {"success": 0.3}, "referential_heuristic": {"success": 0.6}}}),
            {"job": "default", "seed": 0, "unit": "chips", "final": {"main": {"random": {"chips": 9.0}}}}]
    refs = {"referential": {"referential_heuristic with referential_heuristic": {"mean": 1.0},
                            "referential_heuristic with random": {"mean": 0.25}}}
    got = ls.beside_scripted(rows, refs)
    assert list(got) == ["referential"]
    same, rnd = got["referential"]
    assert same == {"seat": "referential_heuristic", "partner": "referential_heuristic", "trained": [0.4, 0.6],
                    "trained_mean": pytest.approx(0.5), "scripted": 1.0}
    assert rnd["partner"] == "random" and rnd["trained"] == [0.1, 0.3] and rnd["scripted"] == 0.25


def test_every_suite_job_is_bundled() -> None:
    from opentinker.config import bundled_configs

    assert set(ls.SUITE) <= set(bundled_configs())


def test_long_dialogue_jobs_get_a_smaller_evaluation_unless_one_is_asked_for() -> None:
    assert set(ls.EVAL_GAMES) <= set(ls.SUITE)
    assert ls.eval_games(ls.Args(), "twenty_questions") == 8
    assert ls.eval_games(ls.Args(), "default") == ls.DEFAULT_EVAL_GAMES == 34
    assert ls.eval_games(ls.Args(eval_games=5), "twenty_questions") == 5


@pytest.mark.slow
def test_a_quick_suite_runs_a_seed_and_reuses_it(tmp_path, tiny_path) -> None:
    out, js, png = tmp_path / "suite", tmp_path / "suite.json", tmp_path / "suite.png"
    cmd = [sys.executable, "benchmarks/learning_suite.py", "--quick", "--out", str(out), "--json", str(js),
           "--plot", str(png)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    r = json.loads(js.read_text())
    check_provenance(r, "learning_suite.py")
    (row,) = r["rows"]
    assert (row["job"], row["seed"], row["game"], row["model"], row["steps"]) == (
        "default", 0, "kuhn_poker_v0", "tiny-random", 1)
    final = row["final"]["main"]
    assert set(final) == {"random", "base", "kuhn_equilibrium"}
    for m in final.values():
        assert m["hands"] > 0 and m["ci95"] >= 0 and -2 <= m["chips"] <= 2
    assert [c["step"] for c in row["curve"]["main"]] == [0, 1]
    assert row["peak_rss_total_mb"] > 0 and row["scheduler_peak_rss_mb"] > 0
    assert r["verdicts"]["default"]["seeds"] == [0]
    assert png.stat().st_size > 0
    (folder,) = (out / "default").glob("seed0-*")
    assert folder.name == f"seed0-{ls.config_sha256('default')[:8]}"
    result = folder / "result.json"
    before = result.stat().st_mtime_ns
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "reused" in again.stdout and "step 1/1" not in again.stdout
    assert result.stat().st_mtime_ns == before
    assert len(list(folder.glob("kuhn_poker_v0__*"))) == 1


def test_seeds_stopped_or_not_yet_evaluated_are_listed(tmp_path) -> None:
    """The suite names each seed of a current config that has no result yet but something to go
    on from: a run stopped at a checkpoint, or a trained run still to evaluate; not a seed with
    a result, one stopped before its first checkpoint, or one of another config."""
    cfg, sha = ls.load_config("default", {}), ls.config_sha256("default")
    game, steps = cfg.game, cfg.train.steps

    def run(seed: int, folder: str) -> Path:
        path = tmp_path / "default" / f"seed{seed}-{folder}" / f"{game}__{cfg.name}__{seed}__20261206-000000"
        path.mkdir(parents=True)
        (path / "config.toml").write_bytes(ls.to_toml(cfg))
        return path

    def checkpoint(path: Path, step: int, eval_due: bool = False) -> None:
        (path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (path / "checkpoints" / f"step_{step}" / "state.json").write_text(json.dumps(
            {"step": step, "first_eval": {}, "last_eval": {}, **({"eval_due": True} if eval_due else {})}))

    checkpoint(run(1, sha[:8]), 3)
    checkpoint(run(5, sha[:8]), steps, eval_due=True)  # stopped during its last evaluation
    (run(2, sha[:8]) / "summary.json").write_text("{}")
    done = run(0, sha[:8])
    (done.parent / "result.json").write_text("{}")
    run(3, sha[:8])  # stopped before its first checkpoint: nothing to go on from
    checkpoint(run(4, "0" * 8), 7)  # another config's
    assert ls.unfinished(tmp_path) == [
        f"default seed 1: not finished, with the checkpoint of step 3 of {steps}; --jobs default --seeds 1 goes on from it",
        "default seed 2: trained; its final evaluation runs with --jobs default --seeds 2",
        (f"default seed 5: not finished, with the checkpoint of step {steps} of {steps} (written before its "
         "evaluation, which runs first); --jobs default --seeds 5 goes on from it")]


def test_results_of_another_config_are_not_gathered(tmp_path) -> None:
    sha = ls.config_sha256("default")
    for name, key_sha in (("seed0-current", sha), ("seed1-stale", "0" * 64)):
        folder = tmp_path / "default" / name
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps({
            "job": "default", "seed": int(name[4]), "key": {"config_sha256": key_sha}, "unit": "chips",
            "wall_s": 600.0, "final": {"main": {"random": {"chips": 0.35, "ci95": 0.1}}}}))
    (row,) = ls.gather(tmp_path)
    assert row["seed"] == 0 and row["target"] == {"main/vs_random": 0.35, "met": True}


def test_a_fresh_checkout_reuses_the_seeds_of_the_committed_json(tmp_path, capsys, monkeypatch) -> None:
    """The rows of an earlier JSON made with the job's config as it stands come back as results
    under ``--out`` (another folder than they ran in), a seed asked for again is reused, not
    run, and the gather keeps them; a row of another config is not restored."""
    sha = ls.config_sha256("default")
    row = {"job": "default", "seed": 0, "unit": "chips", "wall_s": 600.0, "run": "kuhn_poker_v0__default__0__x",
           "key": {"job": "default", "seed": 0, "sets": ["seed=0", "out_dir=/elsewhere/default/seed0"],
                   "eval_games": ls.DEFAULT_EVAL_GAMES, "config_sha256": sha},
           "final": {"main": {"random": {"chips": 0.35, "ci95": 0.1}}}, "target": {"met": True}}
    stale = {**row, "seed": 1, "key": {**row["key"], "seed": 1, "config_sha256": "0" * 64}}
    earlier = tmp_path / "suite.json"
    earlier.write_text(json.dumps({"rows": [row, stale]}))
    out = tmp_path / "suite"
    (written,) = ls.restore(out, earlier)
    assert written == out / "default" / f"seed0-{sha[:8]}" / "result.json"
    assert "target" not in json.loads(written.read_text())  # the gather recomputes it
    assert ls.restore(out, earlier) == []  # a result already there is kept
    args = ls.Args(out=str(out))
    monkeypatch.setattr(ls, "run_or_reuse", lambda *a, **k: pytest.fail("ran a restored seed again"))
    assert ls.run_seed(args, "default", 0)["run"] == row["run"]
    assert "reused" in capsys.readouterr().out
    (gathered,) = ls.gather(out)
    assert (gathered["seed"], gathered["target"]["met"]) == (0, True)
    earlier.write_text('{"rows": [{"job": "default"}]}')
    with pytest.raises(SystemExit, match="not a learning suite JSON"):
        ls.restore(tmp_path / "other", earlier)


def test_a_seed_another_invocation_is_making_is_left_to_it(tmp_path, monkeypatch) -> None:
    """Two invocations on one ``--out``: a seed whose lock the other holds (for its run and its
    evaluation) stops with an error that says so, and nothing is run or resumed beside it; once
    the lock is gone the seed is made. ``run_or_reuse`` holds its own lock per job and seed."""
    out = tmp_path / "suite"
    folder = out / "default" / f"seed0-{ls.config_sha256('default')[:8]}"

    def made(*a, **k):
        raise RuntimeError("made")

    monkeypatch.setattr(ls, "run_or_reuse", made)
    with (claimed(folder / ".seed.lock", "the other invocation"),
          pytest.raises(RuntimeError, match=r"default seed 0: another invocation is making this run now \(it holds ")):
        ls.run_seed(ls.Args(out=str(out)), "default", 0)
    with pytest.raises(RuntimeError, match="made"):
        ls.run_seed(ls.Args(out=str(out)), "default", 0)
    with (claimed(tmp_path / ".ctrlc-seed0.lock", "the other invocation"),
          pytest.raises(RuntimeError, match="job: another invocation is making this run now")):
        run_or_reuse([sys.executable, "-c", "raise SystemExit('ran')"], tmp_path, "ctrlc", 0, tmp_path / "job.log", "job")
    assert not (tmp_path / "job.log").exists()


_SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {bench!r})
from _jobs import run_logged
child = [sys.executable, "-c", {child!r}]
try:
    run_logged(child, Path({log!r}), "job")
except RuntimeError as e:
    print("error:", e, flush=True)
    sys.exit(1)
"""

_CHILD = """
import os, signal, sys, time
def stop(signum, frame):
    print(f"opentinker: stopped by {signal.Signals(signum).name} with the checkpoint of step 1", flush=True)
    sys.exit(130)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
print(f"started pid={os.getpid()}", flush=True)
time.sleep(60)
print("opentinker: slept through", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_suite_is_passed_on_to_its_running_job(tmp_path, sig) -> None:
    """A script that runs jobs through ``run_logged`` (the suite, the other benchmarks), sent
    SIGTERM or SIGINT, passes it on to its ``opentinker`` child (which stops and says so) and
    fails naming it, instead of dying and leaving the child running. The child has a process
    group of its own, so a terminal's Ctrl-C reaches it once, through the script."""
    import psutil

    log = tmp_path / "run.log"
    script = _SCRIPT.format(bench=str(ROOT / "benchmarks"), child=_CHILD, log=str(log))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    assert proc.stdout is not None
    first = proc.stdout.readline()  # run_logged echoes the child's "started" line
    assert first.startswith("  [job] started pid="), first
    child_pid = int(first.rsplit("=", 1)[1])
    try:
        assert os.getpgid(child_pid) == child_pid != os.getpgid(proc.pid)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1, out
        assert f"  [job] opentinker: stopped by {sig.name} with the checkpoint of step 1" in out
        # "exited 130": run_logged waited for the child, so it is gone, not orphaned.
        assert f"error: job: stopped; {sig.name} passed on to" in out and "which exited 130" in out
        assert "slept through" not in log.read_text()
        assert not psutil.pid_exists(child_pid), f"the child {child_pid} outlived the script"
    finally:  # a script that did not wait for its child (the failure) leaves no sleeper behind
        if proc.returncode != 1:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)


_SUITE = """
import sys
from pathlib import Path
sys.path.insert(0, {bench!r})
import learning_suite as ls
from _jobs import run_logged

def run_seed(args, job, seed):  # each seed's run: a child that stops on a signal, as a run does
    print(f"seed {{seed}} starts", flush=True)
    run_logged([sys.executable, "-c", {child!r}], Path({out!r}) / f"seed{{seed}}.log", f"{{job}} seed {{seed}}")

ls.run_seed = run_seed
sys.argv = ["learning_suite.py", "--jobs", "default", "--seeds", "0,1,2", "--out", {out!r}, "--json", {json!r},
            "--plot", {plot!r}]
ls.main()
"""


def test_ctrl_c_to_the_suite_stops_it_after_the_seed_in_progress(tmp_path) -> None:
    """SIGINT to the suite stops the seed in progress (passed on to its run) and starts no
    further seed (before, the next seed started as if the stopped one had failed); the JSON is
    still written with what was gathered, and the suite exits 130."""
    out, js = tmp_path / "out", tmp_path / "suite.json"
    out.mkdir()
    script = _SUITE.format(bench=str(ROOT / "benchmarks"), child=_CHILD, out=str(out), json=str(js),
                           plot=str(tmp_path / "suite.png"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(2)]
    assert lines[0] == "seed 0 starts\n" and lines[1].startswith("  [default seed 0] started pid="), lines
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, rest
    assert "[default seed 0] default seed 0: stopped; SIGINT passed on to" in rest
    assert "no further seed runs, and the results so far are gathered" in rest
    assert "seed 1 starts" not in rest and "seed 2 starts" not in rest
    assert json.loads(js.read_text())["rows"] == []


_MARKING_CHILD = """
import os, signal, sys, time
def stop(signum, frame):
    open({marker!r}, "w").write(signal.Signals(signum).name)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print(f"started pid={{os.getpid()}}", flush=True)
time.sleep(60)
"""


def test_a_job_whose_script_is_killed_is_stopped_not_left_running(tmp_path) -> None:
    """SIGKILL to a script running a job (nothing of it runs any more): the kernel sends the
    job SIGTERM (``PR_SET_PDEATHSIG``), so it stops with its newest checkpoint instead of
    training on unwatched, where the next run of the script would resume it a second time."""
    import psutil

    marker = tmp_path / "stopped"
    child = _MARKING_CHILD.format(marker=str(marker))
    script = _SCRIPT.format(bench=str(ROOT / "benchmarks"), child=child, log=str(tmp_path / "run.log"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith("  [job] started pid="), first
    child_pid = int(first.rsplit("=", 1)[1])
    try:
        proc.kill()
        proc.wait(timeout=30)
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(child_pid).wait(timeout=30)
        assert marker.read_text() == "SIGTERM"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)


_RESUME_SCRIPT = """
import json, sys
from pathlib import Path
sys.path.insert(0, {bench!r})
from _jobs import opentinker, run_or_reuse
root = Path({root!r})
try:
    run, info = run_or_reuse(opentinker("run", {config!r}), root, "ctrlc", 0, root / "job.log", "job")
except RuntimeError as e:
    print("error:", e, flush=True)
    sys.exit(1)
print("info:", json.dumps(info), flush=True)
"""


@pytest.mark.slow
def test_a_job_stopped_by_ctrl_c_goes_on_from_its_checkpoint_the_next_time(tmp_path) -> None:
    """Ctrl-C to a script running a real job (tiny model, 5 steps, no periodic checkpoints):
    the job stops after its step with a checkpoint of it; the same call again goes on from
    there (``--resume``) instead of starting afresh, plays every step once, and reports the
    run's whole time (the time up to the checkpoint, which it records, and the rest)."""
    root = tmp_path / "runs"  # where _config's job writes its runs
    root.mkdir()
    config = _config(tmp_path, 5)
    cmd = [sys.executable, "-c", _RESUME_SCRIPT.format(bench=str(ROOT / "benchmarks"), root=str(root),
                                                       config=str(config))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    watchdog = threading.Timer(300, proc.kill)  # bounded: a job that never logs a step is killed
    watchdog.start()
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # ends when the script does
            lines.append(line)
            if line.startswith("  [job] step 1/5 train"):
                proc.send_signal(signal.SIGINT)
                break
        out = "".join(lines) + proc.communicate(timeout=240)[0]
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 1, out
    assert "error: job: stopped; SIGINT passed on to" in out and "which exited 130" in out
    assert finished_run(root, "ctrlc", 0) is None
    stopped = stopped_run(root, "ctrlc", 0)
    assert stopped is not None, out
    run, step = stopped
    assert 1 <= step < 5 and f"[job] opentinker: stopped with the checkpoint of step {step}" in out
    before = json.loads((run / "checkpoints" / f"step_{step}" / "state.json").read_text())["wall_s"]

    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"going on with {run} from its checkpoint of step {step}" in again.stdout
    assert finished_run(root, "ctrlc", 0) == run and len(list(root.glob("*__ctrlc__0__*"))) == 1
    info = json.loads(again.stdout.split("info: ", 1)[1])
    summary = json.loads((run / "summary.json").read_text())
    assert info["resumed_from_step"] == step and info["wall_s"] == summary["wall_s"] > before
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert "stopped with the checkpoint" in (root / "job.log.1").read_text()  # the first attempt's output kept
    assert "resumed from" in (root / "job.log").read_text()


def test_a_logged_command_keeps_the_earlier_attempts_log(tmp_path) -> None:
    """A final evaluation that failed and ran again keeps the failure's output (``eval.log.1``)."""
    from _jobs import run_logged

    log = tmp_path / "eval.log"
    log.write_text("the first attempt's traceback\n")
    run_logged([sys.executable, "-c", "print('second')"], log, "job")
    with pytest.raises(RuntimeError, match="exited 3; its output: .*eval.log"):
        run_logged([sys.executable, "-c", "print('third'); raise SystemExit(3)"], log, "job")
    assert log.read_text() == "third\n"
    assert (tmp_path / "eval.log.1").read_text() == "the first attempt's traceback\n"
    assert (tmp_path / "eval.log.2").read_text() == "second\n"
