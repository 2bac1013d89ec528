"""``opentinker`` command line: ``opentinker run [CONFIG.toml] [--set key=value ...]``."""

from __future__ import annotations

import argparse
import json
import sys


def _parse_set(items: list[str]) -> dict:
    """``["train.steps=3", "runtime.backend=local"]`` -> nested dict (values parsed as JSON
    where they parse, else kept as strings)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opentinker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job (no config: the bundled default job)")
    run.add_argument("config", nargs="?", help="job config TOML, or the name of a bundled job (default, tictactoe)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. train.steps=5")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest checkpoint "
                     "(its config.toml, with any --set, e.g. train.steps=100 to train on)")
    sub.add_parser("games", help="list the registered games")
    args = parser.parse_args(argv)

    if args.command == "games":
        import games

        for name in games.names():
            doc = (sys.modules[type(games.make(name).unwrapped).__module__].__doc__ or "").strip().splitlines()
            print(f"{name}: {doc[0] if doc else ''}")
        return 0

    from opentinker.config import load_config
    from opentinker.training.learner import check_job

    try:
        if args.resume and args.config:
            raise ValueError("--resume continues a run with its own config.toml: give no CONFIG")
        config = f"{args.resume}/config.toml" if args.resume else args.config
        cfg = load_config(config, _parse_set(args.set))
        if cfg.offline_job() is None:
            check_job(cfg)
        if args.resume:
            from opentinker.control.checkpoints import latest_checkpoint

            latest_checkpoint(args.resume)  # a clear error before anything starts
    except (ValueError, FileNotFoundError) as e:
        print(f"opentinker: bad config: {e}", file=sys.stderr)
        return 2
    from pathlib import Path

    from opentinker.run import run_job

    run_job(cfg, resume=Path(args.resume) if args.resume else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
