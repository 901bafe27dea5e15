"""Snapshots: atomic, verifiable directories of factors (and, later, their eigenbases)."""
