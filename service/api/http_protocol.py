"""The HTTP/1.1 protocol `shortlist serve` runs: uvicorn's httptools protocol with limits on what a
client may hold before its request reaches the app.

uvicorn has none of these for httptools (its header size limit exists only for the slower h11
parser, which answered ~25% fewer requests a second here, and httptools buffers a whole header
before it hands it over): a socket that never sends a request was kept forever, so idle
sockets could exhaust the process's file descriptors; a header sent a byte at a time, or 100 MB
long, was read to its end. Here, with the byte counting done before the parser sees the data:
- more than `max_connections` open connections: the new one gets a 503 and is closed;
- a request head (request line and headers) must be complete within `max_header_bytes` (431,
  closed, the rest never read) and within `header_timeout_s` of its first byte, or of the
  connection for its first request (408 if some of it came, else closed silently). A head that
  starts in the read that ends the request before it is measured as the parser hands it over, as
  written canonically ("name: value" lines): no byte count sees where that request ended (httptools
  does not say), and such a head went uncounted (up to a read, 256 KiB);
- a body must be complete within `body_timeout_s` of its head (408, closed), or of its request's
  start for one pipelined behind another (uvicorn reads none of it while it waits);
- a response the client does not read (the transport's buffer past its high-water mark, uvicorn
  waiting in FlowControl.drain) for `send_timeout_s` closes the connection: its request in
  progress is counted 499 and the requests pipelined behind it are dropped unanswered;
- a request the HTTP parser refuses (a malformed request line or header, a Content-Length that is
  not a number or sits beside Transfer-Encoding, a bad chunk size) gets 400 with the one error
  body naming what the parser found, not uvicorn's plain-text "Invalid HTTP request received.";
- a refusal comes after the answers to the requests received whole before the refused one: HTTP/1.1
  answers in request order, and those requests are carried out (a label added), so their answers
  must not be lost to the close (they were: audit 6). Until then nothing more is parsed (what
  comes is read and dropped); the wait is the earlier requests' own (as long as a client sending
  only those would hold the connection, and `send_timeout_s` for one that reads none of their
  answers). A request refused mid-body while pipelined behind another is never started. After
  answers, a refusal closes the lingering way (below), not to reset them away;
- a connection closed after an answer given before its request's body was read (a 413, or any
  answer to a client that sent `Connection: close`) closes its sending side only and reads and
  drops the rest of the body for at most `body_timeout_s` (a lingering close, as nginx and Apache
  make): closed at once, unread data made the kernel reset the connection, and a client still
  sending (Python's urllib, 4 MiB and more) lost the answer to "connection reset by peer".

When a connection is lost while a request is in progress, the request's scope state says so
(CLIENT_GONE, read by service.api.observability: 499) and the callback it may have left there
(ON_CLIENT_GONE: service.api.batching takes a waiting request out of the engine's line) is
called: the app learns its client left without polling. uvicorn marks only the newest request
of a connection (a pipelined one) as disconnected, not the one running; here the running one is.

What is refused here never reaches the app's middleware: it is counted here
(`shortlist_http_connections_refused_total{reason}`, with `shortlist_http_connections_open`) and
written to the access log as a `connection_refused` line, at most REFUSAL_LINES_PER_S a second
(a flood of refused connections must not become a flood of log lines; the next line says how many
were left out).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from service.api.cors import refusal_headers
from service.api.errors import error_json

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}
_HEAD_END = b"\r\n\r\n"
# Set in a request's scope state when its body timed out (the app then sees the client gone).
BODY_TIMED_OUT = "body_timed_out"
# Set in a request's scope state when its connection was lost before its response was complete.
CLIENT_GONE = "client_gone"
# A request's scope state may hold a callback here, called once if CLIENT_GONE is set.
ON_CLIENT_GONE = "on_client_gone"
# A scope key: the request's connection (a GuardedHttpToolsProtocol; see on_headers_complete).
CONNECTION = "shortlist.connection"

REFUSAL_LINES_PER_S = 10
_access_log = logging.getLogger("shortlist.access")


class _ClientCausedWarnings(logging.Filter):
    """Drops uvicorn's warnings that any client causes at will, one per request: a request the
    parser refuses is logged here as a rate-limited `connection_refused` line; one asking for an
    upgrade (WebSocket) is answered as plain HTTP, nothing an operator acts on."""

    DROPPED = ("Invalid HTTP request received.", "Unsupported upgrade request.", "No supported WebSocket library")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and str(record.msg).startswith(self.DROPPED))


_CLIENT_CAUSED_WARNINGS = _ClientCausedWarnings()


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head past the limit (httptools hands it on
    as the context of its HttpParserCallbackError, which uvicorn gives to send_400_response)."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above (a subclass per server sets them)."""

    max_connections = 1000
    header_timeout_s = 10.0
    max_header_bytes = 32_768
    body_timeout_s = 30.0
    send_timeout_s = 30.0
    log_refusals = True  # not `access_log`: uvicorn's protocol sets that for its own log (off here)
    cors_origins = ""  # the origins whose pages may read a refusal too (service.api.cors)
    _log_second, _log_lines, _log_left_out = 0, 0, 0  # this process's refusal lines in the current second

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._reading_head = True
        self._tail = b""
        self._head_begun = False  # the parser has seen the current head's first byte
        self._ended_in_read = False  # a request ended in the read being parsed
        self._head_after_end = False  # the current head began in the read that ended the one before
        self._timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._running: RequestResponseCycle | None = None  # the request whose app runs now
        self._dropping = False  # what comes is read and dropped, unparsed: answered already, or refused
        self._refusal: bytes | None = None  # written once the requests received before it are answered
        connection_metrics().open.inc()
        if len(self.connections) > self.max_connections:
            self._refuse(503, "too_many_connections", f"the server holds {self.max_connections} connections",
                         reason="max_connections")
            return
        self._timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)  # a first request

    def connection_lost(self, exc: Exception | None) -> None:
        connection_metrics().open.dec()
        self._disarm()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        running, self._running = self._running, None
        if running is not None and not running.response_complete:
            running.disconnected = True  # its send() returns at once, writing nothing
            state = running.scope["state"]
            state[CLIENT_GONE] = True
            client_gone = state.pop(ON_CLIENT_GONE, None)
            if client_gone is not None:
                client_gone()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        """The client has read nothing of what waits for it for send_timeout_s: what it holds
        (the unsent answer, the request waiting to write the next one, the requests pipelined
        behind) is let go. abort(), not close(): asyncio's close() waits for the buffer to be sent."""
        self._send_timer = None
        self.transport.abort()

    def abandon(self) -> None:
        """Close the connection at once without answering its running request, whose app gives
        up (cancelled at shutdown): uvicorn then neither answers nor logs it."""
        if self._running is not None:
            self._running.disconnected = True
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return
        if self._reading_head and not self.transport.is_closing():
            tail = self._tail
            end = (tail + data).find(_HEAD_END) if tail else data.find(_HEAD_END)
            self._head_bytes += len(data) if end < 0 else end + len(_HEAD_END) - len(tail)
            if self._head_bytes > self.max_header_bytes:
                self._refuse_head_too_large()
                return
            self._tail = (tail + data)[-(len(_HEAD_END) - 1):] if end < 0 else b""
        if self.transport.is_closing():
            return
        self._ended_in_read = False
        super().data_received(data)
        if self._head_after_end and self._reading_head and not self._dropping:
            # A lower bound (the header the parser holds unfinished is not handed over yet); the
            # reads to come are counted on top of it.
            self._head_bytes = self._parsed_head_bytes(with_method=False)
            if self._head_bytes > self.max_header_bytes:
                self._refuse_head_too_large()
                return
        # Timers only for what is still incomplete once this data is parsed: a request that
        # arrives whole (the usual case) costs none.
        if self._timer is None and not self._dropping and not self.transport.is_closing():
            if self._reading_head and (self._head_bytes or self._head_begun):
                self._timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)
            elif not self._reading_head and self.cycle is self._running:
                # (a pipelined request's body is not read until it starts: its timer starts then)
                self._timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        self._head_after_end = self._ended_in_read

    def _parsed_head_bytes(self, *, with_method: bool = True) -> int:
        """The size of the head parsed so far as written canonically: request line, "name: value"
        lines, the blank line."""
        line = len(self.url) + len(b"  HTTP/1.1\r\n") + (len(self.parser.get_method()) if with_method else 0)
        return line + sum(len(name) + len(value) + 4 for name, value in self.headers) + 2

    def on_headers_complete(self) -> None:
        if self._head_after_end and self._parsed_head_bytes() > self.max_header_bytes:
            raise _HeadTooLarge
        self._reading_head = False
        self._disarm()
        # The connection, for the app: its `tasks` are the server's requests in progress (uvicorn's
        # task per request, this one's included once it starts), with which the batcher computes
        # a lone request at once (service.api.batching); abandon() at shutdown.
        self.scope[CONNECTION] = self  # type: ignore[typeddict-unknown-key]
        previous = self.cycle
        super().on_headers_complete()
        if previous is None or previous.response_complete:  # else pipelined: it starts in on_response_complete
            self._running = self.cycle
        if not self.cycle.keep_alive and _has_body(self.headers):
            self.cycle.transport = _CloseAfterBody(self)

    def close_after_body(self) -> None:
        """Close once the request's body is read (the lingering close of the module's docstring)."""
        if self._reading_head or self.transport.is_closing() or not self.transport.can_write_eof():
            self.transport.close()  # the body was read whole: nothing unread to reset the connection
            return
        self._close_lingering()

    def _close_lingering(self) -> None:
        """Close the sending side, then read and drop what comes for at most body_timeout_s:
        unread data at the close would make the kernel reset the connection, and the client lose
        the answers sent before it had read them."""
        self._dropping = True
        self._disarm()
        self.transport.write_eof()  # after the answers are sent: the client reads them, then closes
        self._timer = self.loop.call_later(self.body_timeout_s, self.transport.close)

    def on_response_complete(self) -> None:
        started = None
        if self.pipeline and not self.transport.is_closing():
            started = self._running = self.pipeline[-1][0]  # the pipelined request uvicorn starts now
        elif self._refusal is not None:
            self._send_refusal(linger=True)  # the last request received before the refused one is answered
        super().on_response_complete()
        if started is self.cycle and not self._reading_head and not self._dropping:
            # Its body, still to come, was not read while it waited (uvicorn paused reading): its
            # time starts now.
            self._timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)

    def shutdown(self) -> None:
        """uvicorn's closes after the newest request's answer, which a refused one never gets:
        here after the last answer before it (the refusal then goes unwritten)."""
        if self._refusal is None:
            super().shutdown()
            return
        last = self.pipeline[0][0] if self.pipeline else self._running
        if last is None or last.response_complete:
            self.transport.close()
        else:
            last.keep_alive = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._reading_head, self._head_bytes, self._tail = True, 0, b""
        self._head_begun, self._head_after_end, self._ended_in_read = False, False, True

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._head_bytes:
            self._refuse(408, "request_timeout", f"the request head did not arrive within {self.header_timeout_s:g} s",
                         reason="header_timeout")
        else:
            self.transport.close()  # never sent anything: nothing to answer

    def _body_timed_out(self) -> None:
        """A body trickling in would hold an engine slot and SIGTERM's drain as long as the
        client likes. The app, waiting for the rest, sees the client gone; its request is
        counted as this 408 (service.api.observability reads the mark)."""
        self._timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()  # answered already (e.g. 413): the rest of the body is not wanted
            return
        state = self.scope.get("state", {})
        state[BODY_TIMED_OUT] = True
        self._refuse(408, "request_timeout", f"the body did not arrive within {self.body_timeout_s:g} s",
                     state.get("request_id"), reason="body_timeout")

    def _refuse_head_too_large(self) -> None:
        self._refuse(431, "headers_too_large", f"the request line and headers exceed {self.max_header_bytes} bytes",
                     reason="header_too_large")

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this from the `except httptools.HttpParserError` of data_received: the
        exception in hand says what was wrong (e.g. "Transfer-Encoding can't be present with
        Content-Length", "Invalid character in chunk size")."""
        exc = sys.exc_info()[1]
        if exc is not None and isinstance(exc.__context__, _HeadTooLarge):
            self._refuse_head_too_large()
            return
        reason = str(exc) if exc is not None and str(exc) else msg
        self._refuse(400, "malformed_http", f"the request is not valid HTTP/1.1: {reason}", reason="malformed")

    def _refuse(self, status: int, code: str, message: str, request_id: str | None = None, *,
                reason: str) -> None:
        """Answer with the one error body and close, whatever the parser was in the middle of, once
        the requests received before this one are answered (the module's docstring); counted by
        `reason`, and logged unless the app logs it (a body timeout's request is the app's)."""
        self._disarm()
        connection_metrics().refused.labels(reason).inc()
        if self.log_refusals and reason != "body_timeout":
            self._log_refusal(status, code, reason)
        body = error_json(code, message, [], request_id)
        # The refused request's Origin, once its head began (a refusal before it has no request).
        origin = next((v for n, v in self.headers if n == b"origin"), None) if self._head_begun else None
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
                *(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers),
                *(name + b": " + value + b"\r\n" for name, value in refusal_headers(self.cors_origins, origin)),
                b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)]
        self._refusal = b"".join(head) + body
        self._dropping = True  # the parser is past what it can read, or at a head not to be read
        # The refused request: the one whose body was being read, if any (its head parsed, it has
        # a cycle); else one whose head was.
        refused = None if self._reading_head else self.cycle
        if not self._answers_before(refused):
            # Lingering if answers went out before (the client may not have read them yet); else
            # the refusal is its only answer, and the rest of what it sends is not read.
            self._send_refusal(linger=self._running is not None and self._running is not refused)

    def _answers_before(self, refused: RequestResponseCycle | None) -> bool:
        """Whether requests received before the refused one still wait for their answers (the
        refused one, pipelined, is taken out of uvicorn's line, never to start)."""
        for entry in self.pipeline:
            if entry[0] is refused:
                self.pipeline.remove(entry)
                break
        running = self._running
        return bool(self.pipeline) or (running is not None and running is not refused
                                       and not running.response_complete)

    def _send_refusal(self, *, linger: bool) -> None:
        """Write the refusal and close; `linger` when earlier answers went out on the connection,
        which what the client still sends must not reset away (_close_lingering)."""
        refusal, self._refusal = self._refusal, None
        if refusal is None or self.transport.is_closing():
            return
        self.transport.write(refusal)
        if linger and self.transport.can_write_eof():
            self._close_lingering()
        else:
            self.transport.close()

    def _log_refusal(self, status: int, code: str, reason: str) -> None:
        cls, second = type(self), int(time.monotonic())
        if second != cls._log_second:
            cls._log_second, cls._log_lines = second, 0
        if cls._log_lines >= REFUSAL_LINES_PER_S:
            cls._log_left_out += 1
            return
        cls._log_lines += 1
        peer = self.client
        record = {"ts": time.time(), "pid": os.getpid(), "event": "connection_refused", "status": status,
                  "error": code, "reason": reason, "client": peer[0] if peer else None,
                  "left_out_before": cls._log_left_out}
        cls._log_left_out = 0
        _access_log.info(orjson.dumps(record).decode())



