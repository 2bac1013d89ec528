"""Advantage estimators, registered by name: group-relative ones and stateful/turn-level ones.

An estimator maps the rewards of ONE group (the episodes of one ``group_id`` played by one
policy, see DESIGN §5) to one advantage per episode. The learner broadcasts that advantage
over the episode's sampled tokens (:mod:`learners.assembly`), so an estimator never sees
tokens, turns or lengths.

Estimators are pure: ``fn(rewards_G, config) -> advantages_G`` with ``G`` the group size. They
compute in float64 and return float32. A group whose rewards are all equal carries no signal;
every estimator returns exact zeros for it (a plain ``r - mean`` can leave ~1e-17 residues,
which would hide such groups from the ``frac_zero_adv_groups`` diagnostic).

Estimators that need more than one group's rewards live in :data:`SEQUENCE_ADVANTAGES`, each
with its own signature: moving-average baselines (``reinforce_ema``, ``role_ema``) take their
state in and return the new state (DESIGN §5: the learner actor owns and checkpoints it), and
turn-level credit (``turn_returns``, ``gae``) works on the ``K`` turns of one trajectory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

AdvantageFn = Callable[[np.ndarray, Mapping[str, float]], np.ndarray]
"""``fn(rewards_G float[G], config) -> advantages_G float32[G]``."""

ADVANTAGES: dict[str, AdvantageFn] = {}
"""Estimator name -> function; fill it with :func:`register_advantage`."""


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator that adds ``fn`` to :data:`ADVANTAGES` under ``name``.

    Raises:
        ValueError: ``name`` is already registered (a silent overwrite would change what a
            config means depending on import order).
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGES[name] = fn
        return fn

    return decorator


def _as_group(rewards_G: np.ndarray) -> np.ndarray:
    rewards_G = np.asarray(rewards_G, dtype=np.float64)
    if rewards_G.ndim != 1:
        raise ValueError(f"rewards_G must be 1-D, got shape {rewards_G.shape}")
    if not np.all(np.isfinite(rewards_G)):
        raise ValueError(f"rewards_G must be finite, got {rewards_G.tolist()}")
    return rewards_G


def _degenerate(rewards_G: np.ndarray) -> bool:
    """True when the group cannot rank its episodes: empty, one episode, or all rewards equal."""
    return rewards_G.size == 0 or bool(np.all(rewards_G == rewards_G[0]))


@register_advantage("dr_grpo")
def dr_grpo(rewards_G: np.ndarray, config: Mapping[str, float]) -> np.ndarray:
    """Dr. GRPO advantage: reward minus the group mean, without the std division.

    ``A_i = r_i - mean(r_1..r_G)`` (Liu et al. 2025, "Understanding R1-Zero-Like Training: A
    Critical Perspective", §3.2, the Dr. GRPO advantage: GRPO's ``Â_{i,t}`` with the
    ``std(r)`` division removed, since it up-weights groups whose rewards barely differ).

    Args:
        rewards_G: ``float[G]`` total rewards of one group.
        config: unused.

    Returns:
        ``float32[G]``; zeros for a group of size 1 or with equal rewards.
    """
    del config
    rewards_G = _as_group(rewards_G)
    if _degenerate(rewards_G):
        return np.zeros(rewards_G.shape, dtype=np.float32)
    return (rewards_G - rewards_G.mean()).astype(np.float32)


@register_advantage("grpo")
def grpo(rewards_G: np.ndarray, config: Mapping[str, float]) -> np.ndarray:
    """GRPO outcome-supervision advantage: the group-standardised reward.

    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the population std (``ddof=0``)
    (Shao et al. 2024, "DeepSeekMath", §4.1.2, outcome supervision:
    ``Â_{i,t} = r̃_i = (r_i - mean(r)) / std(r)``; ``eps`` is ours, for numerical safety).

    Args:
        rewards_G: ``float[G]`` total rewards of one group.
        config: ``eps`` (default ``1e-6``).

    Returns:
        ``float32[G]``; zeros for a group of size 1 or with equal rewards.
    """
    eps = float(config.get("eps", 1e-6))
    rewards_G = _as_group(rewards_G)
    if _degenerate(rewards_G):
        return np.zeros(rewards_G.shape, dtype=np.float32)
    centred_G = rewards_G - rewards_G.mean()
    return (centred_G / (rewards_G.std(ddof=0) + eps)).astype(np.float32)


@register_advantage("rloo")
def rloo(rewards_G: np.ndarray, config: Mapping[str, float]) -> np.ndarray:
    """REINFORCE leave-one-out (RLOO): reward minus the mean of the OTHER episodes' rewards.

    ``A_i = r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) (r_i - mean(r))``: the leave-one-out
    baseline of Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!", as
    the RLOO estimator of Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs" (their RLOO equation, without the
    ``1/G`` average, which the loss normalizer supplies). The baseline excludes episode ``i``,
    so it does not depend on episode ``i``'s actions and the gradient stays unbiased.

    Args:
        rewards_G: ``float[G]`` total rewards of one group.
        config: unused.

    Returns:
        ``float32[G]``; zeros for a group of size 1 (no other episode to form a baseline) or
        with equal rewards.
    """
    del config
    rewards_G = _as_group(rewards_G)
    if _degenerate(rewards_G):
        return np.zeros(rewards_G.shape, dtype=np.float32)
    size = rewards_G.size
    return (size / (size - 1) * (rewards_G - rewards_G.mean())).astype(np.float32)


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[int],
    estimator: str,
    config: Mapping[str, float],
) -> np.ndarray:
    """Apply ``estimator`` to each group of ``rewards`` separately.

    Args:
        rewards: ``[D]`` one total reward per trajectory.
        group_ids: ``[D]`` the trajectory's ``group_id``; groups need not be contiguous.
        estimator: a name in :data:`ADVANTAGES`.
        config: passed to the estimator unchanged.

    Returns:
        ``float32[D]`` advantages in input order. Within a group the estimator sees rewards in
        input order; every registered estimator is permutation-equivariant, so order does not
        change any value.

    Raises:
        ValueError: unknown estimator (naming the known ones), or lengths differ.
    """
    if estimator not in ADVANTAGES:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; known: {sorted(ADVANTAGES)}"
        )
    if len(rewards) != len(group_ids):
        raise ValueError(
            f"rewards and group_ids differ in length: {len(rewards)} != {len(group_ids)}"
        )
    fn = ADVANTAGES[estimator]
    rewards_D = np.asarray(rewards, dtype=np.float64)
    group_ids_D = np.asarray(group_ids, dtype=np.int64)
    advantages_D = np.zeros(len(rewards_D), dtype=np.float32)
    for gid in np.unique(group_ids_D):
        (index_G,) = np.nonzero(group_ids_D == gid)
        advantages_G = np.asarray(fn(rewards_D[index_G], config), dtype=np.float32)
        if advantages_G.shape != index_G.shape:
            raise ValueError(
                f"estimator {estimator!r} returned shape {advantages_G.shape} "
                f"for a group of {len(index_G)}"
            )
        advantages_D[index_G] = advantages_G
    return advantages_D


# ---------------------------------------------------------------------------------------------
# Estimators that need more than one group's rewards.

SEQUENCE_ADVANTAGES: dict[str, Callable[..., Any]] = {}
"""Name -> estimator whose signature differs from :data:`AdvantageFn` (state in, state out,
or per-turn); each function's docstring gives its own signature."""


