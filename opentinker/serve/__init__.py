"""Serving: one long-lived scheduler for many jobs (``opentinker serve``), and an
OpenAI-compatible HTTP endpoint in front of it."""
