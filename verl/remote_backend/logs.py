"""The loggers of the generic layer and of the adapters, at verl's level.

verl sets each of its modules' loggers to ``VERL_LOGGING_LEVEL``; :func:`module_logger` does the same for
ours (default ``INFO``: the rollout server's batch lines and the trainer's progress show), in one place.
"""

from __future__ import annotations

import logging
import os

__all__ = ["LEVEL_VARIABLE", "module_logger"]

#: the environment variable verl reads its log level from
LEVEL_VARIABLE = "VERL_LOGGING_LEVEL"


def module_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` set to ``$VERL_LOGGING_LEVEL`` (``INFO`` when unset)."""
    logger = logging.getLogger(name)
    logger.setLevel(os.getenv(LEVEL_VARIABLE, "INFO"))
    return logger
