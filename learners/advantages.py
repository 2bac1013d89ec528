"""Advantage estimators, one registry by name, one calling convention.

Every estimator is ``fn(batch, state, config) -> Advantages``:

* ``batch``: an :class:`EpisodeBatch`, what an estimator may know of one policy's step: per
  trajectory its ``group_id``, its role key (e.g. ``"kuhn_poker_v0/player_0"``), the reward
  after each of its ``K_d`` turns, and a critic's value of each turn (for ``gae``) or the
  game's exact value of each turn's state (for ``exact_gae``).
* ``state``: what the estimator carried over from the previous step (``None`` at the start
  and for estimators without state). Estimators that keep state (moving-average baselines)
  take it in and return the new one; the learner actor owns it and checkpoints it (DESIGN §5).
* ``Advantages.per_turn``: one ``float32[K_d]`` per trajectory, in batch order. The learner
  puts turn ``k``'s advantage on turn ``k``'s sampled tokens (:mod:`learners.assembly`), so
  outcome estimators (one advantage per episode) repeat it on every turn.

:data:`ADVANTAGES` maps a name to an :class:`Estimator`, a small typed record saying whether
the estimator keeps state and whether it needs critic values or the game's values; calling it
checks the shapes.
Group estimators compute in float64 and give exact zeros to a group whose rewards are all equal
(a plain ``r - mean`` can leave ~1e-17 residues, which would hide such groups from the
``frac_zero_adv_groups`` diagnostic).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    """The trajectories of one policy's step, as estimators see them (``D`` trajectories)."""

    group_ids_D: np.ndarray
    """``int64[D]``: trajectories with one ``group_id`` share a start (DESIGN §5)."""
    turn_rewards: tuple[np.ndarray, ...]
    """``D`` arrays ``float64[K_d]``, ``K_d >= 1``: the reward credited to each turn; they sum
    to the trajectory's total reward."""
    roles_D: tuple[str, ...]
    """Role key of each trajectory (``role_ema`` keeps one baseline per key)."""
    values: tuple[np.ndarray, ...] | None = None
    """``D`` arrays ``float64[K_d + 1]`` from a critic (``gae``), else ``None``."""
    game_values: tuple[np.ndarray, ...] | None = None
    """``D`` arrays ``float64[K_d + 1]``: the game's exact value of each turn's state to the
    seat, then 0 (the game is over), where every turn has one (``Turn.game_value``; the
    critic of ``exact_gae``), else ``None``."""
    rewards_D: np.ndarray = None  # type: ignore[assignment]
    """``float64[D]`` total reward of each trajectory, as the environment summed it (default:
    the sum of its turn rewards). Outcome estimators use these, not a re-summation, so equal
    totals stay exactly equal (and their group exactly zero)."""

    def __post_init__(self) -> None:
        n = len(self.turn_rewards)
        if self.rewards_D is None:
            object.__setattr__(self, "rewards_D", np.array([math.fsum(r) for r in self.turn_rewards]))
        object.__setattr__(self, "rewards_D", np.asarray(self.rewards_D, dtype=np.float64))
        if self.rewards_D.shape != (n,) or not np.all(np.isfinite(self.rewards_D)):
            raise ValueError(f"EpisodeBatch: rewards_D must be {n} finite totals, got "
                             f"{self.rewards_D.tolist()}")
        ids = np.asarray(self.group_ids_D)
        if ids.shape != (n,) or len(self.roles_D) != n:
            raise ValueError(f"EpisodeBatch: {n} trajectories but group_ids_D shape {ids.shape} "
                             f"and {len(self.roles_D)} roles")
        for d, r in enumerate(self.turn_rewards):
            if np.ndim(r) != 1 or len(r) == 0 or not np.all(np.isfinite(r)):
                raise ValueError(f"EpisodeBatch: trajectory {d} needs finite rewards for >= 1 "
                                 f"turn, got {np.asarray(r).tolist()}")
        for name in ("values", "game_values"):
            arrays = getattr(self, name)
            if arrays is None:
                continue
            if len(arrays) != n:
                raise ValueError(f"EpisodeBatch: {len(arrays)} {name} arrays for {n} trajectories")
            for d, (r, v) in enumerate(zip(self.turn_rewards, arrays)):
                if np.shape(v) != (len(r) + 1,) or not np.all(np.isfinite(v)):
                    raise ValueError(f"EpisodeBatch: trajectory {d} needs K+1 = {len(r) + 1} "
                                     f"finite {name}, got {np.asarray(v).tolist()}")

    @classmethod
    def outcomes(
        cls,
        rewards_D: Sequence[float],
        group_ids_D: Sequence[int] | None = None,
        roles_D: Sequence[str] | None = None,
    ) -> EpisodeBatch:
        """A batch of one-turn trajectories: total rewards only (group ids default to one
        group, roles to ``""``)."""
        rewards = np.asarray(rewards_D, dtype=np.float64).reshape(-1)
        n = rewards.size
        ids = np.zeros(n, np.int64) if group_ids_D is None else np.asarray(group_ids_D, np.int64)
        return cls(group_ids_D=ids, turn_rewards=tuple(rewards[:, None]),
                   roles_D=tuple(roles_D) if roles_D is not None else ("",) * n, rewards_D=rewards)

    def broadcast(self, advantages_D: np.ndarray) -> tuple[np.ndarray, ...]:
        """Each trajectory's one advantage repeated on each of its turns (``float32[K_d]``)."""
        return tuple(np.full(len(r), a, dtype=np.float32)
                     for r, a in zip(self.turn_rewards, np.asarray(advantages_D)))


