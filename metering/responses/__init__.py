"""Stored responses of the Responses API: what a response with `store` true keeps (its input
items, instructions, output, model and usage), who may read it, and how long it is kept."""
