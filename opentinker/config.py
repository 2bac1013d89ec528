"""Typed job configuration, decoded from TOML with ``msgspec``, and checked whole before
anything starts.

Every field has a principled default, so an empty file is a valid job; derived values (the
number of hands per step, the run name) are computed in one place, not filled in later.

A config is refused with a :class:`ConfigError` whose text is ``<field>: <reason>`` (``opentinker
run`` prints ``opentinker: bad config: <field>: <reason>`` and exits 2):

* when it is decoded (:func:`load_config`): unknown fields (``train.lrr: unknown field``),
  types, and ranges, every number with an upper bound (the ``MAX_*`` constants of
  :mod:`opentinker.config_limits`, each with its reason) so infinities and absurd sizes never
  reach the runtime; the job ``name`` is a safe path component (messages:
  :mod:`opentinker.config_errors`);
* by :func:`opentinker.control.config_checks.check_config`, before a run folder or an actor exists: the game is registered and
  takes ``game_kwargs``, the model spec resolves on this machine (a known spec, or a folder
  with a ``config.json``; a path that does not exist is refused, never looked up on the hub),
  the device, the LoRA target modules against the architecture, the algorithms, the offline
  data and ``out_dir``.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect
from msgspec import Meta

from opentinker.config_errors import ConfigError, config_error
from opentinker.config_limits import (
    MAX_GROUPS_PER_STEP, MAX_GROUP_SIZE, MAX_EPISODES_PER_STEP, MAX_POLICIES, MAX_LR,
    MAX_CLIP_HIGH, MAX_DUAL_CLIP, MIN_TEMPERATURE, MAX_TEMPERATURE, MAX_TOKENS, MAX_TOP_K,
    MAX_THREADS, MAX_KV_MB, MAX_BATCH_TOKENS, MAX_BLOCK_SIZE, MAX_ENV_RUNNERS, MAX_DEVICES,
    DEVICE_PATTERN, MAX_SEED, MAX_TEXT, MAX_ITEMS, MAX_KWARG_CHARS, MAX_DECISIONS, MAX_REWARD,
    Steps, PosSteps, Hands, PosHands, Coef, PosCoef, UnitFloat, Prob, Timeout, PathStr,
)
from opentinker.engine.spec_checks import MAX_LORA_RANK
from opentinker.files import name_problem
from opentinker.logs import escape_controls
from protocols.messages import LoraSpec


SPECIAL_OPPONENTS = ("self", "base", "past", "best_response")
"""Opponent names besides the scripted policies and the job's policies: the policy itself,
the base model, and a frozen past self from the league (:class:`LeagueConfig`)."""

CRITIC_ADVANTAGES = ("gae",)
"""Advantage estimators that need a learned critic (``learners.ADVANTAGES[name].needs_values``;
a test keeps the two in agreement, so this module needs no torch import)."""


class _Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class ModelConfig(_Config):
    base: PathStr = "smollm2-135m"
    """Model spec: ``smollm2-135m`` (default), ``tiny-random`` (tests), a hub id or a folder."""
    device: str = "cpu"
    """Torch device of the scheduler (``cpu``, ``cuda``, ``cuda:1``)."""
    threads: Annotated[int, Meta(ge=0, le=MAX_THREADS)] = 0
    """Torch threads of the scheduler; 0: every core of the machine."""
    engine: Literal["auto", "own", "peft"] = "auto"
    """``auto``: the engine's own forward (continuous batching, prefix cache, batched LoRA)
    for the families it runs (Llama, SmolLM2, Qwen2, Qwen3), PEFT for the rest; ``own``:
    insist on it; ``peft``: whole-request batches through PEFT, no prefix reuse (a resumed run
    is bit-for-bit only on this path: the engine's rows share steps by arrival time)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The engine's base weights and activations (LoRA weights and optimizer states stay
    fp32). ``bfloat16`` is for GPUs; log-probs move by ~0.03 (tests/test_engine_model.py
    states the tolerance). On a CPU without AMX it is slower than fp32; on one with AMX its
    matrix products are several times fp32's, yet whole jobs were no faster
    (``benchmarks/dtype.py``, ``benchmarks/results/dtype.json``)."""
    kv_budget_mb: Annotated[int, Meta(ge=1, le=MAX_KV_MB)] = 256
    """Memory for the engine's KV blocks, in MiB."""
    train_memory_mb: Annotated[int, Meta(ge=128, le=MAX_KV_MB)] = 1024
    """What one part of a learning step may hold in activations, in MiB: a step's datums are
    cut into parts of at most as many tokens as fit (from the model's shape,
    :func:`opentinker.engine.trainer.part_tokens`; a datum longer than that is a part alone),
    so its peak memory is set here, not by the number or length of its episodes. The
    gradient is the same however the datums are cut."""
    kv_block_size: Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)] = 8
    """Tokens per KV block: a turn recomputes at most this many tokens it could have reused."""
    max_batch_tokens: Annotated[int, Meta(ge=1, le=MAX_BATCH_TOKENS)] = 2048
    """Tokens one engine step computes at most (prefill chunks + one per decoding row)."""
    cuda_graphs: bool = True
    """On CUDA (with triton), replay the engine's decode steps from CUDA graphs captured per
    batch-size bucket; ``false`` runs every step eagerly (for debugging). No effect on CPU."""


