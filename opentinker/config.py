"""Typed job configuration, decoded from TOML with ``msgspec`` (an unknown or mistyped field
is an error that names it, e.g. ``Object contains unknown field `lrr` - at `$.train```).

Every field has a principled default, so an empty file is a valid job; derived values (the
number of hands per step, the run name) are computed in one place, not filled in later.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from protocols.messages import LoraSpec

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
Prob = Annotated[float, Meta(gt=0, le=1)]

SPECIAL_OPPONENTS = ("self", "base", "past")
"""Opponent names besides the scripted policies and the job's policies: the policy itself,
the base model, and a frozen past self from the league (:class:`LeagueConfig`)."""

CRITIC_ADVANTAGES = ("gae",)
"""Advantage estimators that need a learned critic (``learners.ADVANTAGES[name].needs_values``;
a test keeps the two in agreement, so this module needs no torch import)."""


class _Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class ModelConfig(_Config):
    base: str = "smollm2-135m"
    """Model spec: ``smollm2-135m`` (default), ``tiny-random`` (tests), a hub id or a folder."""
    device: str = "cpu"
    """Torch device of the scheduler (``cpu``, ``cuda``, ``cuda:1``)."""
    threads: NonNegInt = 0
    """Torch threads of the scheduler; 0: every core of the machine."""
    engine: Literal["auto", "own", "peft"] = "auto"
    """``auto``: the engine's own forward (continuous batching, prefix cache, batched LoRA)
    for the families it runs (Llama, SmolLM2, Qwen2, Qwen3), PEFT for the rest; ``own``:
    insist on it; ``peft``: whole-request batches through PEFT, no prefix reuse (a resumed run
    is bit-for-bit only on this path: the engine's rows share steps by arrival time)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The engine's base weights and activations (LoRA weights and optimizer states stay
    fp32). ``bfloat16`` is for GPUs; on a CPU it is slower than fp32 and log-probs move by
    ~0.03 (tests/test_engine_model.py states the tolerance)."""
    kv_budget_mb: PosInt = 256
    """Memory for the engine's KV blocks, in MiB."""
    kv_block_size: PosInt = 8
    """Tokens per KV block: a turn recomputes at most this many tokens it could have reused."""
    max_batch_tokens: PosInt = 2048
    """Tokens one engine step computes at most (prefill chunks + one per decoding row)."""


class PolicyConfig(_Config):
    name: str = "main"
    """Adapter name; one learner per policy."""
    opponents: dict[str, Annotated[float, Meta(ge=0)]] = msgspec.field(default_factory=lambda: {"random": 1.0})
    """Opponent mix: weight per ``self`` (the policy in both seats), ``base`` (the base model),
    ``past`` (a league snapshot of itself, :class:`LeagueConfig`), a scripted policy of
    ``games`` (``random``, ``kuhn_equilibrium``, ...) or another policy's name."""
    kind: Literal["lora", "full"] = "lora"
    """``lora``: an adapter on the shared base model; ``full``: a private copy of every base
    weight on the same scheduler, AdamW on all of them (LoRA and full-parameter training on
    the same job; needs ``model.engine`` other than ``peft``, and a learning rate near 1e-5)."""
    lora_rank: PosInt = 8
    lora_alpha: PosFloat = 16.0
    target_modules: list[str] = msgspec.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    train: dict[str, str | bool | int | float] = msgspec.field(default_factory=dict)
    """This policy's overrides of ``[train]``'s algorithm fields, e.g. ``{advantage = "rloo",
    loss = "cispo", kl_coef = 0.05}``: learners side by side in one job, on the same games
    and the same base model (the fields of ``SCHEDULE_FIELDS``, e.g. ``steps`` and
    ``groups_per_step``, are shared: overriding one is an error)."""


class TrainConfig(_Config):
    steps: NonNegInt = 30
    checkpoint_every: NonNegInt = 10
    """Write ``checkpoints/step_N/`` (adapters with their optimizer states, learner states,
    the evaluations so far) every this many steps and after the last; 0: only after the
    last. ``opentinker run --resume RUN_DIR`` continues from the newest one."""
    groups_per_step: PosInt = 8
    """Groups of episodes per policy per step; a group shares deal, seats and opponent."""
    group_size: PosInt = 4
    """Episodes per group (differing only in sampling seeds): advantages are group-relative."""
    advantage: str = "dr_grpo"
    """Advantage estimator, a name in ``learners.ADVANTAGES``: ``dr_grpo``, ``grpo``, ``rloo``
    (group-relative), ``reinforce_ema`` (moving-average baseline), ``role_ema`` (one baseline
    per game and seat, SPIRAL's RAE), ``turn_returns`` (per-turn discounted returns, turn-level
    credit), ``gae`` (GAE over turns with a learned critic: the policy's adapter gets a value
    head, trained with the value loss beside the policy loss: PPO with a critic)."""
    loss: str = "ppo"
    """Policy loss, a name in ``learners.LOSSES`` of kind policy: ``ppo``,
    ``importance_sampling``, ``cispo``."""
    clip_low: Annotated[float, Meta(ge=0)] = 0.2
    """PPO's lower clip ``1 - clip_low``."""
    clip_high: Annotated[float, Meta(ge=0)] = 0.2
    """PPO's upper clip ``1 + clip_high`` (DAPO's clip-higher when > ``clip_low``); also
    CISPO's ``eps_high`` (CISPO has no lower bound)."""
    dual_clip: Annotated[float, Meta(ge=0)] = 0.0
    """PPO's dual-clip bound ``c > 1`` on negative advantages; 0 disables."""
    is_truncation: PosFloat = 2.0
    """Truncation of the importance weight of ``importance_sampling``."""
    gamma: Annotated[float, Meta(ge=0, le=1)] = 1.0
    """Discount over a seat's turns (``turn_returns``, ``gae``)."""
    lam: Annotated[float, Meta(ge=0, le=1)] = 0.95
    """GAE's lambda (``gae``): 1 gives returns minus values, 0 the one-step TD error."""
    value_coef: Annotated[float, Meta(gt=0)] = 0.5
    """Coefficient of the critic's value loss (``gae``), a mean over turns, added to the
    policy loss (PPO's ``c1``)."""
    value_clip: Annotated[float, Meta(ge=0)] = 0.2
    """Clip range of the value loss around the values at scoring time (``gae``); 0 disables."""
    ema_decay: Annotated[float, Meta(ge=0, lt=1)] = 0.9
    """Decay of the moving-average baselines (``reinforce_ema``, ``role_ema``)."""
    kl_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Coefficient of the KL penalty to the reference (the base model with the adapter off);
    0 disables it (and its extra forward pass)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimator of that KL: loss ``kl_k1``, ``kl_k2`` or ``kl_k3``."""
    entropy_coef: Annotated[float, Meta(ge=0)] = 0.0
    """Coefficient of the entropy bonus (full-vocabulary entropy at the sampled positions)."""
    normalize_advantages: bool = False
    """Standardise each step's per-turn advantages over the batch (zero mean, unit std; PPO's
    usual normalisation, mostly redundant after GRPO's per-group one). Value targets are
    unaffected."""
    epochs: PosInt = 1
    """Passes over each step's batch (PPO's K epochs): later passes reuse the advantages and
    the sampler's log-probs, so their ratios move off 1 and clip. All the step's updates must
    fit in ``runtime.timeout_s``."""
    minibatches: PosInt = 1
    """Updates per pass: the step's datums are shuffled and split into this many parts (fewer
    when there are fewer datums), each one ``forward_backward`` + ``optim_step`` normalised by
    its own token count."""
    lr: PosFloat = 1e-3
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    grad_clip: Annotated[float, Meta(ge=0)] = 1.0
    """Global gradient-norm clip; 0 disables."""
    record_trajectories: bool = True
    """Write every training trajectory (token ids, masks, sampler log-probs, rewards, group,
    seed, seat) to ``<run>/trajectories/<policy>.jsonl``: data for offline SFT and DPO jobs."""

    def __post_init__(self) -> None:
        if self.dual_clip != 0 and not self.dual_clip > 1:
            raise ValueError(f"train.dual_clip: must be 0 (off) or > 1, got {self.dual_clip}")

    @property
    def critic(self) -> bool:
        """Whether this policy trains a critic (its estimator needs values): its adapter then
        has a value head and its loss a ``value`` term."""
        return self.advantage in CRITIC_ADVANTAGES

    def loss_config(self) -> dict[str, float]:
        """``ForwardBackward.loss_config`` of this policy: the policy loss's settings, each
        penalty's coefficient under the penalty's loss name (``kl_k3``, ``entropy``), and with
        a critic the value loss's (``value``, ``value_clip``)."""
        out = {"clip_low": self.clip_low, "clip_high": self.clip_high,
               "is_truncation": self.is_truncation, "eps_high": self.clip_high}
        if self.dual_clip:
            out["dual_clip"] = self.dual_clip
        if self.kl_coef:
            out[f"kl_{self.kl_estimator}"] = self.kl_coef
        if self.entropy_coef:
            out["entropy"] = self.entropy_coef
        if self.critic:
            out.update(value=self.value_coef, value_clip=self.value_clip)
        return out

    def advantage_config(self) -> dict[str, float]:
        """The advantage estimator's config (and ``normalize``, read by the assembly)."""
        out = {"gamma": self.gamma, "decay": self.ema_decay, "lam": self.lam}
        if self.normalize_advantages:
            out["normalize"] = 1.0
        return out