@dataclasses.dataclass(frozen=True)
class EmaState:
    """Moving-average baselines, one per key (``reinforce_ema`` uses the single key ``"all"``)."""

    baselines: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Key -> current moving average of batch-mean rewards (an unseen key starts at 0)."""
    updates: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Key -> number of batches folded in (for logging; the update does not use it)."""

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able dict (``json.dumps`` round-trips every float exactly)."""
        return {"baselines": {k: float(v) for k, v in sorted(self.baselines.items())},
                "updates": {k: int(v) for k, v in sorted(self.updates.items())}}

    @classmethod
    def from_json(cls, data: Any) -> EmaState:
        """Inverse of :meth:`to_json`; ``ValueError`` naming what is malformed."""
        if not isinstance(data, Mapping) or set(data) != {"baselines", "updates"}:
            raise ValueError(f"EmaState needs keys 'baselines' and 'updates', got {data!r}")
        baselines, updates = data["baselines"], data["updates"]
        if not isinstance(baselines, Mapping) or not all(
                isinstance(v, (int, float)) and np.isfinite(v) for v in baselines.values()):
            raise ValueError(f"EmaState.baselines must map keys to finite numbers: {baselines!r}")
        if not isinstance(updates, Mapping) or not all(
                isinstance(v, int) and v >= 0 for v in updates.values()):
            raise ValueError(f"EmaState.updates must map keys to counts >= 0: {updates!r}")
        return cls(baselines={str(k): float(v) for k, v in baselines.items()},
                   updates={str(k): int(v) for k, v in updates.items()})


class Advantages(NamedTuple):
    """What an estimator returns."""

    per_turn: tuple[np.ndarray, ...]
    """One ``float32[K_d]`` per trajectory, in batch order."""
    state: EmaState | None
    """The state to pass to the next call (the input state for stateless estimators)."""
    value_targets: tuple[np.ndarray, ...] | None = None
    """``gae`` only: one ``float32[K_d]`` lambda-return per trajectory, the critic's target."""


