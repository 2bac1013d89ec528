"""Learning algorithms as pure functions: advantage estimators, losses and assembly.

Imports only torch, numpy, the standard library and :mod:`protocols` (DESIGN §5), so the
scheduler (which runs losses) and the learner actor (which assembles datums) share one
definition of every algorithm. Two registries, each with one calling convention:

* :data:`ADVANTAGES`: ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_ema``, ``role_ema``,
  ``turn_returns``, ``gae``, ``exact_gae``; ``fn(EpisodeBatch, state, config) -> Advantages``.
* :data:`LOSSES`: ``ppo``, ``importance_sampling``, ``cispo``, ``value``, ``entropy``,
  ``kl_k1``, ``kl_k2``, ``kl_k3``, ``move_values``, ``dpo``, ``ipo``, ``sft``; ``fn(logp_N, inputs, config) ->
  LossOutput``.

Beside them, :func:`all_actions_weights` and :func:`all_actions_datums`: the exact
all-actions update of a game whose payoff is known exactly (Kuhn poker), as datums; and
:mod:`learners.move_values`, the ``move_values`` term (every legal move at each decision played
moved by the game's exact value of it).
"""

from learners.advantages import (
    ADVANTAGES,
    Advantages,
    EmaState,
    EpisodeBatch,
    Estimator,
    discounted_returns,
    estimate,
    gae_1d,
    register_advantage,
    standardize,
)
from learners.aggregation import sequence_mean, token_sum
from learners.all_actions import all_actions_datums, all_actions_weights
from learners.assembly import (
    Assembly,
    assemble,
    decision_positions,
    episode_batch,
    loss_token_count,
    sort_trajectories,
    trajectory_to_datum,
    trajectory_tokens,
    turn_rewards,
    with_value_inputs,
)
from learners.diagnostics import (
    explained_variance,
    logprob_mismatch,
    policy_diagnostics,
)
from learners.losses import (
    LOSSES,
    Loss,
    LossKind,
    LossOutput,
    compute_loss,
    losses_of_kind,
    register_loss,
    split_terms,
    term_config,
)
from learners.move_values import MOVE_INPUTS, move_weights, with_move_inputs
from learners.offline import pair_datums, preference_pairs, sft_datums
from learners.preferences import chunked_token_logprobs, dpo, ipo

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "MOVE_INPUTS",
    "Advantages",
    "Assembly",
    "EmaState",
    "EpisodeBatch",
    "Estimator",
    "Loss",
    "LossKind",
    "LossOutput",
    "all_actions_datums",
    "all_actions_weights",
    "assemble",
    "chunked_token_logprobs",
    "compute_loss",
    "decision_positions",
    "discounted_returns",
    "dpo",
    "episode_batch",
    "estimate",
    "explained_variance",
    "gae_1d",
    "ipo",
    "logprob_mismatch",
    "loss_token_count",
    "losses_of_kind",
    "move_weights",
    "pair_datums",
    "policy_diagnostics",
    "preference_pairs",
    "register_advantage",
    "register_loss",
    "sequence_mean",
    "sft_datums",
    "sort_trajectories",
    "split_terms",
    "term_config",
    "standardize",
    "token_sum",
    "trajectory_to_datum",
    "trajectory_tokens",
    "turn_rewards",
    "with_move_inputs",
    "with_value_inputs",
]
