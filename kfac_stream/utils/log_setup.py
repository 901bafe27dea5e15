"""Where kfac_stream's log lines go when a script configured no logging.

The tracker logs through the ``kfac_stream`` logger: its one-line summary at train begin
(layers, factors, memory per rank, snapshot directory), each snapshot's path, warnings. Python
shows only warnings of a logger nobody configured; `show_info_by_default` gives the
``kfac_stream`` logger a plain stderr handler at INFO in exactly that case, so a user's own
``Trainer`` script prints those lines. A script that configures logging (``basicConfig``, a
handler of its own, ``logging.getLogger("kfac_stream").setLevel(...)``) decides for itself.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "kfac_stream"


def show_info_by_default() -> logging.Logger:
    """The ``kfac_stream`` logger, given a stderr handler at INFO when neither it nor any of its
    ancestors has a handler and its level is unset (nothing configured logging)."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.level == logging.NOTSET and not logger.hasHandlers():
        handler = logging.StreamHandler()  # stderr, like the Trainer's progress bar
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return logger