AdvantageFn = Callable[[EpisodeBatch, "EmaState | None", Mapping[str, float]], Advantages]
"""``fn(batch, state, config) -> Advantages``."""


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered estimator: the function and what it needs beyond rewards."""

    name: str
    fn: AdvantageFn
    stateful: bool = False
    """Takes the previous :class:`EmaState` and returns the next one."""
    needs_values: bool = False
    """Needs ``batch.values`` from a learned critic."""
    needs_game_values: bool = False
    """Needs ``batch.game_values``: the game's exact value of every turn's state."""

    def __call__(self, batch: EpisodeBatch, state: EmaState | None,
                 config: Mapping[str, float]) -> Advantages:
        """Apply the estimator and check it returned one ``float32[K_d]`` per trajectory."""
        if self.needs_values and batch.values is None:
            raise ValueError(f"advantage estimator {self.name!r} needs critic values "
                             "(EpisodeBatch.values); this batch has none")
        if self.needs_game_values and batch.game_values is None:
            raise ValueError(f"advantage estimator {self.name!r} needs the game's exact value of every turn's "
                             "state (Turn.game_value, from GameEval.state_values against a scripted opponent "
                             "it values); this batch has a turn without one")
        out = self.fn(batch, state, config)
        shapes = [np.shape(a) for a in out.per_turn]
        if shapes != [(len(r),) for r in batch.turn_rewards]:
            raise ValueError(f"estimator {self.name!r} returned shapes {shapes} for turns "
                             f"{[len(r) for r in batch.turn_rewards]}")
        return out


ADVANTAGES: dict[str, Estimator] = {}
"""Estimator name -> :class:`Estimator`; fill it with :func:`register_advantage`."""


def register_advantage(
    name: str, *, stateful: bool = False, needs_values: bool = False, needs_game_values: bool = False
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator that registers ``fn`` in :data:`ADVANTAGES` under ``name`` (``fn`` itself is
    returned unchanged, so it stays importable and usable in Ray actors).

    Raises:
        ValueError: ``name`` is already registered (a silent overwrite would change what a
            config means depending on import order).
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGES[name] = Estimator(name, fn, stateful=stateful, needs_values=needs_values,
                                     needs_game_values=needs_game_values)
        return fn

    return decorator


def standardize(per_turn: Sequence[np.ndarray], eps: float = 1e-8) -> list[np.ndarray]:
    """Per-turn advantages standardised over the whole batch, ``(A - mean) / std`` over every
    turn of every trajectory (PPO's usual advantage normalisation: Andrychowicz et al. 2021,
    "What Matters in On-Policy RL", §3.4 / Huang et al. 2022, "The 37 Implementation Details
    of PPO", detail 7). Exactly rounded sums, so the result ignores the order of the turns;
    a batch whose advantages are all equal (std < ``eps``) is only centred.

    Args:
        per_turn: ``D`` arrays ``float[K_d]``, one advantage per turn.
    Returns:
        The same shapes, standardised.
    """
    flat = np.concatenate([np.asarray(a, dtype=np.float64) for a in per_turn]) if per_turn else np.zeros(0)
    if flat.size == 0:
        return [np.asarray(a, dtype=np.float32) for a in per_turn]
    mean = math.fsum(flat) / flat.size
    std = math.sqrt(math.fsum((flat - mean) ** 2) / flat.size)
    scale = 1.0 / std if std >= eps else 1.0
    return [((np.asarray(a, dtype=np.float64) - mean) * scale).astype(np.float32) for a in per_turn]


def estimate(name: str, batch: EpisodeBatch, state: EmaState | None,
             config: Mapping[str, float]) -> Advantages:
    """``ADVANTAGES[name](batch, state, config)``; an unknown name is a ``ValueError`` listing
    the known ones."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGES)}")
    return ADVANTAGES[name](batch, state, config)


# ---------------------------------------------------------------------------------------------
# Group estimators: one advantage per trajectory, relative to its group.


def _mean(x: np.ndarray) -> float:
    """Exactly rounded mean (``math.fsum``): the same whatever the order of ``x``, so
    permuting a group never moves an advantage or a baseline by a rounding error."""
    return math.fsum(x) / len(x)


def _degenerate(rewards_G: np.ndarray) -> bool:
    """True when the group cannot rank its episodes: one episode, or all rewards equal."""
    return rewards_G.size < 2 or bool(np.all(rewards_G == rewards_G[0]))


def _per_group(batch: EpisodeBatch, kernel: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, ...]:
    """``kernel(rewards_G)`` on every group's total rewards (zeros for degenerate groups),
    broadcast over turns. Groups need not be contiguous; order within a group is batch order."""
    rewards_D = batch.rewards_D
    advantages_D = np.zeros(rewards_D.size, dtype=np.float64)
    ids = np.asarray(batch.group_ids_D)
    for gid in np.unique(ids):
        (index_G,) = np.nonzero(ids == gid)
        if not _degenerate(rewards_D[index_G]):
            advantages_D[index_G] = kernel(rewards_D[index_G])
    return batch.broadcast(advantages_D.astype(np.float32))


