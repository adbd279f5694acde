"""Alerts before the wall: budget thresholds, soft limits and signed webhooks (docs/operator/alerts.md)."""
