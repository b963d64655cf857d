"""A stream that p2pd drops before it starts is logged at DEBUG, not as an unhandled ERROR
(issue 34: every peer logged a 10-line traceback whenever another peer connected)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from fusionp2p.net.dropped_streams import quiet_dropped_streams


def test_a_dropped_stream_is_quiet_and_any_other_error_is_not(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        quiet_dropped_streams(loop)
        with caplog.at_level(logging.DEBUG):
            loop.call_exception_handler(
                {
                    "message": "Unhandled exception in client_connected_cb",
                    "exception": asyncio.IncompleteReadError(b"", 4),
                }
            )
            assert [r.levelno for r in caplog.records] == [logging.DEBUG]
            caplog.clear()
            loop.call_exception_handler(
                {"message": "Task exception was never retrieved", "exception": KeyError(1)}
            )
            loop.call_exception_handler(
                {"message": "Unhandled exception in client_connected_cb", "exception": ValueError("x")}
            )
        assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]
    finally:
        loop.close()
