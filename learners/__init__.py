"""Learning algorithms as pure functions: advantage estimators, losses and assembly.

Imports only torch, numpy, the standard library and :mod:`protocols` (DESIGN §5), so the
scheduler (which runs losses) and the learner actor (which assembles datums) share one
definition of every algorithm.
"""

from learners.advantages import (
    ADVANTAGES,
    SEQUENCE_ADVANTAGES,
    EmaState,
    gae,
    group_advantages,
    register_advantage,
    reinforce_ema,
    role_ema,
    turn_returns,
)
from learners.aggregation import sequence_mean, token_sum
from learners.assembly import assemble, loss_token_count, trajectory_to_datum
from learners.losses import (
    LOSSES,
    OBJECTIVES,
    LossOutput,
    compute_loss,
    register_loss,
    register_objective,
)
from learners.preferences import chunked_token_logprobs, dpo, ipo

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "OBJECTIVES",
    "SEQUENCE_ADVANTAGES",
    "EmaState",
    "LossOutput",
    "assemble",
    "chunked_token_logprobs",
    "compute_loss",
    "dpo",
    "gae",
    "group_advantages",
    "ipo",
    "loss_token_count",
    "register_advantage",
    "register_loss",
    "register_objective",
    "reinforce_ema",
    "role_ema",
    "sequence_mean",
    "token_sum",
    "trajectory_to_datum",
    "turn_returns",
]
