"""The outbox: alert events fanned out to webhooks and delivered by every replica."""
