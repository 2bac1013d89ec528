"""benchmarks/compare_learners.py: its statistics (pure functions) and a smoke run on the tiny
model through the real path (``opentinker run`` per seed, the frozen ``dpo`` policy, the
offline DPO job, ``opentinker eval``), then the same command again, which reuses every run;
benchmarks/lora_vs_full.py: a smoke run whose ratios and verdict follow from its rows."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import check_provenance

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare_learners as cl


def test_bootstrap_interval_of_the_mean() -> None:
    assert cl.bootstrap_ci([0.25]) == (0.25, 0.25, 0.25)
    m, lo, hi = cl.bootstrap_ci([0.0, 1.0, 2.0, 3.0, 4.0])
    assert m == 2.0 and 0.5 < lo < 2.0 < hi < 3.5
    m, lo, hi = cl.bootstrap_ci([1.0, 1.0, 1.0])
    assert (m, lo, hi) == (1.0, 1.0, 1.0)


def _s(mean, lo, hi, better="higher", seeds=3):
    return {"seeds": seeds, "x": {"mean": mean, "lo": lo, "hi": hi, "better": better}}


def test_separation_needs_disjoint_intervals_and_two_seeds() -> None:
    summary = {"a": _s(0.5, 0.4, 0.6), "b": _s(0.1, 0.0, 0.2), "c": _s(0.3, 0.15, 0.45), "d": _s(0.9, 0.9, 0.9, seeds=1)}
    assert cl.separated(summary, "x") == [("a", "b")]
    low = {k: {**v, "x": {**v["x"], "better": "lower"}} for k, v in summary.items()}
    assert cl.separated(low, "x") == [("b", "a")]  # lower is better: b first


def test_episodes_and_wall_clock_to_target() -> None:
    curve = [{"episodes": 0, "wall_s": 0.0, "chips": -1.0}, {"episodes": 64, "wall_s": 9.5, "chips": 0.1},
             {"episodes": 128, "wall_s": 19.0, "chips": 0.3}]
    assert cl.to_target(curve, "chips", 0.0) == {"episodes_to_target": 64, "wall_s_to_target": 9.5}
    assert cl.to_target(curve, "chips", 0.5) == {"episodes_to_target": None, "wall_s_to_target": None}


@pytest.mark.slow
def test_a_quick_comparison_runs_every_learner_and_resumes(tmp_path, tiny_path) -> None:
    out, js = tmp_path / "cmp", tmp_path / "result.json"
    cmd = [sys.executable, "benchmarks/compare_learners.py", "--quick", "--game", "referential_v0",
           "--out", str(out), "--json", str(js)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    r = json.loads(js.read_text())
    check_provenance(r, "compare_learners.py")
    assert r["provenance"]["config"]["game"] == "referential_v0"
    learners = list(cl.LEARNERS)
    assert sorted((row["learner"], row["seed"]) for row in r["rows"]) == sorted((n, s) for n in learners for s in (0, 1))
    unit = r["unit"]
    assert unit == "success"
    for row in r["rows"]:
        if "error" in row:  # only dpo may lack data (no two outcomes from one start)
            assert row["learner"] == "dpo" and "no two trajectories" in row["error"]
            continue
        steps = [c["step"] for c in row["curve"]]
        assert steps == ([0, 1, 2] if row["learner"] != "dpo" else [0, 2])
        assert [c["episodes"] for c in row["curve"]] == [s * 2 * 4 for s in steps]
        assert row["curve"][-1][unit] == row["final"][unit] and -1 <= row["final"][unit] <= 1
        assert row["learn_s_per_step"] > 0 and row["peak_rss_mb"] > 0
    for s in r["summary"].values():
        if s["seeds"]:
            x = s[unit]
            assert x["lo"] <= x["mean"] <= x["hi"] and len(x["values"]) == s["seeds"]
    # Every online learner trained (versions moved) and the frozen policy did not.
    run = Path(r["jobs"][0]["run"])
    trains = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [t for t in trains if t["kind"] == "train"][-1]
    assert last["train/dpo/version"] == 0 and all(last[f"train/{n}/version"] == 2 for n in learners if n != "dpo")
    assert (out / "curves.png").stat().st_size > 10_000 and "| learner |" in (out / "table.md").read_text()
    assert r["verdict"] in (out / "table.md").read_text()
    # The same command again: every finished run (each seed's online job and its DPO job where
    # that one had data) is found and reused, and the result is the same.
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    dpo_done = sum(1 for row in r["rows"] if row["learner"] == "dpo" and "error" not in row)
    assert again.returncode == 0 and again.stdout.count("reusing") == 2 + dpo_done, again.stdout[-2000:]
    assert json.loads(js.read_text())["rows"] == r["rows"]


@pytest.mark.slow
def test_lora_vs_full_reports_ratios_of_its_own_rows(tmp_path, tiny_path) -> None:
    import lora_vs_full as lvf

    js = tmp_path / "lvf.json"
    res = subprocess.run([sys.executable, "benchmarks/lora_vs_full.py", "--quick", "--out", str(tmp_path / "o"),
                          "--json", str(js)], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(js.read_text())
    check_provenance(r, "lora_vs_full.py")
    assert {k: c["policies"][0]["kind"] for k, c in r["provenance"]["config"].items()} == {"lora": "lora", "full": "full"}
    by_kind = {row["kind"]: row for row in r["rows"]}
    assert set(by_kind) == {"lora", "full"} and all(row["seed"] == 0 for row in r["rows"])
    for k in ("s_per_step", "learn_s_per_step", "peak_rss_largest_mb", "train_tokens_per_s"):
        assert r["ratios"][k]["mean"] == pytest.approx(by_kind["full"][k] / by_kind["lora"][k]), k
    # A full-parameter policy holds every base weight and its AdamW moments: a larger process.
    assert by_kind["full"]["peak_rss_largest_mb"] > by_kind["lora"]["peak_rss_largest_mb"]
    fast = r["ratios"]["s_per_step"]["mean"] >= 3
    small = 1 - 1 / r["ratios"]["peak_rss_largest_mb"]["mean"] >= 0.4
    want = "holds here." if fast and small else "holds here in part." if fast or small else "does not hold here."
    assert r["claim"] == lvf.claim(r["ratios"]) and r["claim"].endswith(want)
    runs = [json.loads(line) for line in (Path(by_kind["full"]["run"]) / "metrics.jsonl").read_text().splitlines()]
    assert [x["train/main/version"] for x in runs if x["kind"] == "train"] == [1, 2]


def test_lora_vs_full_on_the_tool_task_runs_the_bundled_tools_job(monkeypatch) -> None:
    import lora_vs_full as lvf

    from opentinker.config import load_config

    monkeypatch.setattr(sys, "argv", ["lora_vs_full.py", "--game", "calculator_v0", "--steps", "3"])
    args = lvf.game_defaults(lvf.parse_args(lvf.Args, None)[0])
    tools = load_config("tools")
    # Flags left at Kuhn poker's defaults take the bundled job's values; a flag given wins.
    assert (args.steps, args.max_tokens, args.lora_lr, args.target) == (3, tools.sampling.max_tokens, tools.train.lr,
                                                                        0.5)
    assert args.opponents == "random=1" and args.eval_every == tools.eval.every
    for kind, lr in (("lora", tools.train.lr), ("full", args.full_lr)):
        cfg = lvf.job_config(args, kind, 1)
        assert (cfg.game, cfg.seed, cfg.policies[0].kind, cfg.train.lr, cfg.train.steps) == ("calculator_v0", 1, kind,
                                                                                           lr, 3)
        # What makes it the same job: the bundled system prompt and exploration.
        assert cfg.system_prompt == tools.system_prompt and cfg.sampling.explore == tools.sampling.explore > 0
    base = lvf.scripted_baselines("calculator_v0", n=20)
    assert base["calc_tool_user"] == {"success": 1.0, "ci95": 0.0, "tool_calls": 1.0, "episodes": 20}
    assert base["calc_no_tool"]["success"] < 0.2 and base["calc_no_tool"]["tool_calls"] == 0.0


def test_lora_vs_full_warm_starts_each_kind_from_its_own_sft(monkeypatch) -> None:
    import lora_vs_full as lvf

    from opentinker.config import load_config

    monkeypatch.setattr(sys, "argv", ["lora_vs_full.py", "--game", "calculator_v0", "--warm"])
    args = lvf.game_defaults(lvf.parse_args(lvf.Args, None)[0])
    warm, sft = load_config("tools_warm"), load_config("tools_sft")
    # The RL job is tools_warm's (its steps, rate and no exploration), timed to 0.95 success.
    assert (args.steps, args.lora_lr, args.target) == (warm.train.steps, warm.train.lr, 0.95)
    for kind, lr in (("lora", sft.train.lr), ("full", args.sft_full_lr)):
        s = lvf.sft_config(args, kind, 2)
        assert (s.name, s.seed, s.policies[0].kind, s.train.lr, s.offline.scripted) == (
            f"lvf_sft_{kind}", 2, kind, lr, "calc_tool_user")
        cfg = lvf.job_config(args, kind, 2, "/x/adapters/main")
        assert (cfg.policies[0].kind, cfg.policies[0].init, cfg.sampling.explore) == (kind, "/x/adapters/main", 0.0)
    monkeypatch.setattr(sys, "argv", ["lora_vs_full.py", "--warm"])
    with pytest.raises(SystemExit, match="warm start for calculator_v0"):
        lvf.game_defaults(lvf.parse_args(lvf.Args, None)[0])


@pytest.mark.slow
def test_lora_vs_full_warm_runs_sft_then_rl_from_its_weights(tmp_path, tiny_path) -> None:
    js = tmp_path / "lvf.json"
    cmd = [sys.executable, "benchmarks/lora_vs_full.py", "--quick", "--game", "calculator_v0", "--warm",
           "--out", str(tmp_path / "o"), "--json", str(js)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(js.read_text())
    assert set(r["provenance"]["config"]) == {"lora", "full", "sft_lora", "sft_full"}
    for row in r["rows"]:
        sft = row["sft"]
        assert sft["loss_last"] < sft["loss_first"] and sft["train_wall_s"] > 0
        assert row["peak_rss_largest_mb"] >= sft["peak_rss_largest_mb"]
        # The RL run started from the SFT's saved weights, of its own kind.
        saved = json.loads((Path(sft["run"]) / "summary.json").read_text())["adapters"]["main"]
        cfg = (Path(row["run"]) / "config.toml").read_text()
        assert f'init = "{saved}"' in cfg and f'kind = "{row["kind"]}"' in cfg
