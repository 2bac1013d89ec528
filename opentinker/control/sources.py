"""What a PATH names for the commands that read saved adapters (``opentinker eval``, ``play``,
``infer``, and the service's queue, which runs them): a run folder (``config.toml`` and
``adapters/<policy>/``, or its newest checkpoint's adapters when the run stopped early) or one
saved adapter (:func:`read_source`); the base model they were trained on (:func:`base_model`);
copies of the adapters where a scheduler may read them (:func:`stage_adapters`); and a job
config that plays them (:func:`job_config`), checked whole. Errors are :class:`CliError`: one
line a command prints before it exits 2.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

import games
from opentinker.config import ConfigError, JobConfig, load_config, policy_name_ok
from opentinker.control.checkpoints import latest_checkpoint
from opentinker.control.config_checks import check_config

DEFAULT_MODEL = "smollm2-135m"
class CliError(Exception):
    """A one-line reason the command cannot start (exit 2)."""


@dataclass
class Source:
    """What a PATH names (``kind``: ``run`` or ``adapter``): player name (a valid policy name)
    -> saved adapter folder, in the run's policy order, and the run's config."""

    kind: str
    adapters: dict[str, Path]
    config: JobConfig | None = None


def player_name(raw: str, taken: set[str]) -> str:
    """A policy name for an adapter folder called ``raw``: an identifier none of the reserved
    names (``self``, ``base``, a scripted seat...) and not in ``taken`` (``_2``, ``_3``... added)."""
    name = re.sub(r"\W", "_", raw)[:56] or "adapter"
    if not policy_name_ok(name):
        name = f"a_{name}"
    out, k = name, 2
    while out in taken:
        out, k = f"{name}_{k}", k + 1
    taken.add(out)
    return out


def read_source(path: str, taken: set[str] | None = None) -> Source:
    """The adapters of ``path`` (see the module docstring); :class:`CliError` for a missing
    path, a folder that is neither a run nor a saved adapter, or a run without saved adapters."""
    taken = set() if taken is None else taken
    p = Path(path)
    if not p.exists():
        raise CliError(f"{path}: no such file or folder")
    if (p / "adapter_config.json").is_file():
        return Source(kind="adapter", adapters={player_name(p.resolve().name, taken): p})
    if not (p / "config.toml").is_file():
        raise CliError(f"{path}: neither a run folder (config.toml, adapters/) nor a saved adapter (adapter_config.json)")
    try:
        cfg = load_config(p / "config.toml")
    except (ValueError, OSError) as e:
        raise CliError(f"{p / 'config.toml'}: {e}") from None
    folder = p / "adapters"
    names = [q.name for q in cfg.policies]
    if not all((folder / n / "adapter_config.json").is_file() for n in names):
        try:
            folder = latest_checkpoint(p).adapters  # a run that stopped before its final save
        except (ValueError, OSError):
            raise CliError(f"{path}: the run has no saved adapters (adapters/<policy>/ or a checkpoint)") from None
    return Source(kind="run", adapters={player_name(n, taken): folder / n for n in names}, config=cfg)


def stage_adapters(adapters: dict[str, Path], root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Copy each adapter (less the files named in ``skip``) to ``root/<name>``: the scheduler
    reads adapters only inside its run folder. Returns name -> absolute copied path."""
    out = {}
    for name, src in adapters.items():
        shutil.copytree(src, root / name, ignore=shutil.ignore_patterns(*skip))
        out[name] = str((root / name).resolve())
    return out


def base_model(source: Source | None, override: str | None) -> str:
    """``--model``, else the run's model, else the base the adapter was saved on when that
    folder is here (``opentinker.json``), else :data:`DEFAULT_MODEL`."""
    if override:
        return override
    if source is not None and source.config is not None:
        return source.config.model.base
    if source is not None:
        meta = next(iter(source.adapters.values())) / "opentinker.json"
        try:
            saved = json.loads(meta.read_text()).get("base_model", "")
        except (OSError, ValueError):
            saved = ""
        if saved and (Path(saved) / "config.json").is_file():
            return saved
    return DEFAULT_MODEL


def check_game(game: str) -> games.GameEval:
    """The game's evaluation hook; :class:`CliError` naming an unknown game."""
    try:
        games.resolve(game)
        return games.evaluation(game)
    except ValueError as e:
        raise CliError(f"unknown game: {e}") from None


def source_game(source: Source, game: str | None, path: str) -> tuple[str, games.GameEval]:
    """The game an evaluation of ``path`` plays, ``game`` or else its run's, and its evaluation
    hook; :class:`CliError` for a saved adapter without ``game``, or a game not registered."""
    if source.kind == "adapter" and not game:
        raise CliError(f"{path} is a saved adapter: name its game with --game")
    game = game or source.config.game  # type: ignore[union-attr]
    return game, check_game(game)


def job_config(source: Source | None, game: str, model: str, seed: int | None, threads: int | None,
               device: str | None, out_dir: str, backend: str = "local", scheduler: str = "",
               timeout_s: float | None = None, **tables: Any) -> JobConfig:
    """A job on ``game`` with the run's game kwargs, system prompt, model and sampling settings
    when ``source`` is a run of that game, the defaults otherwise; ``tables`` replace
    top-level fields (``policies``, ``eval``...); ``scheduler``: a shared scheduler to run on
    (never the one the run used, which may be gone); ``timeout_s``: the longest wait for one
    request (``runtime.timeout_s``; None: the run's, else the default). Checked whole
    (``check_config``)."""
    run = source.config if source is not None else None
    raw: dict[str, Any] = {"name": "eval", "game": game, "out_dir": out_dir}
    if run is not None:
        raw.update(model=msgspec.to_builtins(run.model), sampling=msgspec.to_builtins(run.sampling),
                   runtime=msgspec.to_builtins(run.runtime), seed=run.seed)
        if run.game == game:
            raw.update(game_kwargs=dict(run.game_kwargs), system_prompt=run.system_prompt)
    raw.setdefault("model", {})["base"] = model
    raw["model"].update({k: v for k, v in (("threads", threads), ("device", device)) if v is not None})
    raw.setdefault("runtime", {}).update(backend=backend, scheduler=scheduler)
    if timeout_s is not None:
        raw["runtime"]["timeout_s"] = timeout_s
    raw["train"] = {"steps": 0, "record_trajectories": False}
    raw.update({k: v for k, v in (("seed", seed),) if v is not None}, **tables)
    try:
        cfg = msgspec.convert(raw, JobConfig)
        check_config(cfg)
    except (msgspec.ValidationError, ConfigError, ValueError, OSError) as e:
        raise CliError(f"bad settings: {e}") from None
    return cfg
