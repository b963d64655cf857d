"""Quiet for a stream that p2pd drops before it starts.

For every incoming stream, p2pd opens a connection to this process's libp2p handle and
sends the stream's description first; hivemind's handler of those connections
(``ControlClient``) reads it with nothing around it, so when the daemon drops the stream
before sending it (the remote reset it, or gave up dialling) an ``IncompleteReadError``
escapes and asyncio logs an ERROR with a 10-line traceback, once per such stream, on
every peer (issue 34). Nothing is lost: no stream had started. ``quiet_dropped_streams``
makes the loop log those at DEBUG and leaves every other error to asyncio's handler.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["quiet_dropped_streams"]

logger = logging.getLogger(__name__)


def _handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    error = context.get("exception")
    if isinstance(error, asyncio.IncompleteReadError) and "client_connected_cb" in str(
        context.get("message", "")
    ):
        logger.debug("p2pd dropped an incoming stream before it started (%s)", error)
        return
    loop.default_exception_handler(context)


def quiet_dropped_streams(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Makes ``loop`` (default: the running one) log a stream p2pd dropped before it
    started at DEBUG instead of as an unhandled ERROR."""
    (loop or asyncio.get_running_loop()).set_exception_handler(_handler)