@register_advantage("dr_grpo")
def dr_grpo(batch: EpisodeBatch, state: EmaState | None, config: Mapping[str, float]) -> Advantages:
    """Dr. GRPO advantage: reward minus the group mean, without the std division.

    ``A_i = r_i - mean(r_1..r_G)`` (Liu et al. 2025, "Understanding R1-Zero-Like Training: A
    Critical Perspective", §3.2, the Dr. GRPO advantage: GRPO's ``Â_{i,t}`` with the
    ``std(r)`` division removed, since it up-weights groups whose rewards barely differ).
    ``r_i`` is trajectory ``i``'s total reward; ``A_i`` goes on every turn. Config: none.
    """
    del config
    return Advantages(_per_group(batch, lambda r_G: r_G - _mean(r_G)), state)


@register_advantage("grpo")
def grpo(batch: EpisodeBatch, state: EmaState | None, config: Mapping[str, float]) -> Advantages:
    """GRPO outcome-supervision advantage: the group-standardised reward.

    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the population std (``ddof=0``)
    (Shao et al. 2024, "DeepSeekMath", §4.1.2, outcome supervision:
    ``Â_{i,t} = r̃_i = (r_i - mean(r)) / std(r)``; ``eps`` is ours, for numerical safety).
    Config: ``eps`` (default ``1e-6``).
    """
    eps = float(config.get("eps", 1e-6))

    def standardise(r_G: np.ndarray) -> np.ndarray:
        centred_G = r_G - _mean(r_G)
        return centred_G / (math.sqrt(_mean(centred_G**2)) + eps)

    return Advantages(_per_group(batch, standardise), state)


@register_advantage("rloo")
def rloo(batch: EpisodeBatch, state: EmaState | None, config: Mapping[str, float]) -> Advantages:
    """REINFORCE leave-one-out (RLOO): reward minus the mean of the OTHER episodes' rewards.

    ``A_i = r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) (r_i - mean(r))``: the leave-one-out
    baseline of Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!", as
    the RLOO estimator of Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs" (their RLOO estimator, without
    the ``1/G`` average, which the loss normalizer supplies). The baseline excludes episode
    ``i``, so it does not depend on episode ``i``'s actions and the gradient stays unbiased.
    A group of one has no other episode to form a baseline: zeros. Config: none.
    """
    del config
    return Advantages(
        _per_group(batch, lambda r_G: r_G.size / (r_G.size - 1) * (r_G - _mean(r_G))), state)


# ---------------------------------------------------------------------------------------------
# Moving-average baselines (stateful).


def _decay(config: Mapping[str, float]) -> float:
    decay = float(config.get("decay", 0.9))
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    return decay


def _ema(batch: EpisodeBatch, keys_D: Sequence[str], state: EmaState | None,
         config: Mapping[str, float]) -> Advantages:
    """``A_d = r_d - b_{key_d}`` against the baselines BEFORE this batch, then each key seen
    is updated once: ``b <- decay b + (1 - decay) mean(r_d : key_d = key)``."""
    decay = _decay(config)
    state = EmaState() if state is None else state
    rewards_D = batch.rewards_D
    baselines_D = np.array([state.baselines.get(k, 0.0) for k in keys_D], dtype=np.float64)
    new_b, new_n = dict(state.baselines), dict(state.updates)
    keys = np.asarray(list(keys_D), dtype=object)
    for key in sorted(set(keys_D)):
        mean = _mean(rewards_D[keys == key])
        new_b[key] = decay * state.baselines.get(key, 0.0) + (1.0 - decay) * mean
        new_n[key] = state.updates.get(key, 0) + 1
    advantages_D = (rewards_D - baselines_D).astype(np.float32)
    return Advantages(batch.broadcast(advantages_D), EmaState(new_b, new_n))


@register_advantage("reinforce_ema", stateful=True)
def reinforce_ema(batch: EpisodeBatch, state: EmaState | None,
                  config: Mapping[str, float]) -> Advantages:
    """REINFORCE with a moving-average reward baseline: ``A_d = r_d - b``.

    The reinforcement baseline ``b`` of Williams 1992, "Simple Statistical Gradient-Following
    Algorithms for Connectionist Reinforcement Learning", §4 (the REINFORCE update
    ``Δw = α (r - b) e``), taken as an exponential moving average of past batch-mean rewards,
    kept in ``state.baselines["all"]``.

    The batch is scored against the baseline BEFORE the update, then
    ``b' = decay * b + (1 - decay) * mean(r)`` is returned. Using the pre-update value keeps
    ``b`` independent of this batch's actions, so the gradient stays unbiased (a post-update
    baseline leaks each episode's own reward into its baseline). With no state the baseline
    is 0, so the first batch sees raw rewards. Config: ``decay`` in ``[0, 1)`` (default 0.9).
    """
    return _ema(batch, ["all"] * len(batch.turn_rewards), state, config)