SNAPSHOT_SUFFIX = re.compile(r"__s\d+$")
"""League snapshots are named ``<policy>__s<step>``."""


def league_pool(cfg: JobConfig, policy: str, step: int) -> list[str]:
    """The league snapshots of ``policy`` that exist while step ``step`` plays, oldest first:
    those taken after steps ``snapshot_every``, ``2 * snapshot_every``, ... before ``step``,
    the ``keep`` newest of them."""
    every = cfg.league.snapshot_every
    if not every:
        return []
    return [f"{policy}__s{s}" for s in range(every, step, every)][-cfg.league.keep:]


SCHEDULE_FIELDS = ("steps", "checkpoint_every", "groups_per_step", "group_size", "record_trajectories")
"""``[train]`` fields that every policy shares (the others a policy may override)."""


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
    cross_play_per_stratum: NonNegInt = 10
    """A job with several policies: hands per (deal, seat) of every policy against every other
    one, at the first and last eval (the cross-play matrix); 0: none."""
    exploitability: bool = True


class RuntimeConfig(_Config):
    backend: Literal["ray", "local"] = "ray"
    env_runners: PosInt = 2
    timeout_s: PosFloat = 900.0
    """Longest wait for any one request (a training step, an evaluation batch)."""
    startup_timeout_s: PosFloat = 180.0


