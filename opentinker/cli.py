"""``opentinker`` command line: ``opentinker run [CONFIG.toml] [--set key=value ...]``,
``opentinker eval PATH --game G --vs random,base,...`` (saved adapters, a run folder),
``opentinker play GAME --agent PATH`` (a person against an agent), ``opentinker infer PROMPTS
--out FILE`` (batch inference), ``opentinker games``,
``opentinker serve`` (one scheduler for many jobs, with an OpenAI-compatible endpoint),
``opentinker status`` (what a service holds)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` writes every thread's Python stack to this process's stderr (a queued
    job's log) and the process goes on: where a job that seems stuck is, even inside a native
    call such as a library's import (:mod:`faulthandler` needs no GIL)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor (captured)
            pass


def _working_folder_importable() -> None:
    """Modules in the working folder import, as with ``python -m``, here and in the job's actors
    (Ray's workers inherit ``PYTHONPATH``): a game in a single file ``colors.py`` is
    ``game = "colors:env"``."""
    import os

    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *filter(None, paths)])


def main(argv: list[str] | None = None) -> int:
    """``opentinker ...``; its exit code. Output cut short by a closed pipe (``opentinker
    status | head``) ends quietly, as a shell tool's does; a Ctrl-C no command handled ends
    with one line and 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C outside what a command handles itself (e.g. a late second one)
        print("opentinker: stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:
        import os

        try:  # the interpreter's own flush of stdout at exit would raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141  # 128 + SIGPIPE


@dataclass(frozen=True)
class Command:
    """A subcommand: its name and help, and the module whose ``add`` function declares its
    arguments and whose ``main(args) -> int`` runs it. ``describe``: the module docstring's
    first paragraph is the subcommand's ``--help`` description."""

    name: str
    help: str
    module: str
    add: str = "add_arguments"
    main: str = "main"
    describe: bool = True


COMMANDS = (
    Command("run", "run a job (no config: the bundled default job)", "opentinker.cli", "add_run_arguments",
            "run_main", describe=False),
    Command("games", "list the registered games", "opentinker.cli", "", "games_main", describe=False),
    Command("eval", "evaluate a run's adapters or a saved adapter (95%% intervals, seat-balanced)",
            "opentinker.eval.cli_eval"),
    Command("infer", "batch inference: replies to a JSON Lines file of prompts with a saved adapter or the base model",
            "opentinker.serve.infer"),
    Command("play", "play a game in the terminal against a trained agent or the base model", "opentinker.play"),
    Command("serve", "serve one base model to many jobs, with an OpenAI-compatible HTTP endpoint",
            "opentinker.serve.cli", "add_serve_arguments", "serve_main", describe=False),
    Command("status", "jobs, adapters and counters of a running service", "opentinker.serve.cli",
            "add_status_arguments", "status_main", describe=False),
    Command("jobs", "the job queue of a running service: submit, list, status, cancel", "opentinker.serve.cli",
            "add_jobs_arguments", "jobs_main", describe=False),
)
"""Every subcommand of ``opentinker``, in ``--help``'s order."""


def _main(argv: list[str] | None = None) -> int:
    import importlib

    _stacks_on_sigusr1()  # first: the commands' modules below import libraries
    parser = argparse.ArgumentParser(prog="opentinker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS:
        module = importlib.import_module(cmd.module)
        description = (module.__doc__ or "").split("\n\n")[0].replace("``", "") if cmd.describe else None
        p = sub.add_parser(cmd.name, help=cmd.help, description=description)
        if cmd.add:
            getattr(module, cmd.add)(p)
    args = parser.parse_args(argv)
    _working_folder_importable()
    cmd = next(c for c in COMMANDS if c.name == args.command)
    return getattr(importlib.import_module(cmd.module), cmd.main)(args)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="job config TOML, or the name of a bundled job (opentinker/configs/<name>.toml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. train.steps=5")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint "
                   "(its config.toml, with any --set, e.g. train.steps=100 to train on)")
    p.add_argument("--scheduler", metavar="ADDRESS", help="run on a shared scheduler (opentinker serve): its bus "
                   "endpoint or service file, instead of starting one")
    p.add_argument("--run-dir", metavar="DIR", help="the run's folder, a new folder directly inside out_dir "
                   "(default: out_dir/<game>__<name>__<seed>__<time>)")


def games_main(args: argparse.Namespace) -> int:
    """``opentinker games``: each registered game, its kind and its scripted seats."""
    import games

    for name in games.names():
        doc = (sys.modules[type(games.make(name).unwrapped).__module__].__doc__ or "").strip().splitlines()
        hook = games.evaluation(name)
        seats = ", ".join(["random", *(s for s in hook.scripted if s != "random")])
        kind = "competitive" if hook.competitive else "cooperative"
        print(f"{name}: {doc[0] if doc else ''}\n    {kind}; scripted seats (opponents, eval --vs): {seats}")
    return 0


def run_main(args: argparse.Namespace) -> int:
    """``opentinker run``: the config read and checked whole (one line on a bad one), then the
    job run (one line and an exit code for each way it can stop)."""
    checked = _checked_config(args)
    if isinstance(checked, int):
        return checked
    return _run_checked(args, *checked)


def _checked_config(args: argparse.Namespace) -> tuple[Any, Any] | int:
    """``(config, checkpoint to resume from or None)``, or the exit code after one line."""
    from opentinker.config import ConfigError, load_config
    from opentinker.control.config_checks import check_config
    from opentinker.logs import escape_controls
    from opentinker.overrides import parse_overrides

    checkpoint = None  # with --resume: verified here, before anything starts, and handed on
    try:
        if args.resume and args.config:
            raise ConfigError("--resume", "continues a run with its own config.toml: give no CONFIG")
        if args.resume and args.run_dir:
            raise ConfigError("--run-dir", "a resumed run stays in its folder: give no --run-dir")
        config = f"{args.resume}/config.toml" if args.resume else args.config
        overrides = parse_overrides(args.set)
        if args.scheduler:
            overrides.setdefault("runtime", {})["scheduler"] = args.scheduler
        cfg = load_config(config, overrides)
        check_config(cfg)  # every field, before a run folder or an actor exists
        if cfg.offline_job() is not None:  # data with nothing to learn from: said before a run folder exists
            from opentinker.training.offline import training_units

            training_units(cfg)
        if args.run_dir:
            from pathlib import Path

            if not cfg.directly_in_out_dir(args.run_dir):
                raise ConfigError("--run-dir", f"{args.run_dir!r} is not a folder directly inside out_dir "
                                               f"{cfg.out_dir!r}")
            if Path(args.run_dir).exists():
                raise ConfigError("--run-dir", f"{args.run_dir!r} exists (continue a run with --resume)")
        if args.resume:
            from opentinker.control.checkpoints import (
                check_run_files,
                latest_checkpoint,
            )

            try:
                # A clear error before anything starts: a checkpoint that checks out, files that parse.
                checkpoint = latest_checkpoint(args.resume, cfg)
                check_run_files(args.resume, checkpoint.step)
            except (ValueError, OSError) as e:  # not a config's fault: the folder has nothing to go on from
                print(f"opentinker: cannot resume {escape_controls(args.resume)}: {escape_controls(str(e))}",
                      file=sys.stderr)
                return 2
    except (ValueError, OSError) as e:
        # One line whatever the config holds (its strings are quoted in the reasons).
        print(f"opentinker: bad config: {escape_controls(str(e))}", file=sys.stderr)
        return 2
    return cfg, checkpoint


def _run_checked(args: argparse.Namespace, cfg: Any, checkpoint: Any) -> int:
    """Run the checked job; each way it stops is one line and an exit code."""
    from pathlib import Path

    from opentinker.config import ConfigError
    from opentinker.control.component import ComponentDied
    from opentinker.interrupt import Interrupted
    from opentinker.logs import escape_controls
    from opentinker.run import run_job

    try:
        result = run_job(cfg, run_dir=Path(args.run_dir) if args.run_dir else None,
                         resume=Path(args.resume) if args.resume else None, checkpoint=checkpoint)
    except ConfigError as e:  # found on meeting the cluster or the shared scheduler (placement, attach)
        print(f"opentinker: bad config: {escape_controls(str(e))}", file=sys.stderr)
        return 2
    except Interrupted as e:  # Ctrl-C: one line, the shell's code for SIGINT
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late second Ctrl-C must not break the exit
        print(f"opentinker: {escape_controls(e.line())}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before the run's loop (starting the components): nothing to keep
        print("opentinker: stopped before the run started", file=sys.stderr)
        return 130
    except ComponentDied as e:
        # Every other component was stopped on the way out (run_job's finally); one line.
        where = getattr(e, "run_dir", "RUN_DIR")
        print(f"opentinker: {escape_controls(str(e))}: the run cannot go on; its folder keeps every "
              f"checkpoint written: continue with opentinker run --resume {escape_controls(where)}", file=sys.stderr)
        return 4
    except TimeoutError as e:
        # Every component was stopped on the way out (run_job's finally); say why in one line:
        # the first line of the original error (Ray wraps it in a remote traceback).
        cause = getattr(e, "cause", None)
        why = str(cause if isinstance(cause, BaseException) else e).strip().splitlines() or [type(e).__name__]
        print(f"opentinker: timed out: {escape_controls(why[0])} (runtime.timeout_s = "
              f"{cfg.runtime.timeout_s:g} s; the run folder keeps every checkpoint written: "
              "continue with --resume RUN_DIR)", file=sys.stderr)
        return 3
    if result.info.get("stopped"):  # an offline job's Ctrl-C: its adapter so far is saved, nothing to resume
        print(f"opentinker: stopped after step {result.info['steps']} of {result.info['of']}: the adapter "
              f"trained so far is saved in {escape_controls(str(result.info['adapter']))}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
