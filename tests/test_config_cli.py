import json

import pytest

from opentinker.cli import main
from opentinker.overrides import parse_overrides
from opentinker.config import JobConfig, load_config


def test_default_config_loads_and_names_bad_fields(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, JobConfig) and cfg.model.base == "smollm2-135m"
    assert "random" in cfg.policies[0].opponents
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlrr = 1\n")
    with pytest.raises(ValueError, match=r"^train.lrr: unknown field \(did you mean 'lr'\?\)$"):
        load_config(bad)
    bad.write_text('[train]\nlr = "fast"\n')
    with pytest.raises(ValueError, match=r"^train.lr: expected `float`, got `str`$"):
        load_config(bad)
    bad.write_text("[train]\nsteps = -1\n")
    with pytest.raises(ValueError, match=r"^train.steps: expected `int` >= 0, got -1$"):
        load_config(bad)
    with pytest.raises(ValueError, match=r"^runtime.backend: invalid enum value 'slurm' \(one of: local, ray\)$"):
        load_config(None, {"runtime": {"backend": "slurm"}})
    with pytest.raises(ValueError, match=r"^policies\[0\].name: 'self': must be an identifier"):
        load_config(None, {"policies": [{"name": "self"}]})
    bad.write_text("[train\n")
    with pytest.raises(ValueError, match=r"^config: '.*bad.toml' is not valid TOML"):
        load_config(bad)


def test_bundled_configs_load_by_name():
    from opentinker.config import bundled_configs

    assert {"default", "tictactoe", "connect_four", "kuhn_league", "leduc_league"} <= set(bundled_configs())
    for name in bundled_configs():
        cfg = load_config(name)
        __import__("games").resolve(cfg.game)  # registered, or an importable PettingZoo env
    with pytest.raises(FileNotFoundError, match="^config: file 'no_such_job' does not exist .bundled jobs"):
        load_config("no_such_job")


def test_set_overrides_parse():
    assert parse_overrides(["train.steps=3", "model.base=tiny-random", "x.y.z=[1,2]"]) == {
        "train": {"steps": 3}, "model": {"base": "tiny-random"}, "x": {"y": {"z": [1, 2]}}
    }
    lr = parse_overrides(["train.lr=inf", "train.clip_low=-inf", "train.clip_high=nan"])["train"]
    assert lr["lr"] == float("inf") and lr["clip_low"] == float("-inf") and lr["clip_high"] != lr["clip_high"]
    from opentinker.config import ConfigError

    for bad, why in [("train.steps", "expected key=value"), ("train..steps=1", "dotted field name"),
                     ("a.b.c.d.e.f.g.h.i=1", "dotted field name"), ("x=" + "[" * 100_000, "nested too deep")]:
        with pytest.raises(ConfigError, match=f"^--set: .*{why}"):
            parse_overrides([bad])
    with pytest.raises(ConfigError, match="^--set: 'train.steps.x': 'steps' is already set to a value"):
        parse_overrides(["train.steps=1", "train.steps.x=2"])


def test_unknown_algorithm_is_refused_before_start(capsys):
    assert main(["run", "--set", "train.loss=dpo_typo", "--set", "model.base=tiny-random"]) == 2
    assert capsys.readouterr().err.startswith("opentinker: bad config: train.loss: 'dpo_typo' is not a policy loss")


@pytest.mark.slow
@pytest.mark.parametrize("advantage, loss", [("grpo", "importance_sampling"), ("rloo", "cispo")])
def test_each_group_learner_runs_a_short_job(advantage, loss, tiny_path):
    import msgspec

    from opentinker.config import JobConfig
    from opentinker.control.runtime import Job

    cfg = msgspec.convert({"runtime": {"backend": "local"}, "train": {"advantage": advantage, "loss": loss, "groups_per_step": 2, "group_size": 2},
                           "sampling": {"max_tokens": 3}}, JobConfig)
    job = Job(cfg, tiny_path)
    try:
        m = job.coordinator("train_step", 1)
        assert m["train/main/version"] == 1 and "train/main/loss/n_tokens" in m
    finally:
        job.shutdown()


