"""Evaluation: statistics, reports and plots (the only place that draws pictures)."""