class OfflineConfig(_Config):
    """An offline job: train the first policy's adapter on trajectories a run recorded, through
    the scheduler, with the ``sft`` or a preference (``dpo``, ``ipo``) loss; no games are played."""

    kind: Literal["sft", "dpo", "ipo"]
    """``sft``: maximum likelihood on the sampled tokens of trajectories whose total reward is
    above ``min_reward`` (e.g. winning games); ``dpo`` / ``ipo``: pairs of trajectories from the
    same start (group, seed, seat) with different rewards, the higher one chosen."""
    data: str
    """A ``trajectories/<policy>.jsonl`` file of a run, or a folder of such files."""
    steps: PosInt = 20
    batch_size: PosInt = 16
    """Sequences (``sft``) or pairs (``dpo``, ``ipo``) per step, cycling through the data in an
    order shuffled from the job's seed."""
    min_reward: float = 0.0
    """``sft`` keeps trajectories whose total reward is strictly above this."""
    beta: PosFloat = 0.1
    """DPO's inverse temperature."""
    tau: PosFloat = 0.1
    """IPO's regularisation (target margin ``1 / (2 tau)``)."""


class LeagueConfig(_Config):
    """Past selves as opponents (fictitious self-play): every ``snapshot_every`` steps each
    policy's adapter is frozen on the scheduler as ``<policy>__s<step>``; the opponent
    ``past`` in a policy's mix is one of its ``keep`` newest snapshots, drawn uniformly (itself
    before the first snapshot). Which snapshots exist at a step follows from the config, so
    episodes stay a pure function of the config and the step, and ``--resume`` restores them."""

    snapshot_every: NonNegInt = 0
    """Freeze every policy after each this many steps; 0: no league."""
    keep: PosInt = 5
    """Snapshots per policy kept in the league (older ones are dropped from the scheduler)."""
    eval_per_stratum: NonNegInt = 0
    """Hands per (deal, seat) of every policy against each of its league snapshots at every
    evaluation (columns of the cross-play matrix); 0: none."""