class PolicyConfig(_Config):
    name: str = "main"
    """Adapter name; one learner per policy."""
    opponents: Annotated[dict[str, Coef], Meta(max_length=MAX_POLICIES + 64)] = msgspec.field(
        default_factory=lambda: {"random": 1.0})
    """Opponent mix: weight per ``self`` (the policy in both seats), ``base`` (the base model),
    ``past`` (a league snapshot of itself, :class:`LeagueConfig`), ``best_response`` (an exact
    best response to the policy as it is at each step, where the game's evaluation hook gives
    one: an exploiter that punishes whatever it does), a scripted policy of ``games``
    (``random``, or one the game's evaluation hook lists) or another policy's name."""
    kind: Literal["lora", "full"] = "lora"
    """``lora``: an adapter on the shared base model; ``full``: a private copy of every base
    weight on the same scheduler, AdamW on all of them (LoRA and full-parameter training on
    the same job; needs ``model.engine`` other than ``peft``, and a learning rate near 1e-5)."""
    lora_rank: Annotated[int, Meta(ge=1, le=MAX_LORA_RANK)] = 8
    lora_alpha: PosCoef = 16.0
    target_modules: Annotated[list[str], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=lambda: list(LoraSpec().target_modules))
    """Projections that get LoRA weights (by default ``LoraSpec``'s, the attention's); checked
    against the model's architecture where it is known
    (:func:`opentinker.control.config_checks.check_config`)."""
    frozen: bool = False
    """Play and record trajectories but never train: the adapter stays as it started (the
    base model, or ``init``). Data collection at a given episode budget for an offline SFT or
    DPO job (``benchmarks/compare_learners.py``'s ``dpo``), or a fixed reference player."""
    init: PathStr = ""
    """Warm start: a saved adapter folder (``adapters/<policy>`` of a run or an offline SFT
    job, a checkpoint's) whose weights this policy starts from, with a fresh optimizer and
    version 0; its LoRA settings must be this policy's (checked before anything starts)."""
    device: Annotated[int, Meta(ge=-1, lt=MAX_DEVICES)] = -1
    """The scheduler this policy's adapter lives on, as an index into ``runtime.devices``
    (``1``: the second); -1: placed by adapter count."""
    train: Annotated[dict[str, str | bool | int | float], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict)
    """This policy's overrides of ``[train]``'s algorithm fields, e.g. ``{advantage = "rloo",
    loss = "cispo", kl_coef = 0.05}``: learners side by side in one job, on the same games
    and the same base model (the fields of ``SCHEDULE_FIELDS``, e.g. ``steps`` and
    ``groups_per_step``, are shared: overriding one is an error)."""


