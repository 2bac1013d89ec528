"""Group-relative advantage estimators, registered by name.

An estimator maps the rewards of ONE group (the episodes of one ``group_id`` played by one
policy, see DESIGN §5) to one advantage per episode. The learner broadcasts that advantage
over the episode's sampled tokens (:mod:`learners.assembly`), so an estimator never sees
tokens, turns or lengths.

Estimators are pure: ``fn(rewards_G, config) -> advantages_G`` with ``G`` the group size. They
compute in float64 and return float32. A group whose rewards are all equal carries no signal;
every estimator returns exact zeros for it (a plain ``r - mean`` can leave ~1e-17 residues,
which would hide such groups from the ``frac_zero_adv_groups`` diagnostic).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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
