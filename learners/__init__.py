"""Learning algorithms as pure functions: advantage estimators, losses and assembly.

Imports only torch, numpy, the standard library and :mod:`protocols` (DESIGN §5), so the
scheduler (which runs losses) and the learner actor (which assembles datums) share one
definition of every algorithm.
"""

from learners.advantages import ADVANTAGES, group_advantages, register_advantage
from learners.assembly import assemble, loss_token_count, trajectory_to_datum
from learners.losses import LOSSES, LossOutput, compute_loss, register_loss

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "LossOutput",
    "assemble",
    "compute_loss",
    "group_advantages",
    "loss_token_count",
    "register_advantage",
    "register_loss",
    "trajectory_to_datum",
]