class TrainConfig(_Config):
    steps: Steps = 30
    checkpoint_every: Steps = 10
    """Write ``checkpoints/step_N/`` (adapters with their optimizer states, learner states,
    the evaluations so far) every this many steps and after the last; 0: only after the
    last. ``opentinker run --resume RUN_DIR`` continues from the newest one."""
    groups_per_step: Annotated[int, Meta(ge=1, le=MAX_GROUPS_PER_STEP)] = 8
    """Groups of episodes per policy per step; a group shares deal, seats and opponent."""
    group_size: Annotated[int, Meta(ge=1, le=MAX_GROUP_SIZE)] = 4
    """Episodes per group (differing only in sampling seeds): advantages are group-relative."""
    opponent_draws: Literal["episode", "group"] = "episode"
    """Where a scripted opponent's random draws come from in training: ``episode``, each
    episode its own stream; ``group``, one stream per group (common random numbers): given
    the same moves the opponent answers the same, so a group's outcomes differ by the
    policy's choices and not by the opponent's luck (against ``random`` most of a group's
    spread is luck otherwise). Evaluations always draw per episode."""
    advantage: str = "dr_grpo"
    """Advantage estimator, a name in ``learners.ADVANTAGES``: ``dr_grpo``, ``grpo``, ``rloo``
    (group-relative), ``reinforce_ema`` (moving-average baseline), ``role_ema`` (one baseline
    per game and seat, SPIRAL's RAE), ``turn_returns`` (per-turn discounted returns, turn-level
    credit), ``gae`` (GAE over turns with a learned critic: the policy's adapter gets a value
    head, trained with the value loss beside the policy loss: PPO with a critic), ``exact_gae``
    (GAE with the game's exact state values as the critic, for a game that values its states
    against each of the policy's opponents: ``GameEval.state_values``)."""
    loss: str = "ppo"
    """Policy loss, a name in ``learners.LOSSES`` of kind policy: ``ppo``,
    ``importance_sampling``, ``cispo``."""
    clip_low: UnitFloat = 0.2
    """PPO's lower clip ``1 - clip_low``."""
    clip_high: Annotated[float, Meta(ge=0, le=MAX_CLIP_HIGH)] = 0.2
    """PPO's upper clip ``1 + clip_high`` (DAPO's clip-higher when > ``clip_low``); also
    CISPO's ``eps_high`` (CISPO has no lower bound)."""
    dual_clip: Annotated[float, Meta(ge=0, le=MAX_DUAL_CLIP)] = 0.0
    """PPO's dual-clip bound ``c > 1`` on negative advantages; 0 disables."""
    is_truncation: PosCoef = 2.0
    """Truncation of the importance weight of ``importance_sampling``."""
    gamma: UnitFloat = 1.0
    """Discount over a seat's turns (``turn_returns``, ``gae``, ``exact_gae``)."""
    lam: UnitFloat = 0.95
    """GAE's lambda (``gae``, ``exact_gae``): 1 gives returns minus values, 0 the one-step TD
    error."""
    value_coef: PosCoef = 0.5
    """Coefficient of the critic's value loss (``gae``), a mean over turns, added to the
    policy loss (PPO's ``c1``)."""
    value_clip: Coef = 0.2
    """Clip range of the value loss around the values at scoring time (``gae``); 0 disables."""
    ema_decay: Annotated[float, Meta(ge=0, lt=1)] = 0.9
    """Decay of the moving-average baselines (``reinforce_ema``, ``role_ema``)."""
    kl_coef: Coef = 0.0
    """Coefficient of the KL penalty to the reference (the base model with the adapter off);
    0 disables it (and its extra forward pass)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimator of that KL: loss ``kl_k1``, ``kl_k2`` or ``kl_k3``."""
    entropy_coef: Coef = 0.0
    """Coefficient of the entropy bonus (full-vocabulary entropy at the sampled positions)."""
    normalize_advantages: bool = False
    """Standardise each step's per-turn advantages over the batch (zero mean, unit std; PPO's
    usual normalisation, mostly redundant after GRPO's per-group one). Value targets are
    unaffected."""
    epochs: Annotated[int, Meta(ge=1, le=1000)] = 1
    """Passes over each step's batch (PPO's K epochs): later passes reuse the advantages and
    the sampler's log-probs, so their ratios move off 1 and clip. All the step's updates must
    fit in ``runtime.timeout_s``."""
    minibatches: Annotated[int, Meta(ge=1, le=MAX_EPISODES_PER_STEP)] = 1
    """Updates per pass: the step's datums are shuffled and split into this many parts (fewer
    when there are fewer datums), each one ``forward_backward`` + ``optim_step`` normalised by
    its own token count."""
    lr: Annotated[float, Meta(gt=0, le=MAX_LR)] = 1e-3
    lr_schedule: Literal["constant", "linear"] = "constant"
    """``linear``: the learning rate falls linearly from ``lr`` at step 1 to ``lr / steps`` at the
    last step (a policy that must settle, e.g. near an equilibrium, stops being kicked about)."""
    weight_decay: Annotated[float, Meta(ge=0, le=100)] = 0.0
    """AdamW's decoupled weight decay (0.0-0.1 in use)."""
    grad_clip: Coef = 1.0
    """Global gradient-norm clip; 0 disables."""
    all_actions: Coef = 0.0
    """Weight of the exact all-actions update, for a game whose evaluation hook gives an exact
    payoff (``ExactMeasure.payoff``): each step every legal move's canonical reply at every
    decision is scored and moved by its value against the policy's opponent mix
    (``best_response``, ``random``, ``self``, ``past`` selves weighted by the league's
    matchmaking, other policies; the rule: ``all_actions_rule``), beside the sampled episodes'
    loss; 0 disables it (:mod:`learners.all_actions`)."""
    all_actions_rule: Literal["neurd", "gradient"] = "neurd"
    """How the all-actions term weighs each move: ``neurd`` (Neural Replicator Dynamics: its
    value's advantage over the decision's mean, which moves a nearly pure policy too) or
    ``gradient`` (the payoff's exact gradient, which vanishes where the policy is pure)."""
    all_actions_decisions: Annotated[int, Meta(ge=0, le=MAX_DECISIONS)] = 0
    """With ``all_actions``: train each step on the canonical replies of this many decisions
    drawn without replacement (seeded by the job's seed and the step), not of all of them;
    0: all. The weights stay exact (every decision is still scored, since a move's value
    depends on the policy everywhere else); only the backward pass is cut, so a game with
    hundreds of decisions (Leduc hold'em's 288) trains in a fraction of the time. The subset's
    per-token mean estimates the whole step's (a fresh draw each step)."""
    all_actions_only: bool = False
    """Train on the all-actions term alone: the step's episodes are still played (they feed
    the win rates, the league's matchmaking, metrics and transcripts) but not trained on."""
    canonical_coef: Coef = 0.0
    """With ``all_actions``: weight of a term that raises the model's total probability of the
    canonical replies at those decisions, without moving the mix between moves (so the exact
    measure keeps describing what the policy says)."""
    move_values: Coef = 0.0
    """Weight of a term that moves every legal move at each decision a step played by the
    game's exact value of it against the episode's scripted opponent (for a game whose
    ``GameEval.state_values`` values moves, ``StateValues.moves``): each
    move's first reply token gains its value minus the decision's mean (Neural Replicator
    Dynamics on the decisions played, :mod:`learners.move_values`), beside the sampled
    episodes' loss; 0 disables it."""
    move_values_against: Annotated[dict[str, Coef], Meta(max_length=64)] = msgspec.field(default_factory=dict)
    """With ``move_values``: move each decision's moves by this weighted sum of their values
    against the named scripted opponents the game values, whichever opponent the episode
    played (``{B = 1.0, random = 0.5}`` with ``B`` the game's scripted seat that plays best,
    e.g. a minimax one: a move that loses to best play is worse than any that does not, and
    among those the one that wins most against random is best), not
    by their value against the episode's own opponent; empty: the episode's own."""
    move_values_settled: Annotated[float, Meta(ge=0, lt=0.5)] = 0.0
    """With ``move_values``: leave alone the moves the policy already agrees with, every move of
    a decision whose best moves hold more than ``1 -`` this of the legal moves' probability,
    and elsewhere a worse-than-average move holding less than this (NeuRD's logit
    thresholding, on the moves' shares: a decision played right stops pushing its bad moves
    down ever further, so the update goes to the decisions still wrong;
    :func:`learners.move_values.settled_weights`); 0: never."""
    record_trajectories: bool = True
    """Write every training trajectory (token ids, masks, sampler log-probs, rewards, group,
    seed, seat) to ``<run>/trajectories/<policy>.jsonl``: data for offline SFT and DPO jobs."""

    def __post_init__(self) -> None:
        # Fields relative to this table: the caller's path is put in front (config_error).
        if self.dual_clip != 0 and not self.dual_clip > 1:
            raise ValueError(f"dual_clip: must be 0 (off) or > 1, got {self.dual_clip}")
        if (self.all_actions_only or self.canonical_coef or self.all_actions_decisions) and not self.all_actions:
            raise ValueError("all_actions_only, all_actions_decisions and canonical_coef need all_actions > 0")
        if self.move_values_against and not (self.move_values and any(self.move_values_against.values())):
            raise ValueError("move_values_against needs move_values > 0 and a positive weight")
        if self.move_values_settled and not self.move_values:
            raise ValueError("move_values_settled needs move_values > 0")
        if self.all_actions and self.advantage in CRITIC_ADVANTAGES:
            raise ValueError(f"all_actions: not with a critic (advantage {self.advantage!r}): its datums have no "
                             "value targets")
        if self.groups_per_step * self.group_size > MAX_EPISODES_PER_STEP:
            raise ValueError(f"groups_per_step: {self.groups_per_step} groups of {self.group_size} episodes "
                             f"is more than {MAX_EPISODES_PER_STEP} episodes per step")

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
        if self.move_values:
            out["move_values"] = self.move_values
            if self.move_values_settled:
                out["move_values/settled"] = self.move_values_settled
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


