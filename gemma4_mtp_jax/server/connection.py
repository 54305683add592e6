"""HTTP/1.1 connections a slow or silent client cannot hold open: uvicorn's h11 protocol with deadlines.

uvicorn closes idle keep-alive connections, but puts no limit on how long a client may take to send a request:
one that sends half its headers, or headers and half its body, and then waits, holds its connection (and, mid-body,
a handler waiting on it) for as long as it likes; a few thousand such clients exhaust the server. Here a request's
head must arrive in full within `header_timeout` seconds of the connection opening or of its first byte (on a
kept-alive connection), and its body within `body_timeout` seconds of the end of its head. Past a deadline the
connection is closed: with a 408 for a head that never completed (so the client learns why); a body cut short is a
client that went away for the handler reading it (counted as 499 there).

h11 already bounds a head's size (16 KiB) and refuses malformed requests; uvicorn's plain-text 400 for those is
replaced by a JSON one in the API's error format. `max_connections` is uvicorn's `limit_concurrency` (a request on a
connection beyond that many, or beyond that many requests in progress, gets 503 and its connection is closed),
answered in JSON here too. The 400, 408 and 503 are counted in the request metrics under the endpoint "other". The
server always runs this protocol, httptools or not, so the deadlines always hold.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gemma4_mtp_jax.server.errors import APIError, json_bytes

log = logging.getLogger(__name__)


def error_bytes(e: APIError) -> bytes:
    """A whole HTTP/1.1 response for `e` that closes the connection (for answers outside any request cycle)."""
    body = json_bytes(e.body())
    reason = {400: b"Bad Request", 408: b"Request Timeout"}.get(e.status, b"Error")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (e.status, reason, len(body)) + body)


def guarded_h11_protocol(header_timeout: float, body_timeout: float, count: Callable[[int], None] | None = None,
                         max_connections: int | None = None) -> type[H11Protocol]:
    """An H11Protocol class (for uvicorn.Config(http=...)) with these deadlines and connection limit; `count(status)`
    is called for each response it answers itself."""

    async def too_many_connections(scope, receive, send) -> None:
        body = json_bytes(APIError(503, f"The server is serving as many connections as it takes ({max_connections}); "
                                        f"retry later", code="too_many_connections").body())
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
        if count is not None:
            count(503)

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._app = self.app
            self._deadline: asyncio.TimerHandle | None = None
            self._waiting_for: str | None = None  # "headers" | "body"

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._waiting_for = what
            self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._waiting_for = None, None

        def _track(self) -> None:
            """Arm or disarm after the parser moved on; their_state says what of the request is still to come."""
            state = self.conn.their_state
            if state is h11.IDLE:
                if self._waiting_for == "body":  # that request is done; its keep-alive successor is not begun
                    self._disarm()
                if self._waiting_for is None and self.conn.trailing_data[0]:  # part of the next head is here
                    self._arm("headers", header_timeout)
            elif state is h11.SEND_BODY:
                if self._waiting_for != "body":
                    self._arm("body", body_timeout)
            else:
                self._disarm()

        def _expired(self, what: str, seconds: float) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            log.info("closing the connection from %s: the request's %s did not arrive within %gs",
                     "%s:%d" % self.client if self.client else "?", what, seconds)
            if what == "headers":
                self.transport.write(error_bytes(APIError(
                    408, f"The request's headers did not arrive within {seconds:g}s", code="request_timeout")))
                if count is not None:
                    count(408)
            self.transport.close()

        # asyncio.Protocol / H11Protocol
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm("headers", header_timeout)  # a connection that never sends a byte is held no longer

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._waiting_for is None and self.conn.their_state is h11.IDLE:
                self._arm("headers", header_timeout)  # a kept-alive connection begins its next request
            super().data_received(data)

        def handle_events(self) -> None:
            if max_connections is not None:  # the app a request parsed now goes to (uvicorn's limit_concurrency rule)
                full = len(self.connections) > max_connections or len(self.tasks) >= max_connections
                self.app = too_many_connections if full else self._app
            super().handle_events()
            self._track()

        def send_400_response(self, msg: str) -> None:
            self._disarm()
            self.transport.write(error_bytes(APIError(400, msg, code="invalid_http")))
            if count is not None:
                count(400)
            self.transport.close()

    return GuardedH11Protocol
