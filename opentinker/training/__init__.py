"""Training: learner actors, trajectory logs and offline jobs (the only place that turns trajectories into forward_backward)."""