def test_bad_config_exits_2_with_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[sampling]\ntemprature = 0.5\n")
    assert main(["run", str(bad)]) == 2
    assert capsys.readouterr().err == ("opentinker: bad config: sampling.temprature: unknown field "
                                       "(did you mean 'temperature'?)\n")


@pytest.mark.slow
def test_run_writes_the_run_folder(tmp_path, tiny_path, capsys, monkeypatch):
    from peft import PeftConfig

    from opentinker import run_folder
    from opentinker.machine import git_commit

    # The checkout as the run opened it (a commit made while a run trains is not its code).
    monkeypatch.setattr(run_folder, "git_commit", lambda: ("0" * 40, True))
    code = main([
        "run", "--set", "model.base=tiny-random", "--set", "runtime.backend=local",
        "--set", "train.steps=2", "--set", "train.groups_per_step=2", "--set", "train.group_size=2",
        "--set", "eval.hands_per_stratum=1", "--set", "eval.head_to_head_per_stratum=1",
        "--set", "eval.every=1", "--set", f"out_dir={tmp_path}",
    ])
    assert code == 0
    out = capsys.readouterr().out  # not a terminal: plain lines, no progress bars' last frame
    assert "step 1/2 train: reward" in out and "episodes (" not in out and "eval (untrained)" not in out
    (run_dir,) = list(tmp_path.iterdir())
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.toml", "metrics.jsonl", "learning_curve.png", "cross_play.png", "summary.json", "adapters",
            "transcripts.txt", "tb"} <= names
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["eval", "train", "eval", "train", "eval"]
    assert load_config(run_dir / "config.toml").train.steps == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["commit"], summary["dirty"], summary["commit_at_end"]) == ("0" * 40, True, git_commit()[0])
    assert PeftConfig.from_pretrained(str(run_dir / "adapters" / "main")).r == 8
    assert (run_dir / "learning_curve.png").stat().st_size > 10_000
    assert (run_dir / "cross_play.png").stat().st_size > 10_000
    # Every step's first episodes: what the LLM seat saw, its reply, the outcome.
    text = (run_dir / "transcripts.txt").read_text()
    assert [ln for ln in text.splitlines() if ln.startswith("## step")] == ["## step 1", "## step 2"]
    step1 = text.split("## step 2")[0]
    assert step1.count("# episode") == 4 and step1.count("outcome: player_0") == 4
    assert "[adapter:main] sees:\n    " in step1 and "[adapter:main@0]: '" in step1
    assert "You are Player" in step1 or "card" in step1.lower()  # the game's own observation text


def test_an_older_runs_config_still_loads(tmp_path):
    """``eval.exploitability`` was renamed ``exact``: a run's config.toml from before loads."""
    old = tmp_path / "config.toml"
    old.write_text('[eval]\nexploitability = false\n')
    assert load_config(old).eval.exact is False


