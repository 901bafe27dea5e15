"""Queries of a snapshot: the Laplace posterior over the tracked weights."""