MAX_POLICY_NAME = 64


def adapter_owner(adapter: str) -> str:
    """The policy an adapter name belongs to: the policy itself, or the policy a league
    snapshot (``<policy>__s<step>``) was frozen from."""
    return SNAPSHOT_SUFFIX.sub("", adapter)


def policy_name_ok(name: str) -> bool:
    """``name`` can name a policy: an identifier of at most :data:`MAX_POLICY_NAME` characters
    that is no special opponent, scripted policy or ``league``, and no snapshot's name."""
    from games.scripted import SCRIPTED

    return (name.isidentifier() and len(name) <= MAX_POLICY_NAME and name not in SPECIAL_OPPONENTS
            and name not in SCRIPTED and name != "league" and not SNAPSHOT_SUFFIX.search(name))


def opponent_pool(cfg: JobConfig, policy: str, step: int) -> list[str]:
    """Who ``past`` can be for ``policy`` at step ``step``: its league snapshots
    (:func:`league_pool`) and, with ``league.pool = "all"``, every other policy of the job and
    its snapshots."""
    pool = league_pool(cfg, policy, step)
    if cfg.league.pool == "all":
        for q in cfg.policies:
            if q.name != policy:
                pool += [q.name, *league_pool(cfg, q.name, step)]
    return pool


SCHEDULE_FIELDS = ("steps", "checkpoint_every", "groups_per_step", "group_size", "opponent_draws",
                   "record_trajectories")
"""``[train]`` fields that every policy shares (the others a policy may override)."""


class SamplingConfig(_Config):
    temperature: Annotated[float, Meta(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE)] = 1.0
    top_p: Prob = 1.0
    top_k: Annotated[int, Meta(ge=0, le=MAX_TOP_K)] = 0
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] = 8
    explore: Annotated[float, Meta(ge=0, le=0.5)] = 0.0
    """Exploration: the probability that a training decision replies with a legal move drawn
    uniformly (the game's ``info["legal_moves"]``, with the stop token) instead of a sample.
    The reply is scored by the policy (its log-probs at the sampling temperature stand for the
    sampler's: an engine row with the reply forced, ``SampleRequest.forced``, in the batch
    beside the drawn ones), so the loss's importance ratio is the policy's own; a move the
    policy has stopped sampling still gets an advantage. Evaluations never explore."""


