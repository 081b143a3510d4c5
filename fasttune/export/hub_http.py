"""Deadlines on every request huggingface_hub sends during a push.

huggingface_hub 2.x builds its shared HTTP client with ``timeout=None``: a server that accepts the
connection and never answers, or an LFS upload whose peer stops reading, blocks the caller forever.
``hub_timeouts`` installs, for the duration of a ``with`` block, a client factory (huggingface_hub's
public ``set_client_factory``) that wraps the one in place and gives every client a connect timeout
and a read/write stall timeout: a request that makes no progress for ``stall`` seconds fails with a
timeout, which huggingface_hub (preupload, LFS) or ``hub_client`` retries. A slow transfer that keeps
moving is not cut. A timeout the user's own factory set is kept when it is tighter. On exit the
previous factory is restored.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_LOCK = threading.RLock()


def _tighter(current, connect: float, stall: float):
    # The client's own Timeout class: httpx2 under huggingface_hub 2.x, httpx under 1.x.
    def pick(value, ours):
        return ours if value is None else min(value, ours)

    return type(current)(connect=pick(current.connect, connect), read=pick(current.read, stall),
                          write=pick(current.write, stall), pool=pick(current.pool, stall))


def current_factory():
    """The client factory huggingface_hub uses now (its default when none was set)."""
    from huggingface_hub.utils import _http

    return getattr(_http, "_GLOBAL_CLIENT_FACTORY", None) or _http.default_client_factory


@contextlib.contextmanager
def hub_timeouts(connect: float = 10.0, stall: float = 15.0) -> Iterator[None]:
    """Within the block, each huggingface_hub request fails after ``connect`` s without a connection
    or ``stall`` s without reading or writing a byte.

    Args:
        connect: seconds to establish a connection.
        stall: seconds a request may go without progress (read, write or waiting for a pooled
            connection).
    """
    if connect <= 0 or stall <= 0:
        raise ValueError(f"connect and stall must be > 0 seconds, got {connect} and {stall}")
    from huggingface_hub import set_client_factory

    with _LOCK:
        previous = current_factory()

        def factory():
            client = previous()
            client.timeout = _tighter(client.timeout, connect, stall)
            return client

        set_client_factory(factory)  # closes the shared client: the next request gets a new one
        try:
            yield
        finally:
            set_client_factory(previous)
