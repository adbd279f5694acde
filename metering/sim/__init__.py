"""A simulated upstream: a real HTTP server speaking each provider's dialect."""
