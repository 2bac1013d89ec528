"""Typed job configuration, decoded from TOML with ``msgspec`` (an unknown or mistyped field
is an error that names it, e.g. ``Object contains unknown field `lr` - at `$.train```).

Every field has a principled default, so an empty file is a valid job; derived values (the
number of hands per step, the run name) are computed in one place, not filled in later.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
Prob = Annotated[float, Meta(gt=0, le=1)]

SPECIAL_OPPONENTS = ("self", "base")


class _Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class ModelConfig(_Config):
    base: str = "smollm2-135m"
    """Model spec: ``smollm2-135m`` (default), ``tiny-random`` (tests), a hub id or a folder."""
    device: str = "cpu"
    """Torch device of the scheduler (``cpu``, ``cuda``, ``cuda:1``)."""
    threads: NonNegInt = 0
    """Torch threads of the scheduler; 0: every core of the machine."""


class PolicyConfig(_Config):
    name: str = "main"
    """Adapter name; one learner per policy."""
    opponents: dict[str, Annotated[float, Meta(ge=0)]] = msgspec.field(default_factory=lambda: {"random": 1.0})
    """Opponent mix: weight per ``self`` (the policy in both seats), ``base`` (the base model),
    a scripted policy of ``games`` (``random``, ``kuhn_equilibrium``) or another policy's name."""
    lora_rank: PosInt = 8
    lora_alpha: PosFloat = 16.0
    target_modules: list[str] = msgspec.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class TrainConfig(_Config):
    steps: NonNegInt = 30
    groups_per_step: PosInt = 8
    """Groups of episodes per policy per step; a group shares deal, seats and opponent."""
    group_size: PosInt = 4
    """Episodes per group (differing only in sampling seeds): advantages are group-relative."""
    advantage: str = "dr_grpo"
    """Group estimator, a name in ``learners.ADVANTAGES`` (``dr_grpo``, ``grpo``, ``rloo``)."""
    loss: str = "ppo"
    """Policy-gradient loss, a name in ``learners.LOSSES`` (``ppo``, ``importance_sampling``, ``cispo``)."""
    clip_low: Annotated[float, Meta(ge=0)] = 0.2
    clip_high: Annotated[float, Meta(ge=0)] = 0.2
    lr: PosFloat = 1e-3
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    grad_clip: Annotated[float, Meta(ge=0)] = 1.0
    """Global gradient-norm clip; 0 disables."""


class SamplingConfig(_Config):
    temperature: PosFloat = 1.0
    top_p: Prob = 1.0
    top_k: NonNegInt = 0
    max_tokens: PosInt = 8


class EvalConfig(_Config):
    every: NonNegInt = 10
    """Evaluate every this many steps (and always before the first and after the last); 0:
    only before and after."""
    hands_per_stratum: PosInt = 34
    """Hands against the random opponent per (deal, seat): 6 deals x 2 seats x 34 = 408."""
    final_hands_per_stratum: NonNegInt = 0
    """Hands per stratum for the evaluations before the first and after the last step; 0:
    ``hands_per_stratum``."""
    head_to_head_per_stratum: NonNegInt = 10
    """Hands per (deal, seat) against the untrained base model, at the first and last eval."""
    exploitability: bool = True


class RuntimeConfig(_Config):
    backend: Literal["ray", "local"] = "ray"
    env_runners: PosInt = 2
    timeout_s: PosFloat = 900.0
    """Longest wait for any one request (a training step, an evaluation batch)."""
    startup_timeout_s: PosFloat = 180.0


class JobConfig(_Config):
    name: str = "default"
    seed: int = 0
    game: str = "kuhn_poker_v0"
    system_prompt: str = "You are a poker player."
    """The system message of every LLM seat (explicit: SmolLM2 injects its own otherwise)."""
    out_dir: str = "runs"
    model: ModelConfig = ModelConfig()
    policies: list[PolicyConfig] = msgspec.field(default_factory=lambda: [PolicyConfig()])
    train: TrainConfig = TrainConfig()
    sampling: SamplingConfig = SamplingConfig()
    eval: EvalConfig = EvalConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    def __post_init__(self) -> None:
        names = [p.name for p in self.policies]
        if not self.policies:
            raise ValueError("policies: at least one trainable policy is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"policies: duplicate names in {names}")
        for p in self.policies:
            if p.name in SPECIAL_OPPONENTS or not p.name.isidentifier():
                raise ValueError(f"policies.name {p.name!r}: must be an identifier other than self/base")
            if not p.opponents or sum(p.opponents.values()) <= 0:
                raise ValueError(f"policies[{p.name}].opponents: needs a positive weight")
        if not self.system_prompt:
            raise ValueError("system_prompt: must be non-empty (SmolLM2 injects its own otherwise)")

    def run_name(self) -> str:
        """``{game}__{name}__{seed}__{time}``, as CleanRL names runs."""
        return f"{self.game}__{self.name}__{self.seed}__{time.strftime('%Y%m%d-%H%M%S')}"


BUNDLED = Path(__file__).parent / "configs"


def bundled_configs() -> list[str]:
    """Names of the job configs shipped with the package (``opentinker run NAME``)."""
    return sorted(p.stem for p in BUNDLED.glob("*.toml"))


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> JobConfig:
    """Decode a TOML job file (``None``: the bundled default job; a bare name such as
    ``tictactoe``: a bundled job), then apply overrides (a nested dict) and validate again.
    Raises ``ValueError`` naming a bad field."""
    if path is None:
        path = "default"
    path = Path(path)
    if not path.is_file() and path.suffix == "" and (BUNDLED / f"{path}.toml").is_file():
        path = BUNDLED / f"{path}.toml"
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist (bundled jobs: {bundled_configs()})")
    try:
        cfg = msgspec.toml.decode(path.read_bytes(), type=JobConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    if overrides:
        raw = msgspec.to_builtins(cfg)
        _merge(raw, overrides)
        try:
            cfg = msgspec.convert(raw, JobConfig)
        except msgspec.ValidationError as e:
            raise ValueError(f"override: {e}") from None
    return cfg


def _merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def to_toml(cfg: JobConfig) -> bytes:
    """The resolved config as TOML (written beside a run's results)."""
    return msgspec.toml.encode(cfg)