def _register_sequence(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in SEQUENCE_ADVANTAGES or name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        SEQUENCE_ADVANTAGES[name] = fn
        return fn

    return decorator


def _decay(config: Mapping[str, float]) -> float:
    decay = float(config.get("decay", 0.9))
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    return decay


@dataclasses.dataclass(frozen=True)
class EmaState:
    """State of :func:`reinforce_ema`: the moving-average baseline, checkpointed by its owner."""

    baseline: float = 0.0
    """Current moving average of batch-mean rewards (starts at 0: no information)."""
    n_updates: int = 0
    """Number of batches folded in so far (for logging; the update does not use it)."""


@_register_sequence("reinforce_ema")
def reinforce_ema(
    rewards_D: np.ndarray, state: EmaState | None, config: Mapping[str, float]
) -> tuple[np.ndarray, EmaState]:
    """REINFORCE with a moving-average reward baseline: ``A_d = r_d - b``.

    The reinforcement baseline ``b`` of Williams 1992, "Simple Statistical Gradient-Following
    Algorithms for Connectionist Reinforcement Learning", §4 (the REINFORCE update
    ``Δw = α (r - b) e``), taken as an exponential moving average of past batch-mean rewards.

    The batch is scored against the baseline BEFORE the update (``state.baseline``), then
    ``b' = decay * b + (1 - decay) * mean(rewards_D)`` is returned. Using the pre-update value
    keeps ``b`` independent of this batch's actions, so the gradient stays unbiased (a
    post-update baseline leaks each episode's own reward into its baseline). With no state
    the baseline is 0, so the first batch sees raw rewards.

    Args:
        rewards_D: ``float[D]`` total rewards of one step's trajectories.
        state: the state returned by the previous call, or ``None`` for a fresh baseline.
        config: ``decay`` in ``[0, 1)`` (default 0.9).

    Returns:
        ``(advantages_D float32[D], new_state)``; an empty batch returns the state unchanged.
    """
    decay = _decay(config)
    rewards_D = _as_group(rewards_D)
    state = EmaState() if state is None else state
    advantages_D = (rewards_D - state.baseline).astype(np.float32)
    if rewards_D.size == 0:
        return advantages_D, state
    baseline = decay * state.baseline + (1.0 - decay) * float(rewards_D.mean())
    return advantages_D, EmaState(baseline=baseline, n_updates=state.n_updates + 1)


@_register_sequence("role_ema")
def role_ema(
    rewards_D: np.ndarray,
    roles_D: Sequence[str],
    state: Mapping[str, float] | None,
    config: Mapping[str, float],
) -> tuple[np.ndarray, dict[str, float]]:
    """Role-conditioned advantage estimation (RAE): one moving-average baseline per role key.

    ``A_d = r_d - b_{key_d}``, ``b_key <- decay * b_key + (1 - decay) * mean(r_d : key_d = key)``
    (Liu et al. 2025, "SPIRAL: Self-Play on Zero-Sum Games Incentivizes Reasoning via
    Multi-Agent Multi-Turn Reinforcement Learning", RAE: a baseline ``b_{G,p}`` per game ``G``
    and role ``p``, since in a zero-sum game the first and second player's expected returns
    differ and one shared baseline would credit the seat, not the play).

    A key is one string per (game, role), built by the caller (e.g. ``"kuhn_poker/player_0"``).
    As in :func:`reinforce_ema`, a batch is scored against the baselines BEFORE this batch's
    update (our choice, for the same unbiasedness reason); a key never seen before starts at 0.
    Each key is updated once per call, with the mean of its rewards in this batch; keys absent
    from the batch keep their value.

    Args:
        rewards_D: ``float[D]`` total rewards.
        roles_D: ``[D]`` the (game, role) key of each reward.
        state: key -> baseline returned by the previous call, or ``None``. Not mutated.
        config: ``decay`` in ``[0, 1)`` (default 0.9).

    Returns:
        ``(advantages_D float32[D], new_state)`` with ``new_state`` a new dict.
    """
    decay = _decay(config)
    rewards_D = _as_group(rewards_D)
    if len(roles_D) != rewards_D.size:
        raise ValueError(
            f"rewards_D and roles_D differ in length: {rewards_D.size} != {len(roles_D)}"
        )
    old = dict(state or {})
    baselines_D = np.array([old.get(role, 0.0) for role in roles_D], dtype=np.float64)
    new = dict(old)
    roles = np.asarray(list(roles_D), dtype=object)
    for role in sorted(set(roles_D)):
        mean = float(rewards_D[roles == role].mean())
        new[role] = decay * old.get(role, 0.0) + (1.0 - decay) * mean
    return (rewards_D - baselines_D).astype(np.float32), new


def _gamma(config: Mapping[str, float], key: str = "gamma", default: float = 1.0) -> float:
    value = float(config.get(key, default))
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{key} must be in [0, 1], got {value}")
    return value


@_register_sequence("turn_returns")
def turn_returns(rewards_K: np.ndarray, config: Mapping[str, float]) -> np.ndarray:
    """Discounted return-to-go of each turn of one trajectory (turn-level credit).

    ``G_k = sum_{j >= k} gamma^{j-k} r_j`` (Sutton & Barto 2018, "Reinforcement Learning: An
    Introduction", eq. 3.8), computed backwards as ``G_k = r_k + gamma G_{k+1}``. Each turn's
    sampled tokens then get ``G_k`` (or ``G_k`` minus a baseline) instead of the episode total,
    so a reward at turn ``k`` credits only turns ``<= k``.

    Args:
        rewards_K: ``float[K]`` reward received after each of the trajectory's ``K`` turns.
        config: ``gamma`` in ``[0, 1]`` (default 1.0).

    Returns:
        ``float32[K]`` returns.
    """
    gamma = _gamma(config)
    rewards_K = _as_group(rewards_K)
    returns_K = np.zeros_like(rewards_K)
    running = 0.0
    for k in range(rewards_K.size - 1, -1, -1):
        running = rewards_K[k] + gamma * running
        returns_K[k] = running
    return returns_K.astype(np.float32)


@_register_sequence("gae")
def gae(
    rewards_K: np.ndarray, values_K1: np.ndarray, config: Mapping[str, float]
) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation over the turns of one trajectory.

    ``delta_k = r_k + gamma V_{k+1} - V_k`` and ``A_k = sum_{l >= 0} (gamma lam)^l delta_{k+l}``
    (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", eq. 16), computed backwards as ``A_k = delta_k + gamma lam A_{k+1}``. The
    value targets are ``R_k = A_k + V_k`` (the lambda-return). ``lam = 1`` gives the discounted
    return minus ``V_k``; ``lam = 0`` the one-step TD error.

    Args:
        rewards_K: ``float[K]`` reward after each turn.
        values_K1: ``float[K+1]`` value estimate before each turn, plus the bootstrap value
            after the last turn (0 if the episode ended there, V(s_K) if it was truncated).
        config: ``gamma`` (default 1.0) and ``lam`` (default 0.95), both in ``[0, 1]``.

    Returns:
        ``(advantages_K float32[K], returns_K float32[K])``.
    """
    gamma = _gamma(config)
    lam = _gamma(config, "lam", 0.95)
    rewards_K = _as_group(rewards_K)
    values_K1 = _as_group(values_K1)
    if values_K1.size != rewards_K.size + 1:
        raise ValueError(
            f"values_K1 needs K+1 = {rewards_K.size + 1} entries, got {values_K1.size}"
        )
    deltas_K = rewards_K + gamma * values_K1[1:] - values_K1[:-1]
    advantages_K = np.zeros_like(rewards_K)
    running = 0.0
    for k in range(rewards_K.size - 1, -1, -1):
        running = deltas_K[k] + gamma * lam * running
        advantages_K[k] = running
    returns_K = advantages_K + values_K1[:-1]
    return advantages_K.astype(np.float32), returns_K.astype(np.float32)
