"""One HTTP exchange that ends within a deadline: the server client and the retrieval client both use it.

A socket's own timeout bounds each read, not their sum, so a server trickling a byte a second could
stretch a 3 s call to minutes. Here a timer shuts the socket down at the deadline, which wakes any
blocked read (connecting, the status line, headers or body); whatever that interrupts is raised as
TimeoutError. Standard library only; servers are reached directly, without proxies.
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.parse
from dataclasses import dataclass


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    """The body, cut to the read limit the caller gave for this status."""
    missing: int
    """Bytes of its Content-Length the body stopped short of within the read limit (0: complete)."""
    retry_after: str | None
    """The Retry-After header, as sent."""


def exchange(
    url: str,
    data: bytes | None,
    headers: dict[str, str],
    timeout_s: float,
    *,
    max_bytes: int | None = None,
    max_error_bytes: int | None = None,
) -> Reply:
    """POST `data` (GET when None) to `url`; the whole exchange ends within `timeout_s` of its start
    (else TimeoutError). Reads at most `max_bytes` of a 2xx body and `max_error_bytes` of any other
    (None: all of it, where a body cut short raises `http.client.IncompleteRead`)."""
    parts = urllib.parse.urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname or "", parts.port, timeout=timeout_s)
    expired = threading.Event()
    opened: list[socket.socket] = []  # connection.sock goes None once a closing response owns the socket

    def cut() -> None:
        expired.set()  # before reading `opened`: see the check after connect()
        for sock in opened:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout_s, cut)
    timer.daemon = True
    timer.start()
    try:
        connection.connect()
        opened.append(connection.sock)
        if expired.is_set():  # fired before the socket existed
            raise TimeoutError(f"no complete reply within {timeout_s:g}s")
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        connection.request("GET" if data is None else "POST", target, body=data, headers=headers)
        answer = connection.getresponse()
        limit = max_bytes if 200 <= answer.status < 300 else max_error_bytes
        body = answer.read() if limit is None else answer.read(limit)
        if expired.is_set():  # a reply without Content-Length ends at the shutdown as if complete
            raise TimeoutError(f"no complete reply within {timeout_s:g}s")
        cut_short = limit is not None and answer.length and len(body) < limit  # read(n) returns a cut body without complaint
        return Reply(answer.status, body, int(answer.length) if cut_short else 0, answer.getheader("Retry-After"))
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise TimeoutError(f"no complete reply within {timeout_s:g}s") from exc
        raise
    finally:
        timer.cancel()
        connection.close()