class EvalConfig(_Config):
    every: Steps = 10
    """Evaluate every this many steps (and always before the first and after the last); 0:
    only before and after."""
    hands_per_stratum: PosHands = 34
    """Hands against the random opponent per (deal, seat): 6 deals x 2 seats x 34 = 408."""
    final_hands_per_stratum: Hands = 0
    """Hands per stratum for the evaluations before the first and after the last step; 0:
    ``hands_per_stratum``."""
    head_to_head_per_stratum: Hands = 10
    """Hands per (deal, seat) against the untrained base model, at the first and last eval."""
    cross_play_per_stratum: Hands = 10
    """A job with several policies: hands per (deal, seat) of every policy against every other
    one, at the first and last eval (the cross-play matrix); 0: none."""
    exact: bool = True
    """Compute the game's exact measures at every evaluation (its evaluation hook's ``exact``:
    e.g. an exploitability); a game without any has nothing to compute. (Called
    ``exploitability`` before; an older run's config.toml still loads.)"""
    ratings: bool = True
    """In a competitive game, rate every evaluated pairing: a Bradley-Terry fit of each
    evaluation's games (``ratings/bt/<player>``, log-odds against ``random`` = 0, with a 95%
    bootstrap interval) and a running openskill table over the run
    (``ratings/openskill/<player>``); ``ratings.png`` and the final table show them."""
    rating_bootstrap: Annotated[int, Meta(ge=0, le=10_000)] = 200
    """Bootstrap resamples of each Bradley-Terry fit (0: no interval)."""


class RuntimeConfig(_Config):
    backend: Literal["ray", "local"] = "ray"
    env_runners: Annotated[int, Meta(ge=1, le=MAX_ENV_RUNNERS)] = 2
    timeout_s: Timeout = 900.0
    """Longest wait for any one request (a training step, an evaluation batch)."""
    startup_timeout_s: Timeout = 180.0
    max_restarts: Annotated[int, Meta(ge=0, le=1000)] = 3
    """Restarts over a job (Ray backend): a dead env runner or learner started again, the step
    or evaluation it was in played again; a dead scheduler or coordinator, the newest checkpoint
    restored. 0: a dead component stops the run."""
    scheduler: Annotated[str, Meta(max_length=4096)] = ""
    """A shared scheduler to run on (``opentinker serve``): its bus endpoint or its service
    file; ``""``: the job starts its own. ``opentinker run --scheduler ADDRESS`` sets it."""
    priority: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    """The job's weight on a shared scheduler."""
    address: Annotated[str, Meta(max_length=1024)] = ""
    """A Ray cluster to run on (``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``; Ray backend):
    env runners and learners are dealt to its nodes in turn, and the bus between them is CURVE
    (as with ``curve``), each server bound to its node's address. ``""``: a private Ray
    instance on this machine, on 127.0.0.1."""
    scheduler_resources: Annotated[dict[Annotated[str, Meta(min_length=1, max_length=64)],
                                        Annotated[float, Meta(ge=0, le=1e6)]], Meta(max_length=16)] = {}
    """Ray resources the job's scheduler needs, which place it on a node that has them (Ray
    backend): ``{"GPU": 1}`` a GPU node (Ray then hands it one GPU, as ``cuda``), a custom
    resource a node was started with (``ray start --resources='{"big_gpu": 1}'``). ``{}``:
    ``{"GPU": 1}`` when ``model.device`` is ``"cuda"``, else none (Ray puts it anywhere)."""
    devices: Annotated[list[Annotated[str, Meta(pattern=DEVICE_PATTERN)]], Meta(max_length=MAX_DEVICES)] = \
        msgspec.field(default_factory=list)
    """One scheduler per entry (``["cuda:0", "cuda:1"]``; ``"cpu"`` may repeat), each holding
    the base model and the adapters of the policies placed on it (``policies[].device``, else
    balanced by adapter count: :func:`opentinker.control.placement.place`); env runners send
    each request to the scheduler of the policy whose adapter it names. On the Ray backend a
    ``cuda`` entry's scheduler asks Ray for one GPU and uses the one Ray hands it (``cuda`` may
    repeat there), a ``cuda:N`` entry uses GPU N of its node (as ``model.device``). ``[]``: one
    scheduler on ``model.device``."""
    curve: bool = False
    """The job's bus on CURVE (authentication and encryption, keys made for the run) instead of
    PLAIN with the run's secret, on one machine too; always on with ``address``."""


class OfflineConfig(_Config):
    """An offline job: train the first policy's adapter on trajectories a run recorded, or on a
    scripted seat's play of the job's game (``scripted``), through the scheduler, with the
    ``sft`` or a preference (``dpo``, ``ipo``) loss; no model plays."""

    kind: Literal["sft", "dpo", "ipo"]
    """``sft``: maximum likelihood on the sampled tokens of trajectories whose total reward is
    above ``min_reward`` (e.g. winning games); ``dpo`` / ``ipo``: pairs of trajectories from the
    same start (group, seed, seat) with different rewards, the higher one chosen."""
    data: PathStr = ""
    """A ``trajectories/<policy>.jsonl`` file of a run, or a folder of such files (or set
    ``scripted`` instead)."""
    scripted: Annotated[str, Meta(max_length=256)] = ""
    """Instead of ``data``: a scripted seat of the job's game (e.g. ``calc_tool_user``) whose
    play is the data: ``episodes`` episodes of the game with it in the first policy's seat,
    each of its turns rendered as the policy's sampling renders them (system prompt, tool
    declarations, tool results as ``tool`` messages) and its replies the loss tokens
    (:mod:`opentinker.training.scripted_data`). ``sft`` only."""
    episodes: Annotated[int, Meta(ge=1, le=MAX_EPISODES_PER_STEP)] = 64
    """Episodes the ``scripted`` seat plays (each a distinct start, drawn from the job's seed)."""
    steps: PosSteps = 20
    batch_size: Annotated[int, Meta(ge=1, le=MAX_EPISODES_PER_STEP)] = 16
    """Sequences (``sft``) or pairs (``dpo``, ``ipo``) per step, cycling through the data in an
    order shuffled from the job's seed."""
    min_reward: Annotated[float, Meta(ge=-MAX_REWARD, le=MAX_REWARD)] = 0.0
    """``sft`` keeps trajectories whose total reward is strictly above this."""
    beta: PosCoef = 0.1
    """DPO's inverse temperature."""
    tau: PosCoef = 0.1
    """IPO's regularisation (target margin ``1 / (2 tau)``)."""

    def __post_init__(self) -> None:
        if bool(self.data) == bool(self.scripted):
            raise ValueError("offline.data: give either data (a trajectories file) or scripted (a scripted seat), "
                             f"not {'both' if self.data else 'neither'}")
        if self.scripted and self.kind != "sft":
            raise ValueError(f"offline.scripted: a scripted seat's play is SFT data (kind = 'sft'), not {self.kind!r}: "
                             "it has no worse trajectory to prefer against")

    def source(self) -> str:
        """What the data is, for messages: the file, or the scripted seat's play."""
        return f"{self.scripted}'s play ({self.episodes} episodes)" if self.scripted else self.data


