"""The `shoal` logger's handler and format (library modules just use logging.getLogger)."""

from __future__ import annotations

import logging

from shoal import envs

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def configure_logging() -> None:
    logger = logging.getLogger("shoal")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(envs.SHOAL_LOGGING_LEVEL.upper())
    logger.propagate = False