def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request with these headers (uvicorn's, names lower-case) sends a body."""
    return any((name == b"content-length" and value.strip() not in (b"", b"0")) or name == b"transfer-encoding"
               for name, value in headers)


class _CloseAfterBody:
    """A request's transport whose close() waits for the request's body (close_after_body); the
    rest is the connection's transport."""

    def __init__(self, protocol: GuardedHttpToolsProtocol) -> None:
        self._protocol, self._transport = protocol, protocol.transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_after_body()


class ConnectionMetrics:
    """Process-wide (one per process, whatever its servers): service.api.observability registers
    them in each app's registry; with several processes their value files are summed as the
    others are. Made on first use, not at import: prometheus-client picks its multiprocess value
    files when it is first imported, and `shortlist serve` imports this module before it sets
    PROMETHEUS_MULTIPROC_DIR for its processes."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.refused = Counter("shortlist_http_connections_refused_total", "connections answered and closed by "
                               "the HTTP limits before a request reached the app", ["reason"], registry=None)
        self.open = Gauge("shortlist_http_connections_open", "open HTTP connections", registry=None,
                          multiprocess_mode="livesum")


@functools.cache
def connection_metrics() -> ConnectionMetrics:
    return ConnectionMetrics()


def guarded_protocol(max_connections: int, header_timeout_s: float, max_header_bytes: int,
                     body_timeout_s: float, send_timeout_s: float, access_log: bool = True,
                     cors_origins: str = "") -> type[HttpToolsProtocol]:
    """The protocol class with these limits (pass it as uvicorn.Config(http=...)); also keeps the
    warnings a client causes at will out of uvicorn's log (a filter survives its logging set-up)."""
    logging.getLogger("uvicorn.error").addFilter(_CLIENT_CAUSED_WARNINGS)
    limits = {"max_connections": max_connections, "header_timeout_s": header_timeout_s,
              "max_header_bytes": max_header_bytes, "body_timeout_s": body_timeout_s,
              "send_timeout_s": send_timeout_s, "log_refusals": access_log, "cors_origins": cors_origins}
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), limits)


def protocol_kwargs(settings: Any) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for the running settings' HTTP limits and SIGTERM's drain."""
    return {
        # As given, a float: uvicorn waits for requests in flight at most this long (0: not at
        # all). `int(drain) or None` made 0 and anything below 1 s None, which uvicorn takes as
        # no bound (a request held mid-body kept the process until BODY_TIMEOUT_S).
        "timeout_graceful_shutdown": settings.drain_timeout_s,
        "http": guarded_protocol(settings.max_connections, settings.header_timeout_s, settings.max_header_bytes,
                                 settings.body_timeout_s, settings.send_timeout_s, settings.access_log,
                                 settings.cors_origins),
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "proxy_headers": bool(settings.forwarded_allow_ips),
        "forwarded_allow_ips": settings.forwarded_allow_ips or None,
        # The service has no WebSocket route: an Upgrade request is answered as plain HTTP rather
        # than handed to a WebSocket library whose handshake answers outside the app (a bare 403).
        "ws": "none",
    }
