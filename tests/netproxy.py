"""A TCP forwarder for tests: a service's port seen through one of its own, counting what passes.

Used as `kubectl port-forward` gives a laptop its own address for an in-cluster service, and in
front of the S3 server where a test must know the bytes a run downloaded, make uploads slow (all
of them, or those to one key: `slow`), drop the requests to one key (`drop`), or cut the service
off (`cut`: open connections reset, new ones refused, until `restore`).
"""
from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from typing import Callable

# an HTTP/1.1 request's first line, at the start of what a client sends (S3 clients do not pipeline)
_REQUEST = re.compile(rb"[A-Z]+ (\S+) HTTP/1\.[01]\r\n")


class PortForward:
    """Forwards 127.0.0.1:`listen_port` (`uri`; 0: a port of its own) to 127.0.0.1:`port`.
    `connections` counts clients, `down` the bytes the service sent them, `up` the bytes they sent
    it; `up_rate` (bytes/s per connection, 0 = unlimited) slows what clients send, as a thin
    uplink would, and `slow(part, rate)` only requests whose path has `part` in it; `cut()` resets
    every open connection and refuses new ones until `restore()`."""

    def __init__(self, port: int, listen_port: int = 0, up_rate: float = 0.0):
        self.connections, self.down, self.up, self.up_rate, self._port = 0, 0, 0, up_rate, port
        self.is_cut, self._open = False, set()
        self._slow_part, self._slow_rate, self._drop_part = b"", 0.0, b""
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", listen_port))
        self.uri = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            if self.is_cut:  # as a network partition: the client's connection is reset
                _reset(near)
                continue
            try:
                far = socket.create_connection(("127.0.0.1", self._port))
            except OSError:  # the service is not up (yet): the client sees its connection close
                near.close()
                continue
            with self._lock:
                self._open.update((near, far))
            threading.Thread(target=self._pipe, args=(near, far, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(far, near, False), daemon=True).start()

    def slow(self, part: str, rate: float) -> None:
        """Requests whose path contains `part` send at most `rate` bytes/s (per connection) from now
        on, those already sending included; others are not slowed. `slow("", 0)` ends it."""
        self._slow_part, self._slow_rate = part.encode(), rate

    def drop(self, part: str) -> None:
        """From now on a request whose path contains `part` has its connection reset as it starts,
        every try of it: a write the store never gets (`drop("")` ends it)."""
        self._drop_part = part.encode()

    def _rate(self, path: bytes) -> float:
        """Bytes/s a client may send now in a request for `path` (0: unlimited)."""
        part = self._slow_part
        return self.up_rate or (self._slow_rate if part and part in path else 0.0)

    def _count(self, upstream: bool, n: int) -> None:
        with self._lock:
            if upstream:
                self.up += n
            else:
                self.down += n

    def _pipe(self, src, dst, upstream: bool) -> None:
        path = b""  # of the request this client is sending (read by `rate` as it changes)
        rate = (lambda: self._rate(path)) if upstream else (lambda: 0.0)
        try:
            while data := src.recv(65536):
                if upstream and (request := _REQUEST.match(data)):
                    path = request.group(1)
                    if self._drop_part and self._drop_part in path:
                        _reset(src)
                        return
                _send(dst, data, rate, lambda n: self._count(upstream, n))
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with self._lock:
                    self._open.discard(s)

    def cut(self) -> None:
        """Reset every open connection; refuse (reset) new ones until restore()."""
        self.is_cut = True
        with self._lock:
            open_now, self._open = list(self._open), set()
        for s in open_now:
            _reset(s)

    def restore(self) -> None:
        self.is_cut = False

    @contextlib.contextmanager
    def cut_for(self, seconds: float):
        """Cut off now and restored after `seconds`, or as the block ends if that comes first."""
        self.cut()
        timer = threading.Timer(seconds, self.restore)
        timer.start()
        try:
            yield self
        finally:
            timer.cancel()
            self.restore()

    def close(self) -> None:
        self._sock.close()


def _send(sock: socket.socket, data: bytes, rate: Callable[[], float], sent: Callable[[int], None]) -> None:
    """Send `data` at `rate()` bytes/s (read again for each piece: a change applies at once; 0 =
    unlimited), in pieces of a tenth of a second: the peer sees bytes arrive steadily, never a
    pause that a client's low-speed limit (seconds) takes for a dead link. `sent(n)` after each."""
    while data:
        now = rate()
        size = max(1, int(now / 10)) if now else len(data)
        piece, data = data[:size], data[size:]
        if now:
            time.sleep(len(piece) / now)
        sock.sendall(piece)
        sent(len(piece))


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dropped route or a restarted peer looks to a client."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
