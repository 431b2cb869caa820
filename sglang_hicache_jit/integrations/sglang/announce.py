"""The plugin's start line, logged where the process shows it.

SGLang runs its plugins before it configures logging, in the engine and in each scheduler, so an INFO
line logged from ``register()`` is dropped there. ``start_line`` logs at once where logging is already
configured (a handler is reachable and INFO passes), and otherwise keeps the line until ``flush()``,
which the plugin calls when the first host pool is built or the first transfer path is chosen: by then
SGLang has configured logging in that process.
"""

from __future__ import annotations

import logging
import threading

_pending: list = []  # at most one (logger, message, args)
_lock = threading.Lock()


def start_line(logger: logging.Logger, message: str, *args) -> bool:
    """Logs ``message`` at INFO now if that would be shown, else keeps it for ``flush()``; True if logged."""
    with _lock:
        if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
            _pending.clear()
            logger.info(message, *args)
            return True
        _pending[:] = [(logger, message, args)]
        return False


def flush() -> None:
    """Logs the kept start line, once."""
    with _lock:
        if not _pending:
            return
        logger, message, args = _pending.pop()
    logger.info(message, *args)


def pending() -> bool:
    return bool(_pending)
