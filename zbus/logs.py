"""Logging set-up for zbus processes: one logger per module, and a prefix naming
the node and rank on every line of agents and workers."""

from __future__ import annotations

import logging
import os


def setup_logging(prefix: str = "", level: str | None = None) -> None:
    """Configure the root logger of a zbus process (agents, workers, CLI).
    ``level`` defaults to ``ZBUS_LOG_LEVEL`` (default WARNING)."""
    level = (level or os.environ.get("ZBUS_LOG_LEVEL") or "WARNING").upper()
    unknown = not isinstance(logging.getLevelName(level), int)  # a misspelt level must not stop a process
    tag = f"[{prefix}] " if prefix else ""
    logging.basicConfig(level="WARNING" if unknown else level, force=True,
                        format=f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s")
    if unknown:
        logging.getLogger("zbus").warning("log level %r unknown: WARNING", level)