@register_advantage("role_ema", stateful=True)
def role_ema(batch: EpisodeBatch, state: EmaState | None,
             config: Mapping[str, float]) -> Advantages:
    """Role-conditioned advantage estimation (RAE): one moving-average baseline per role key.

    ``A_d = r_d - b_{key_d}``, ``b_key <- decay * b_key + (1 - decay) * mean(r_d : key_d = key)``
    (Liu et al. 2025, "SPIRAL: Self-Play on Zero-Sum Games Incentivizes Reasoning via
    Multi-Agent Multi-Turn Reinforcement Learning", arXiv:2506.24119, RAE: a baseline
    ``b_{G,p}`` per game ``G`` and role ``p``, updated as ``b <- α b + (1 - α) R_p``, since in a zero-sum game the
    players' expected returns differ and one shared baseline would credit the seat, not the play).

    The key is ``batch.roles_D`` (the learner builds ``"<game>/<seat>"``). As in
    :func:`reinforce_ema`, a batch is scored against the baselines BEFORE this batch's update
    (our choice, for the same unbiasedness reason; SPIRAL updates per game); an unseen key
    starts at 0; keys absent from the batch keep their value. Config: ``decay`` (default 0.9).
    """
    return _ema(batch, batch.roles_D, state, config)


# ---------------------------------------------------------------------------------------------
# Turn-level credit.


def _gamma(config: Mapping[str, float], key: str = "gamma", default: float = 1.0) -> float:
    value = float(config.get(key, default))
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{key} must be in [0, 1], got {value}")
    return value


def discounted_returns(rewards_K: np.ndarray, gamma: float) -> np.ndarray:
    """``G_k = sum_{j >= k} gamma^{j-k} r_j`` (Sutton & Barto 2018, "Reinforcement Learning:
    An Introduction", eq. 3.8), computed backwards as ``G_k = r_k + gamma G_{k+1}``.

    Args: ``rewards_K`` ``float[K]``; ``gamma`` in ``[0, 1]``. Returns ``float64[K]``.
    """
    rewards_K = np.asarray(rewards_K, dtype=np.float64)
    returns_K = np.zeros_like(rewards_K)
    running = 0.0
    for k in range(rewards_K.size - 1, -1, -1):
        running = rewards_K[k] + gamma * running
        returns_K[k] = running
    return returns_K


@register_advantage("turn_returns")
def turn_returns(batch: EpisodeBatch, state: EmaState | None,
                 config: Mapping[str, float]) -> Advantages:
    """Turn-level credit: each turn's discounted return-to-go, minus its group's mean at that turn.

    ``G_{d,k} = sum_{j >= k} gamma^{j-k} r_{d,j}`` (Sutton & Barto 2018, eq. 3.8), and
    ``A_{d,k} = G_{d,k} - mean{G_{d',k} : d' in group(d), K_{d'} > k}``: the Dr. GRPO baseline
    (group mean, no std) taken per turn index, so a reward at turn ``k`` credits only turns
    ``<= k`` and a late turn is compared with the same turn of the group's other episodes. This
    is GiGPO's step-level group advantage (Feng et al. 2025, "Group-in-Group Policy
    Optimization for LLM Agent Training", §3.2, ``A^S = Q - mean`` over a step group) with the
    turn index standing in for the anchor state: at turn 0 every episode of a group has the
    same state, so there the two coincide. A turn index reached by one episode of its group
    only has no comparison and gets 0, as a group of one does in :func:`dr_grpo`. With one
    turn per episode this is exactly :func:`dr_grpo` on discounted returns.

    Config: ``gamma`` in ``[0, 1]`` (default 1.0).
    """
    gamma = _gamma(config)
    returns = [discounted_returns(r, gamma) for r in batch.turn_rewards]
    out = [np.zeros(len(g), np.float64) for g in returns]
    ids = np.asarray(batch.group_ids_D)
    for gid in np.unique(ids):
        members = np.nonzero(ids == gid)[0]
        for k in range(max(len(returns[d]) for d in members)):
            at_k = [d for d in members if len(returns[d]) > k]
            values = np.array([returns[d][k] for d in at_k])
            if _degenerate(values):
                continue
            for d, v in zip(at_k, values - _mean(values)):
                out[d][k] = v
    return Advantages(tuple(a.astype(np.float32) for a in out), state)