@pytest.mark.parametrize("out_dir", ["/proc/opentinker_nope", "/sys/kernel"])
def test_an_out_dir_that_cannot_be_written_is_one_line(out_dir, capsys, tiny_path):
    code = main(["run", "default", "--set", f"out_dir={out_dir}", "--set", "model.base=tiny-random",
                 "--set", "runtime.backend=local"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("opentinker: bad config: out_dir: cannot make the run folder") and "Traceback" not in err


def test_a_game_in_a_single_file_of_the_working_folder(tmp_path, monkeypatch, tiny_path):
    """``game = "colors:env"`` with ``colors.py`` where opentinker runs: imported (and named in
    the error when the factory is missing), its run folder without a colon."""
    (tmp_path / "colors.py").write_text("from pettingzoo.classic import rps_v2\n\n\ndef env(**kw):\n"
                                        "    return rps_v2.env(**kw)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    (tmp_path / "job.toml").write_text(f'game = "colors:env"\nout_dir = "{tmp_path / "runs"}"\n'
                                       '[model]\nbase = "tiny-random"\nthreads = 1\n[runtime]\nbackend = "local"\n'
                                       'env_runners = 1\n[train]\nsteps = 1\ngroups_per_step = 1\ngroup_size = 2\n'
                                       '[sampling]\nmax_tokens = 3\n[eval]\nhands_per_stratum = 1\n'
                                       'head_to_head_per_stratum = 0\n')
    assert main(["run", str(tmp_path / "job.toml")]) == 0
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("colors.env__default__0__")
    import games

    with pytest.raises(ValueError, match="single file module.py"):
        games.make("colors")


def test_a_missing_poker_dependency_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "needs_rlcard.py").write_text("raise ModuleNotFoundError(\"No module named 'rlcard'\", name='rlcard')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import games

    with pytest.raises(ValueError, match=r"pip install -e '\.\[poker\]' installs rlcard"):
        games.make("needs_rlcard:env")


def test_a_resume_rewinds_the_transcripts_to_its_checkpoint(tmp_path):
    from opentinker.control import transcripts
    from protocols.messages import EpisodeSummary

    path = tmp_path / "transcripts.txt"
    for step in (1, 2, 3):
        ep = EpisodeSummary(episode_id=step, group_id=0, seed=0, rewards={}, invalid={}, turns={},
                            transcript=[f"line of step {step}", "## step 9 in a reply is not a header "])
        transcripts.append(path, transcripts.render(step, [ep]))
    transcripts.truncate(path, 2)
    text = path.read_text()
    assert "line of step 2" in text and "line of step 3" not in text and text.count("## step ") == 4


def test_games_lists_each_games_scripted_seats(capsys):
    import games

    assert main(["games"]) == 0
    out = capsys.readouterr().out
    for name in games.names():
        assert f"{name}: " in out
    assert "scripted seats (opponents, eval --vs): random, kuhn_equilibrium" in out
    assert "cooperative; scripted seats" in out  # referential


def test_set_reaches_into_a_list_by_index():
    cfg = load_config("negotiation_three", parse_overrides(["policies[1].lora_rank=4", "policies[2].frozen=true"]))
    assert cfg.policies[1].lora_rank == 4 and cfg.policies[2].frozen and not cfg.policies[0].frozen
    assert load_config("default", parse_overrides(["policies[0].name=solo"])).policies[0].name == "solo"
    with pytest.raises(ValueError, match=r"policies\[5\]: the config has \d of them"):
        load_config("default", parse_overrides(["policies[5].name=x"]))
    with pytest.raises(ValueError, match=r"train: is not a list"):
        load_config("default", parse_overrides(["train[0]=3"]))


def test_output_into_a_closed_pipe_ends_quietly(monkeypatch):
    """``opentinker status | head``: when the reader stops early, no BrokenPipe traceback; the
    exit code is a shell tool's (128 + SIGPIPE)."""
    import io

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["games"]) == 141


COOP_ENV = '''
"""A two-seat coordination game: both seats earn 1 when they pick the same of three symbols."""
import functools

from gymnasium import spaces
from pettingzoo import ParallelEnv


class Coordinate(ParallelEnv):
    metadata = {"name": "coordinate_v0"}

    def __init__(self):
        self.possible_agents = ["a", "b"]

    @functools.lru_cache(maxsize=None)
    def observation_space(self, agent):
        return spaces.Discrete(1)

    @functools.lru_cache(maxsize=None)
    def action_space(self, agent):
        return spaces.Discrete(3)

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        return {a: 0 for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        same = float(actions["a"] == actions["b"])
        self.agents = []
        done = {a: True for a in self.possible_agents}
        return ({a: 0 for a in done}, {a: same for a in done}, done, {a: False for a in done},
                {a: {} for a in done})


def env():
    return Coordinate()
'''


def test_a_game_without_a_hook_that_pays_seats_alike_is_scored_as_cooperative(tmp_path, monkeypatch):
    (tmp_path / "coordinate.py").write_text(COOP_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    import games

    assert games.evaluation("coordinate:env").competitive is False  # no wins, losses or P(beats random)
    assert games.evaluation("pettingzoo.classic.connect_four_v3").competitive is True


def test_a_rewritten_result_file_does_not_make_the_code_dirty(tmp_path):
    """A benchmark writes its committed JSON while it records its provenance: only code counts."""
    import subprocess

    from opentinker.machine import RESULTS, git_commit

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / RESULTS).mkdir(parents=True)
    (tmp_path / RESULTS / "b.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    assert git_commit(tmp_path)[1] is False
    (tmp_path / RESULTS / "b.json").write_text("")  # opened for writing, provenance not yet in
    assert git_commit(tmp_path)[1] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path)[1] is True
