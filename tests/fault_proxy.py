"""A TCP proxy on 127.0.0.1 in front of the moto S3 server that can take the endpoint down:
while it is down every new connection is reset at once and the live ones are cut, as a
crashed or restarting S3 endpoint would do (S3 clients keep connections alive, so refusing
only new connections would not be an outage). An outage can also start by itself at the
first request of a given HTTP method (and path), e.g. the first PUT of a job's output."""
from __future__ import annotations

import socket
import struct
import threading
import time
from urllib.parse import urlsplit


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset rather than a polite FIN: the client sees the error at once."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)  # wakes the thread blocked in recv(); close() would not
    except OSError:
        pass
    sock.close()


class FaultProxy:
    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.down_until = 0.0  # time.monotonic() before which the endpoint is down
        self.outages = 0  # how many outages have started
        self.refused = 0  # connections reset because the endpoint was down
        self.trigger: tuple[bytes, float] | None = None  # (method, seconds) of a pending outage
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self.down_until

    def down(self, seconds: float = float("inf")) -> None:
        """Start an outage of `seconds` (forever by default): cut every live connection."""
        with self._lock:
            self.down_until = time.monotonic() + seconds
            self.outages += 1
            live, self._live = self._live, set()
        for s in live:
            _reset(s)

    def up(self) -> None:
        self.down_until = 0.0

    def fail_at(self, request: str, seconds: float = float("inf")) -> None:
        """Go down for `seconds` (forever by default) at the first request whose request line
        starts with `request`: "PUT " for the first write, "PUT /bucket/out/data/" for the
        first write under a folder (path-style addressing). That request never arrives."""
        self.trigger = (request.encode(), seconds)

    def close(self) -> None:
        self._closed = True
        self.server.close()
        self.down(0)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.is_down:
                self.refused += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._live |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                trigger = self.trigger
                if requests and trigger and data.startswith(trigger[0]):
                    self.trigger = None
                    self.down(trigger[1])
                    return
                if self.is_down:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._live -= {src, dst}
        for s in (src, dst):
            _reset(s)
