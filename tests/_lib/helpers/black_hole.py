"""A server that accepts TCP connections and never answers: the worst Hub a push can meet.

Connections are accepted and held open; nothing is read or written, so a client's request sits in
the socket buffers until the client's own timeout ends it. Use as a context manager; ``url`` is the
endpoint to point HF_ENDPOINT at, ``accepted`` counts the connections made.
"""

from __future__ import annotations

import socket
import threading


class BlackHole:
    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self.accepted = 0

    def __enter__(self) -> "BlackHole":
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True, name="black-hole").start()
        return self

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            self._held.append(conn)
            self.accepted += 1

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for conn in self._held:
            conn.close()
        self._sock.close()
