"""Tracker extensions (`base.TrackerExtension`): what the tracker streams besides the factors,
attached at declared points of the run. Each built-in one is a package of its own
(`kfac_stream.ekfac`), registered when ``kfac_stream`` is imported."""

from .base import (
    ExtensionExport,
    TrackerExtension,
    extensions_for,
    register_extension,
    unregister_extension,
)

__all__ = ["ExtensionExport", "TrackerExtension", "extensions_for", "register_extension",
           "unregister_extension"]
