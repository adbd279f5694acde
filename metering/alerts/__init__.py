"""Alerts before the wall: budget thresholds, soft limits and signed webhooks (see README)."""
