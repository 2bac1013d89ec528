"""The checks a job config gets before anything starts (:func:`check_config`): everything that
needs no model loaded and no component started, so a run that cannot work fails with
``opentinker: bad config: <field>: <reason>`` and leaves no run folder. Decoding
(:func:`opentinker.config.load_config`) has already checked types and ranges."""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from opentinker.config import (
    MAX_CONFIG_BYTES,
    ConfigError,
    JobConfig,
    _has_controls,
    _kwarg_field,
)

if TYPE_CHECKING:
    from games.evaluation import GameEval

KNOWN_MODELS: dict[str, tuple[str, int]] = {"smollm2-135m": ("llama", 8192), "tiny-random": ("llama", 2048)}
"""Model specs built on this machine (``opentinker.engine.model_specs``) -> (``model_type``,
``max_position_embeddings``) of the folder they build (a test keeps these current)."""

ENGINE_FAMILIES = ("llama", "qwen2", "qwen3")
"""``model_type`` of the architectures the engine's own forward runs
(``opentinker.engine.model.config.SUPPORTED``; a test keeps the two equal, so this module needs
no torch import)."""

ENGINE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections the engine's LoRA adapts (``opentinker.engine.model.lora_weights.MODULES``; a test
keeps the two equal)."""

PEFT_EXTRA_MODULES = ("lm_head", "embed_tokens")
"""Further modules of those architectures that PEFT (``model.engine = "peft"``) can adapt."""

_DEVICE = re.compile(r"cpu|cuda(?::(?P<index>\d{1,4}))?")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(?:/[A-Za-z0-9][\w.-]{0,95})?")
_MODULE = re.compile(r"[A-Za-z_][\w.]{0,127}")
_OFF = ("1", "true", "yes", "on")


class ModelInfo(msgspec.Struct, frozen=True):
    """What :func:`check_model` learned about a model spec without loading the model."""

    family: str | None = None
    """The ``model_type`` of its ``config.json`` (``llama``, ``qwen2``, ...); ``None``: unknown
    (a hub id not in the local cache)."""
    context: int | None = None
    """Its ``max_position_embeddings``, where known."""


def _check_scheduler(address: str) -> None:
    """A shared scheduler's address: a service that answers for it (its service file read;
    whether it still runs is known when the job opens there)."""
    from opentinker.control.attach import find_service

    try:
        find_service(address)
    except ValueError as e:
        raise ConfigError("runtime.scheduler", str(e).removeprefix(f"--scheduler {address}: ")) from None


_RAY_ADDRESS = re.compile(r"auto|(?:ray://)?(?P<host>[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):(?P<port>\d{1,5})")


def _check_cluster(cfg: JobConfig) -> None:
    """``runtime.address`` is a Ray address (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``) a
    Ray job can join, and ``runtime.curve`` has a libzmq that speaks CURVE."""
    rt = cfg.runtime
    if rt.address:
        m = _RAY_ADDRESS.fullmatch(rt.address)
        if m is None or (m["port"] is not None and not 0 < int(m["port"]) < 65536):
            raise ConfigError("runtime.address", f"{rt.address!r:.80} is not a Ray address (auto, HOST:PORT or "
                                                 "ray://HOST:PORT)")
        if rt.backend != "ray":
            raise ConfigError("runtime.address", 'a cluster needs runtime.backend = "ray"')
        if rt.scheduler:
            raise ConfigError("runtime.address", "a shared scheduler (runtime.scheduler) is reachable from its own "
                                                 "machine only: leave one of the two empty")
    reserved = [k for k in rt.scheduler_resources if k in ("memory", "object_store_memory") or ":" in k]
    if reserved:
        raise ConfigError("runtime.scheduler_resources", f"{reserved[0]!r} is not a resource an actor can ask for "
                                                         "(CPU, GPU, or a custom resource a node was started with)")
    if rt.scheduler_resources and (rt.backend != "ray" or rt.scheduler):
        raise ConfigError("runtime.scheduler_resources", "places the job's own scheduler on a Ray node: it needs "
                          'runtime.backend = "ray" and no shared scheduler (runtime.scheduler)')
    if rt.address or rt.curve:
        import zmq

        if not zmq.has("curve"):
            raise ConfigError("runtime.address" if rt.address else "runtime.curve",
                              "this machine's libzmq was built without CURVE")


def check_config(cfg: JobConfig) -> None:
    """Every check that needs no model loaded and no component started, in the order of their
    cost; raises :class:`ConfigError` (``<field>: <reason>``) for the first field that cannot
    work. ``opentinker run`` and :func:`opentinker.run.run_job` call it before the run folder
    or any actor exists (the decoding in :func:`load_config` has checked types and ranges)."""
    _check_game(cfg)
    _check_out_dir(cfg.out_dir)
    cfg.run_dir()  # neither the name nor the game can lead the run folder out of out_dir
    oc = cfg.offline_job()
    if oc is not None and oc.data and not Path(oc.data).exists():
        raise ConfigError("offline.data", f"{oc.data!r}: no such file or folder")
    info = check_model(cfg.model.base)
    _check_cluster(cfg)
    if cfg.runtime.scheduler:
        _check_scheduler(cfg.runtime.scheduler)
    else:  # on a shared scheduler the service chose its device
        _check_device(cfg.model.device, cfg.runtime.backend, cfg.runtime.address)
    _check_modules(cfg, info)
    if info.context is not None and cfg.sampling.max_tokens >= info.context:
        raise ConfigError("sampling.max_tokens", f"{cfg.sampling.max_tokens} leaves no room for a prompt in the "
                                                 f"model's context of {info.context} tokens")
    for p in cfg.policies:
        if p.init:
            _check_init(cfg, p.name, p.init)
    if oc is None:
        from opentinker.training.learner import check_algorithms  # imports torch: last

        for p in cfg.policies:
            tc = cfg.train_for(p.name)
            try:
                check_algorithms(tc.advantage, tc.loss, f"policies[{p.name}].train" if p.train else "train")
            except ValueError as e:  # "<field> <value> is not ...": the field is the first word
                field, _, reason = str(e).partition(" ")
                raise ConfigError(field, reason) from None


def _check_out_dir(out_dir: str) -> None:
    """``out_dir`` is a folder, or can be made: its nearest existing ancestor is a folder this
    user may write in."""
    path = Path(out_dir).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError("out_dir", f"{out_dir!r} exists and is not a folder")
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:  # ends at the root
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError("out_dir", f"{str(ancestor)!r} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError("out_dir", f"cannot make folders in {str(ancestor)!r} (permission denied)")


def _check_game(cfg: JobConfig) -> None:
    """``game`` is registered or an importable PettingZoo env, its constructor takes every key
    of ``game_kwargs`` and accepts their values (the game is made once, which builds no model
    and starts nothing), and every scripted opponent plays it (its evaluation hook)."""
    import inspect

    import games

    game, kwargs = cfg.game, cfg.game_kwargs
    try:
        games.resolve(game)
    except ValueError as e:
        raise ConfigError("game", str(e)) from None
    if game in games.names():  # a registered game names what it takes
        params = inspect.signature(type(games.make(game).unwrapped).__init__).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            takes = [p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            for key in kwargs:
                if key not in takes:
                    raise ConfigError(_kwarg_field(key), f"{game} takes no {key!r}; it takes {', '.join(takes) or 'none'}")
    try:
        games.make(game, **kwargs).close()
    except Exception as e:  # noqa: BLE001  (a game's own check of its arguments, whatever it raises)
        raise ConfigError("game_kwargs", f"{game} refuses {kwargs}: {e}") from None
    hook = games.evaluation(game)
    plays = {"random", *hook.scripted}
    if hook.exploiter() is None:
        for p in cfg.policies:
            if p.opponents.get("best_response", 0) > 0:
                raise ConfigError(f"policies[{p.name}].opponents", f"best_response: {game}'s evaluation hook gives no "
                                                                   "best response (no exact exploiter)")
    for p in cfg.policies:
        if cfg.train_for(p.name).all_actions > 0:
            if hook.with_payoff() is None:
                raise ConfigError(f"policies[{p.name}].train.all_actions" if "all_actions" in p.train
                                  else "train.all_actions", f"{game}'s evaluation hook gives no exact payoff")
            known = {"best_response", "random", "self", "past", *(q.name for q in cfg.policies)}
            for o in sorted(set(p.opponents) - known):
                raise ConfigError(f"policies[{p.name}].opponents", f"{o!r}: the all-actions gradient needs each "
                                  f"opponent's action probabilities, known only for {', '.join(sorted(known))}")
        if cfg.train_for(p.name).advantage == "exact_gae":
            _check_exact_gae(cfg, p.name, hook)
        if cfg.train_for(p.name).move_values > 0:
            _check_move_values(cfg, p.name, hook)
        for o in sorted(p.opponents):
            if o in games.SCRIPTED and o not in plays:
                raise ConfigError(f"policies[{p.name}].opponents",
                                  f"the scripted policy {o!r} does not play {game}; the ones that do: {', '.join(sorted(plays))}")


def _check_exact_gae(cfg: JobConfig, policy: str, hook: GameEval) -> None:
    """A policy trained with ``exact_gae`` plays only opponents the game values its states
    against (``GameEval.state_values``): its own opponents, and no other policy draws it (by
    name, or as ``past`` from a pool of every policy); its discount is 1, as the values are."""
    p = next(q for q in cfg.policies if q.name == policy)
    field = f"policies[{policy}].train.advantage" if "advantage" in p.train else "train.advantage"
    values = hook.state_values
    if values is None:
        raise ConfigError(field, f"exact_gae: {cfg.game}'s evaluation hook gives no exact state values")
    for o in sorted(o for o, w in p.opponents.items() if w > 0 and o not in values.opponents):
        raise ConfigError(field, f"exact_gae: {cfg.game} values states against {', '.join(values.opponents)} only, "
                                 f"and the policy also plays {o!r}")
    for q in cfg.policies:
        if q.name != policy and (q.opponents.get(policy, 0) > 0
                                 or (q.opponents.get("past", 0) > 0 and cfg.league.pool == "all")):
            raise ConfigError(field, f"exact_gae: policy {q.name!r} plays {policy!r}, whose states "
                                     f"{cfg.game} does not value against another policy")
    if cfg.train_for(policy).gamma != 1.0:
        raise ConfigError(field, f"exact_gae: the game's values are undiscounted; train.gamma must be 1, "
                                 f"not {cfg.train_for(policy).gamma:g}")


def _check_move_values(cfg: JobConfig, policy: str, hook: GameEval) -> None:
    """A policy trained with ``move_values`` plays a game that values each legal move
    (``StateValues.moves``) against at least one of its opponents (the decisions of its other
    games add nothing to the term), and not with the all-actions term (whose datums carry no
    moves); ``move_values_against`` names only opponents the game values moves against."""
    p = next(q for q in cfg.policies if q.name == policy)
    field = f"policies[{policy}].train.move_values" if "move_values" in p.train else "train.move_values"
    values = hook.state_values
    if values is None or values.moves is None:
        raise ConfigError(field, f"{cfg.game}'s evaluation hook gives no exact values of moves (StateValues.moves)")
    if not any(w > 0 and o in values.opponents for o, w in p.opponents.items()):
        raise ConfigError(field, f"{cfg.game} values moves against {', '.join(values.opponents)} only, and the "
                                 f"policy plays none of them")
    if cfg.train_for(policy).all_actions > 0:
        raise ConfigError(field, "not with train.all_actions (its datums have no moves); use one or the other")
    for o in sorted(set(cfg.train_for(policy).move_values_against) - set(values.opponents)):
        raise ConfigError("train.move_values_against", f"{o!r}: {cfg.game} values moves against "
                                                       f"{', '.join(values.opponents)} only")


def _check_init(cfg: JobConfig, policy: str, init: str) -> None:
    """A warm start's folder is a saved adapter whose LoRA settings are the policy's."""
    field = f"policies[{policy}].init"
    meta = Path(init) / "opentinker.json"
    if not Path(init).is_dir():
        raise ConfigError(field, f"{init!r}: no such folder")
    if not meta.is_file():
        raise ConfigError(field, f"{init!r} is not a saved adapter (no opentinker.json): give adapters/<policy> "
                                 "of a run or a checkpoint")
    try:
        saved = msgspec.json.decode(meta.read_bytes())["spec"]
    except (msgspec.DecodeError, KeyError, TypeError) as e:
        raise ConfigError(field, f"{meta} is corrupt: {e}") from None
    want = msgspec.json.decode(msgspec.json.encode(cfg.lora_spec(policy)))  # JSON builtins, as the file has it
    if want["value_head"] and not saved.get("value_head"):
        raise ConfigError(field, f"policy {policy} trains a critic (train.advantage = "
                                 f"{cfg.train_for(policy).advantage!r}) and the saved adapter has no value head to "
                                 "start it from; warm-start a learner without a critic")
    differ = [f"{k} {saved.get(k)!r} (this job: {want[k]!r})" for k in ("rank", "alpha", "target_modules", "value_head", "full")
              if saved.get(k) != want[k]]
    if differ:
        raise ConfigError(field, f"the saved adapter has {', '.join(differ)}; set the policy's LoRA settings to match")


def check_model(spec: str) -> ModelInfo:
    """Check that the model spec ``model.base`` resolves on this machine, without loading it
    and without the network: a known spec (:data:`KNOWN_MODELS`, its package installed), a
    folder with a ``config.json``, or a well-formed hub id. Anything that looks like a path
    (absolute, ``./``, ``~``, two or more ``/``, or a first component that is a local folder)
    must exist: it is never looked up on the hub. A hub id is read from the local Hugging Face
    cache when it is there (and must be, with ``HF_HUB_OFFLINE`` set).

    Returns what the spec's ``config.json`` says, where it is at hand; raises
    :class:`ConfigError` on ``model.base``."""
    field = "model.base"
    if not spec.strip():
        raise ConfigError(field, "empty: give smollm2-135m, tiny-random, a model folder or a hub id (org/name)")
    if _has_controls(spec):
        raise ConfigError(field, f"{spec!r} has control characters")
    if spec in KNOWN_MODELS:
        from opentinker.engine.model_specs import gguf_path  # no torch

        try:
            gguf_path()
        except FileNotFoundError as e:
            raise ConfigError(field, f"{spec!r}: {e}") from None
        family, context = KNOWN_MODELS[spec]
        return ModelInfo(family, context)
    path = Path(spec)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(field, f"{spec!r} is a file; give the model's folder (with its config.json)")
        return _read_model_config(path / "config.json", spec)
    first = spec.split("/", 1)[0]
    if (spec.startswith(("/", "./", "../", "~")) or spec in (".", "..") or "\\" in spec or spec.count("/") > 1
            or ("/" in spec and Path(first).is_dir())):
        hint = " ('~' is not expanded)" if spec.startswith("~") else ""
        raise ConfigError(field, f"{spec!r}: no such folder{hint} (a path is never looked up on the Hugging Face hub)")
    if not _HUB_ID.fullmatch(spec) or "--" in spec or ".." in spec:
        raise ConfigError(field, f"{spec!r} is none of smollm2-135m, tiny-random, a model folder or a hub id (org/name)")
    close = difflib.get_close_matches(spec, list(KNOWN_MODELS), n=1, cutoff=0.75)
    if "/" not in spec and close:
        raise ConfigError(field, f"{spec!r} is not a known model spec: did you mean {close[0]!r}?")
    cached = _hub_cache_config(spec)
    if cached is not None:
        return _read_model_config(cached, spec)
    if any(os.environ.get(v, "").lower() in _OFF for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        raise ConfigError(field, f"{spec!r} is not in the local Hugging Face cache, and HF_HUB_OFFLINE is set")
    return ModelInfo()


def _hub_cache_config(repo_id: str) -> Path | None:
    """The cached ``config.json`` of a hub model, if the local cache has one (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001  (no huggingface_hub, an id it refuses: nothing known)
        return None
    return Path(found) if isinstance(found, str) else None


def _read_model_config(path: Path, spec: str) -> ModelInfo:
    """``model_type`` and ``max_position_embeddings`` of a model's ``config.json``."""
    field = "model.base"
    if not path.is_file():
        raise ConfigError(field, f"{spec!r} has no config.json (not a Hugging Face model folder)")
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(field, f"{str(path)!r} is larger than {MAX_CONFIG_BYTES} bytes")
        config = json.loads(path.read_bytes())
    except OSError as e:
        raise ConfigError(field, f"cannot read {str(path)!r}: {e.strerror or e}") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise ConfigError(field, f"{str(path)!r} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(field, f"{str(path)!r} is not a JSON object")
    family = config.get("model_type")
    context = config.get("max_position_embeddings")
    return ModelInfo(family if isinstance(family, str) else None,
                     context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None)


def _check_device(device: str, backend: str, address: str) -> None:
    """``cpu``, ``cuda`` or ``cuda:<index>``; a CUDA device must exist here when the job runs
    on this machine (the local backend, or Ray without ``runtime.address``: a cluster's GPUs
    are not this machine's)."""
    m = _DEVICE.fullmatch(device)
    if m is None:
        raise ConfigError("model.device", f"{device!r} is not a device: use cpu, cuda or cuda:<index>")
    if device == "cpu" or (backend == "ray" and address):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(m["index"] or 0)
    if index >= count:
        raise ConfigError("model.device", f"{device!r}: this machine has {count} CUDA device(s)")


def _check_modules(cfg: JobConfig, info: ModelInfo) -> None:
    """LoRA target modules are names, and (where the architecture is known) modules it has
    that the path the job takes can adapt: the engine's projections (:data:`ENGINE_MODULES`),
    or with ``model.engine = "peft"`` those and :data:`PEFT_EXTRA_MODULES`. Also the engine
    choice against the architecture, and full-parameter policies against the engine."""
    engine, family = cfg.model.engine, info.family
    if engine == "own" and family is not None and family not in ENGINE_FAMILIES:
        raise ConfigError("model.engine", f"'own' runs {', '.join(ENGINE_FAMILIES)}; this model is {family!r} "
                                          "(use auto or peft)")
    for p in cfg.policies:
        where = f"policies[{p.name}]"
        if p.kind == "full":
            if engine == "peft":
                raise ConfigError(f"{where}.kind", "'full' needs the engine's own forward (model.engine = auto or own)")
            continue
        if not p.target_modules:
            raise ConfigError(f"{where}.target_modules", "empty: name at least one projection, e.g. q_proj")
        for module in p.target_modules:
            if not _MODULE.fullmatch(module):
                raise ConfigError(f"{where}.target_modules", f"{module!r} is not a module name")
        if family not in ENGINE_FAMILIES:
            continue  # an architecture we do not know: PEFT will say
        if engine == "peft":
            allowed = ENGINE_MODULES + PEFT_EXTRA_MODULES
            bad = [m for m in p.target_modules if m.rsplit(".", 1)[-1] not in allowed]
        else:
            allowed = ENGINE_MODULES
            bad = [m for m in p.target_modules if m not in allowed]
        if bad:
            extra = "" if engine == "peft" else f" (with model.engine = peft also {', '.join(PEFT_EXTRA_MODULES)})"
            raise ConfigError(f"{where}.target_modules", f"{family} has no {', '.join(map(repr, bad))} to adapt; "
                                                         f"it has {', '.join(allowed)}{extra}")
