"""Typed errors of kfac_stream. Every message names the offending field, value or file."""

from __future__ import annotations


class KFACStreamError(Exception):
    """Base class of every error raised by kfac_stream."""


class KFACConfigError(KFACStreamError, ValueError):
    """A configuration value is out of range or does not fit the model."""


class UnsupportedModuleError(KFACConfigError):
    """An explicitly included module is of a type kfac_stream cannot track."""


class SnapshotError(KFACStreamError):
    """A snapshot directory is incomplete, altered, or of an unknown format."""