class LeagueConfig(_Config):
    """Past selves as opponents (fictitious self-play): every ``snapshot_every`` steps each
    policy's adapter is frozen on the scheduler as ``<policy>__s<step>``; the opponent
    ``past`` in a policy's mix is drawn from its pool (:func:`opponent_pool`: its ``keep``
    newest snapshots, or with ``pool = "all"`` also the job's other policies and their
    snapshots; itself before the first snapshot) by ``matchmaking``: ``uniform``, or
    prioritized fictitious self-play (AlphaStar) on the coordinator's estimate of the win
    probability against each (``hard``: weight (1 - p)^``pfsp_power``, the opponents it loses
    to; ``variance``: p (1 - p), those of its own strength). Which snapshots exist at a step
    follows from the config; the win-rate estimates are saved with every checkpoint, so
    ``--resume`` draws the same opponents."""

    matchmaking: Literal["uniform", "hard", "variance"] = "uniform"
    pool: Literal["own", "all"] = "own"
    pfsp_power: Annotated[float, Meta(gt=0, le=10)] = 2.0
    win_rate_decay: Annotated[float, Meta(gt=0, le=1)] = 0.9
    """Each time a step plays an opponent, the games against it so far are weighed by
    ``win_rate_decay`` before the step's are added (a memory of about ``1 / (1 -
    win_rate_decay)`` of the steps that played it; a rarely drawn opponent keeps its estimate
    longer); 1: plain counts. A resumed run uses its config's value."""

    snapshot_every: Steps = 0
    """Freeze every policy after each this many steps; 0: no league."""
    keep: Annotated[int, Meta(ge=1, le=1000)] = 5
    """Snapshots per policy kept in the league (older ones are dropped from the scheduler)."""
    eval_per_stratum: Hands = 0
    """Hands per (deal, seat) of every policy against each of its league snapshots at every
    evaluation (columns of the cross-play matrix); 0: none."""


