"""ckptguard's own logger, and the few lines a user must see without configuring logging.

Resume from step N, FRESH START and committed step N are logged on the ``ckptguard`` logger.
Library code never touches the root logger; when the application has configured none (no
handler on the root), ``_DefaultHandler`` writes those records to stderr, so the resume line
is never invisible. As soon as the application configures logging, its handlers get the
records through propagation and ours stays silent (no line printed twice).

Silence them with ``logging.getLogger("ckptguard").setLevel(logging.WARNING)``, or with
``CKPTGUARD_QUIET=1`` in the environment.
"""

from __future__ import annotations

import logging
import os
import sys

NAME = "ckptguard"


class _DefaultHandler(logging.Handler):
    """stderr for ckptguard's records, only while the application has no logging of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        own = [h for h in logging.getLogger(NAME).handlers if h is not self]
        if own or logging.getLogger().handlers or os.environ.get("CKPTGUARD_QUIET"):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # a closed stderr must never fail a save or a restore
            self.handleError(record)


def logger() -> logging.Logger:
    """The ``ckptguard`` logger, with the default stderr handler installed once."""
    log = logging.getLogger(NAME)
    if not any(isinstance(h, _DefaultHandler) for h in log.handlers):
        log.addHandler(_DefaultHandler(logging.INFO))
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)  # the user-facing lines are INFO; only our own logger is set
    return log