def gae_1d(rewards_K: np.ndarray, values_K1: np.ndarray, gamma: float,
           lam: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE over the ``K`` turns of one trajectory; see :func:`gae`.

    Args: ``rewards_K`` ``float[K]``; ``values_K1`` ``float[K+1]`` (the last entry is the
    bootstrap value after the last turn: 0 if the episode ended, ``V(s_K)`` if truncated).
    Returns ``(advantages_K, returns_K)``, both ``float64[K]``.
    """
    rewards_K = np.asarray(rewards_K, dtype=np.float64)
    values_K1 = np.asarray(values_K1, dtype=np.float64)
    if values_K1.shape != (rewards_K.size + 1,):
        raise ValueError(f"values_K1 needs K+1 = {rewards_K.size + 1} entries, "
                         f"got shape {values_K1.shape}")
    deltas_K = rewards_K + gamma * values_K1[1:] - values_K1[:-1]
    advantages_K = discounted_returns(deltas_K, gamma * lam)
    return advantages_K, advantages_K + values_K1[:-1]


@register_advantage("gae", needs_values=True)
def gae(batch: EpisodeBatch, state: EmaState | None, config: Mapping[str, float]) -> Advantages:
    """Generalized advantage estimation over the turns of each trajectory, with a critic.

    ``delta_k = r_k + gamma V_{k+1} - V_k`` and ``A_k = sum_{l >= 0} (gamma lam)^l delta_{k+l}``
    (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", eq. 16), computed backwards as ``A_k = delta_k + gamma lam A_{k+1}``. The
    value targets are ``R_k = A_k + V_k`` (the lambda-return), returned in
    ``Advantages.value_targets``. ``lam = 1`` gives the discounted return minus ``V_k``;
    ``lam = 0`` the one-step TD error. Needs ``batch.values`` (``float[K_d + 1]`` each).

    Config: ``gamma`` (default 1.0) and ``lam`` (default 0.95), both in ``[0, 1]``.
    """
    gamma, lam = _gamma(config), _gamma(config, "lam", 0.95)
    assert batch.values is not None  # Estimator.__call__ checked
    pairs = [gae_1d(r, v, gamma, lam) for r, v in zip(batch.turn_rewards, batch.values)]
    return Advantages(tuple(a.astype(np.float32) for a, _ in pairs), state,
                      tuple(t.astype(np.float32) for _, t in pairs))


@register_advantage("exact_gae", needs_game_values=True)
def exact_gae(batch: EpisodeBatch, state: EmaState | None, config: Mapping[str, float]) -> Advantages:
    """:func:`gae` (Schulman et al. 2016, eq. 16) with the game's exact state values as the
    critic instead of a learned one.

    ``V_k`` is the game's value of turn ``k``'s state to the seat against the episode's
    scripted opponent, played well from there on (``batch.game_values``, 0 after the last
    turn; ``GameEval.state_values``). ``lam = 0`` gives each turn the one-step error
    ``r_k + gamma V_{k+1} - V_k``, how much its move (and the opponent's reply) lost against
    the best play, so a move is judged alone even when the game's outcome was decided by
    another; ``lam = 1`` gives the return minus ``V_k``, an exact baseline. Nothing is learned
    for the critic, and a game must value its states (tic-tac-toe does against ``random`` and
    ``tictactoe_minimax``): the game's own solution is the critic. The values are those of best
    play from each state on, not the current policy's, so with ``lam < 1`` a turn's expected
    advantage is ``Q*(s, a) - V*(s) <= 0``: how much worse than best its move was (0 for a
    best move), never a gain over the policy's own average.

    Config: ``gamma`` (default 1.0) and ``lam`` (default 0.95), both in ``[0, 1]``.
    """
    gamma, lam = _gamma(config), _gamma(config, "lam", 0.95)
    assert batch.game_values is not None  # Estimator.__call__ checked
    return Advantages(tuple(gae_1d(r, v, gamma, lam)[0].astype(np.float32)
                            for r, v in zip(batch.turn_rewards, batch.game_values)), state)