class JobConfig(_Config):
    name: str = "default"
    seed: int = 0
    game: str = "kuhn_poker_v0"
    game_kwargs: dict[str, int | float | str | bool] = msgspec.field(default_factory=dict)
    """Keyword arguments of the game's ``env(...)``, e.g. ``{num_players = 4}`` for
    ``liars_dice_v0`` or ``{max_rounds = 5}`` for ``negotiation_v0``."""
    system_prompt: str = "You are a poker player."
    """The system message of every LLM seat (explicit: SmolLM2 injects its own otherwise)."""
    out_dir: str = "runs"
    model: ModelConfig = ModelConfig()
    policies: list[PolicyConfig] = msgspec.field(default_factory=lambda: [PolicyConfig()])
    train: TrainConfig = TrainConfig()
    sampling: SamplingConfig = SamplingConfig()
    eval: EvalConfig = EvalConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    league: LeagueConfig = LeagueConfig()
    offline: OfflineConfig | msgspec.UnsetType = msgspec.UNSET
    """Set (an ``[offline]`` table): an offline job instead of self-play training (unset, it
    is left out of the resolved TOML, which has no null)."""

    def __post_init__(self) -> None:
        names = [p.name for p in self.policies]
        if not self.policies:
            raise ValueError("policies: at least one trainable policy is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"policies: duplicate names in {names}")
        from games.scripted import SCRIPTED

        for p in self.policies:
            if (p.name in SPECIAL_OPPONENTS or p.name in SCRIPTED or p.name == "league" or not p.name.isidentifier()
                    or SNAPSHOT_SUFFIX.search(p.name)):
                raise ValueError(f"policies.name {p.name!r}: must be an identifier other than self, base, past, league and "
                                 f"the scripted policies ({', '.join(sorted(SCRIPTED))}), not ending in __s<digits>")
            if not p.opponents or sum(p.opponents.values()) <= 0:
                raise ValueError(f"policies[{p.name}].opponents: needs a positive weight")
            for o in p.opponents:
                if o not in SPECIAL_OPPONENTS and o not in SCRIPTED and o not in names:
                    raise ValueError(f"policies[{p.name}].opponents: {o!r} is none of self, base, past, a scripted "
                                     f"policy ({', '.join(sorted(SCRIPTED))}) or a policy of this job ({', '.join(names)})")
            if p.opponents.get("past", 0) > 0 and not self.league.snapshot_every:
                raise ValueError(f"policies[{p.name}].opponents: 'past' needs a league (league.snapshot_every > 0)")
        if self.league.eval_per_stratum and not self.league.snapshot_every:
            raise ValueError("league.eval_per_stratum: evaluates against league snapshots, and there are none "
                             "(league.snapshot_every = 0)")
        if not self.system_prompt:
            raise ValueError("system_prompt: must be non-empty (SmolLM2 injects its own otherwise)")
        for p in self.policies:
            self.train_for(p.name)

    def offline_job(self) -> OfflineConfig | None:
        """The ``[offline]`` table, or ``None`` for a self-play job."""
        return self.offline if isinstance(self.offline, OfflineConfig) else None

    def train_for(self, policy: str) -> TrainConfig:
        """``[train]`` with ``policy``'s overrides applied (``ValueError`` naming a bad one)."""
        (p,) = [p for p in self.policies if p.name == policy]
        if not p.train:
            return self.train
        where = f"policies[{p.name}].train"
        shared = sorted(set(p.train) & set(SCHEDULE_FIELDS))
        if shared:
            raise ValueError(f"{where}: {shared} are shared by every policy; set them in [train]")
        try:
            return msgspec.convert({**msgspec.to_builtins(self.train), **p.train}, TrainConfig)
        except msgspec.ValidationError as e:
            raise ValueError(f"{where}: {e}") from None

    def lora_spec(self, policy: str) -> LoraSpec:
        """The ``LoraSpec`` of ``policy``'s adapter: its LoRA settings, seeded from the job's
        seed, with a value head when the policy trains a critic (:attr:`TrainConfig.critic`)."""
        (p,) = [p for p in self.policies if p.name == policy]
        return LoraSpec(rank=p.lora_rank, alpha=p.lora_alpha, target_modules=tuple(p.target_modules),
                        seed=self.seed, value_head=self.train_for(policy).critic, full=p.kind == "full")

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