class JobConfig(_Config):
    name: str = "default"
    """Part of the run folder's name: letters, digits, ``_``, ``-``, ``+`` and ``.`` (not
    first), at most :data:`opentinker.files.MAX_NAME_BYTES` bytes (:func:`check_name`)."""
    seed: Annotated[int, Meta(ge=0, le=MAX_SEED)] = 0
    game: Annotated[str, Meta(max_length=256)] = "kuhn_poker_v0"
    game_kwargs: Annotated[dict[str, int | float | str | bool], Meta(max_length=MAX_ITEMS)] = msgspec.field(
        default_factory=dict)
    """Keyword arguments of the game's ``env(...)``, e.g. ``{num_players = 4}`` or
    ``{board_size = 9}``."""
    system_prompt: Annotated[str, Meta(max_length=MAX_TEXT)] = ""
    """The system message of every LLM seat (explicit: SmolLM2 injects its own otherwise);
    empty: the game's own (its evaluation hook's ``system_prompt``)."""
    out_dir: PathStr = "runs"
    """Run folders are made inside it (``<out_dir>/<run name>``)."""
    model: ModelConfig = ModelConfig()
    policies: Annotated[list[PolicyConfig], Meta(max_length=MAX_POLICIES)] = msgspec.field(
        default_factory=lambda: [PolicyConfig()])
    train: TrainConfig = TrainConfig()
    sampling: SamplingConfig = SamplingConfig()
    eval: EvalConfig = EvalConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    league: LeagueConfig = LeagueConfig()
    offline: OfflineConfig | msgspec.UnsetType = msgspec.UNSET
    """Set (an ``[offline]`` table): an offline job instead of self-play training (unset, it
    is left out of the resolved TOML, which has no null)."""

    def __post_init__(self) -> None:
        # Messages are "<field>: <reason>" (ConfigError's form, kept by config_error).
        check_name(self.name)
        if not self.out_dir or _has_controls(self.out_dir) or "\0" in self.out_dir:
            raise ValueError(f"out_dir: must be a non-empty path without control characters, got {self.out_dir!r}")
        for key, value in self.game_kwargs.items():
            field = _kwarg_field(key)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{field}: must be finite, got {value}")
            if isinstance(value, str) and len(value) > MAX_KWARG_CHARS:
                raise ValueError(f"{field}: longer than {MAX_KWARG_CHARS} characters")
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
                raise ValueError(f"{field}: {value} does not fit 64 bits")
        names = [p.name for p in self.policies]
        if not self.policies:
            raise ValueError("policies: at least one trainable policy is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"policies: duplicate names in {names}")
        from games.scripted import SCRIPTED

        for i, p in enumerate(self.policies):
            if not policy_name_ok(p.name):
                raise ValueError(f"policies[{i}].name: {p.name!r}: must be an identifier other than "
                                 f"{', '.join(SPECIAL_OPPONENTS)}, league and the scripted policies "
                                 f"({', '.join(sorted(SCRIPTED))}), not ending in __s<digits>, at most "
                                 f"{MAX_POLICY_NAME} characters")
            if not p.opponents or sum(p.opponents.values()) <= 0:
                raise ValueError(f"policies[{p.name}].opponents: needs a positive weight")
            for o in p.opponents:
                if o not in SPECIAL_OPPONENTS and o not in SCRIPTED and o not in names:
                    raise ValueError(f"policies[{p.name}].opponents: {o!r} is none of self, base, past, best_response, a scripted "
                                     f"policy ({', '.join(sorted(SCRIPTED))}) or a policy of this job ({', '.join(names)})")
            if p.opponents.get("past", 0) > 0 and not self.league.snapshot_every:
                raise ValueError(f"policies[{p.name}].opponents: 'past' needs a league (league.snapshot_every > 0)")
        self._check_devices()
        if self.league.eval_per_stratum and not self.league.snapshot_every:
            raise ValueError("league.eval_per_stratum: evaluates against league snapshots, and there are none "
                             "(league.snapshot_every = 0)")
        if not self.system_prompt:
            import games

            try:
                msgspec.structs.force_setattr(self, "system_prompt", games.evaluation(self.game).system_prompt)
            except ValueError as e:
                raise ValueError(f"game: {e}") from None
        self._check_scripted_data()
        for p in self.policies:
            self.train_for(p.name)
            if p.init and not os.path.isabs(p.init):  # absolute: every actor and a resume read it alike
                msgspec.structs.force_setattr(p, "init", os.path.abspath(p.init))

    def _check_devices(self) -> None:
        devices = self.runtime.devices
        if devices and self.runtime.scheduler:
            raise ValueError("runtime.devices: a job on a shared scheduler (runtime.scheduler) runs where that "
                             "scheduler does; leave runtime.devices empty")
        if len(devices) > 1 and self.offline_job() is not None:
            raise ValueError("runtime.devices: an offline job trains one policy on one scheduler; give one device")
        # "cuda" on Ray: a GPU Ray hands the scheduler (one each); here, cuda:0.
        gpus = [d for d in devices if d.startswith("cuda:") or (d == "cuda" and self.runtime.backend == "local")]
        if len({"cuda:0" if d == "cuda" else d for d in gpus}) != len(gpus):
            raise ValueError(f"runtime.devices: {devices} names a GPU twice (one scheduler per device)")
        for p in self.policies:
            if p.device >= max(len(devices), 1) or (p.device > 0 and not devices):
                raise ValueError(f"policies[{p.name}].device: {p.device} is not an index into runtime.devices "
                                 f"{devices} (0 to {max(len(devices), 1) - 1}; -1: placed by adapter count)")

    def _check_scripted_data(self) -> None:
        """``offline.scripted`` names a scripted seat of this game, and every other seat of its
        episodes is scripted too (no model plays in an offline job)."""
        oc = self.offline_job()
        if oc is None or not oc.scripted:
            return
        import games
        from games.scripted import SCRIPTED

        own = tuple(dict.fromkeys(("random", *games.evaluation(self.game).scripted)))
        if oc.scripted not in SCRIPTED:
            raise ValueError(f"offline.scripted: {oc.scripted!r} is not a scripted policy; {self.game}'s are "
                             f"{', '.join(own)}")
        if oc.scripted not in own:
            raise ValueError(f"offline.scripted: {oc.scripted!r} is not a scripted seat of {self.game} (its own: "
                             f"{', '.join(own)})")
        p = self.policies[0]
        live = sorted(o for o, w in p.opponents.items() if w > 0 and o != "self" and o not in SCRIPTED)
        if live:
            raise ValueError(f"offline.scripted: policies[{p.name}].opponents {live} would need a model to play; "
                             "a scripted seat's data is played by scripted seats only (self: the scripted seat)")

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
        raw = {**msgspec.to_builtins(self.train), **p.train}
        try:
            return msgspec.convert(raw, TrainConfig)
        except msgspec.ValidationError as e:
            raise config_error(e, raw, TrainConfig, where) from None

    def lora_spec(self, policy: str) -> LoraSpec:
        """The ``LoraSpec`` of ``policy``'s adapter: its LoRA settings, seeded from the job's
        seed, with a value head when the policy trains a critic (:attr:`TrainConfig.critic`)."""
        (p,) = [p for p in self.policies if p.name == policy]
        return LoraSpec(rank=p.lora_rank, alpha=p.lora_alpha, target_modules=tuple(p.target_modules),
                        seed=self.seed, value_head=self.train_for(policy).critic, full=p.kind == "full")

    def run_name(self) -> str:
        """``{game}__{name}__{seed}__{time}``, as CleanRL names runs."""
        game = self.game.replace(":", ".")  # a module's factory (``colors:env``): no colon in a path
        return f"{game}__{self.name}__{self.seed}__{time.strftime('%Y%m%d-%H%M%S')}"

    def run_dir(self) -> Path:
        """``<out_dir>/<run name>``, checked (with both paths resolved, symbolic links followed)
        to be a folder directly inside ``out_dir``; :class:`ConfigError` otherwise."""
        run_dir = Path(self.out_dir) / self.run_name()
        if not self.directly_in_out_dir(run_dir):
            raise ConfigError("name", f"the run folder {str(run_dir)!r} would not lie inside out_dir {self.out_dir!r}")
        return run_dir

    def directly_in_out_dir(self, path: str | Path) -> bool:
        """Whether ``path`` is a folder directly inside ``out_dir`` (both resolved, symbolic
        links followed): where a run's folder may be."""
        return Path(path).resolve().parent == Path(self.out_dir).resolve()


def check_name(name: str) -> None:
    """Refuse a job ``name`` that is not a safe path component (:func:`opentinker.files.name_problem`)
    with a :class:`ConfigError` naming ``name``."""
    problem = name_problem(name)
    if problem is not None:
        raise ConfigError("name", problem)


def _has_controls(text: str) -> bool:
    return escape_controls(text) != text


def _kwarg_field(key: str) -> str:
    """``game_kwargs.<key>``, or ``game_kwargs[<key quoted>]`` for a key that is no identifier."""
    return f"game_kwargs.{key}" if key.isidentifier() else f"game_kwargs[{json.dumps(key)}]"


BUNDLED = Path(__file__).parent / "configs"


def bundled_configs() -> list[str]:
    """Names of the job configs shipped with the package (``opentinker run NAME``)."""
    return sorted(p.stem for p in BUNDLED.glob("*.toml"))


MAX_CONFIG_BYTES = 1 << 20
"""A job file is read whole; the bundled ones are under 2 KiB."""


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> JobConfig:
    """Decode a TOML job file (``None``: the bundled default job; a bare name such as
    ``default``: a bundled job in ``opentinker/configs/``), apply overrides (a nested dict), and validate the result.

    Raises:
        ConfigError: a field that cannot work, as ``<field>: <reason>`` (``config: ...`` for
            a file that cannot be read or is not TOML).
        FileNotFoundError: no such file and no bundled job of that name.
    """
    if path is None:
        path = "default"
    path = Path(path)
    if not path.is_file() and path.suffix == "" and (BUNDLED / f"{path}.toml").is_file():
        path = BUNDLED / f"{path}.toml"
    if not path.is_file():
        raise FileNotFoundError(f"config: file {str(path)!r} does not exist (bundled jobs: {bundled_configs()})")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError("config", f"{str(path)!r} is {size} bytes, more than a job file's {MAX_CONFIG_BYTES}")
        raw = msgspec.toml.decode(path.read_bytes())
    except OSError as e:
        raise ConfigError("config", f"cannot read {str(path)!r}: {e.strerror or e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError("config", f"{str(path)!r} is not valid TOML: {e}") from None
    if overrides:
        _merge(raw, overrides)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> JobConfig:
    """A job config from its decoded TOML tables (older field names accepted), or
    :class:`ConfigError` naming the first field that does not decode (``<field>: <reason>``)."""
    _renamed(raw)
    try:
        return msgspec.convert(raw, JobConfig)
    except msgspec.ValidationError as e:
        raise config_error(e, raw, JobConfig) from None


RENAMED = {("eval", "exploitability"): "exact"}
"""Fields renamed since a run could have written them: ``(table, old) -> new``; a config.toml
of an older run (``--resume``, ``opentinker eval``) still loads."""


def _renamed(raw: dict) -> None:
    for (table, old), new in RENAMED.items():
        t = raw.get(table)
        if isinstance(t, dict) and old in t and new not in t:
            t[new] = t.pop(old)


def _merge(into: dict, new: dict, where: str = "") -> None:
    """Overrides ``new`` merged into the decoded TOML ``into``; a dict with int keys edits the
    elements of the list it lands on (``--set policies[0].name=x``)."""
    for k, v in new.items():
        if isinstance(v, dict) and v and all(isinstance(i, int) for i in v):
            items = into.get(k)
            if items is None:  # the field's default: one element (a job's one policy) at most
                items = into[k] = [{}]
            if not isinstance(items, list):
                raise ConfigError(f"{where}{k}", "is not a list: it has no [index]")
            for i, sub in sorted(v.items()):
                if i >= len(items):
                    raise ConfigError(f"{where}{k}[{i}]", f"the config has {len(items)} of them "
                                                         f"(indices 0 to {len(items) - 1})")
                if isinstance(sub, dict) and isinstance(items[i], dict):
                    _merge(items[i], sub, f"{where}{k}[{i}].")
                else:
                    items[i] = sub
        elif isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v, f"{where}{k}.")
        else:
            into[k] = v


def to_toml(cfg: JobConfig) -> bytes:
    """The resolved config as TOML (written beside a run's results)."""
    return msgspec.toml.encode(cfg)
