"""Rollout: env runners, episodes, and rendering observations to tokens (the only place that drives games)."""
