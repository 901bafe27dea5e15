"""Snapshots: atomic, verifiable directories of factors and their eigenbases (computed in the
run, or at a snapshot's first use and cached beside it: `eigen_sidecar`, imported here so that
`snapshot.Snapshot.eigen` can reach it)."""

from . import eigen_sidecar  # noqa: F401 (sets Snapshot.eigen_source)
