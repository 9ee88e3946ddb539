"""Runs coroutines to completion from synchronous code, also inside a running event loop.

Every ``*_sync`` method goes through :func:`run_sync`. The coroutine runs on one
process-wide background event loop (a daemon thread started on first use), so the call
works the same from a plain script, from a Jupyter cell whose loop is already running, and
from several threads at once (their requests are batched together on that loop).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed() or _thread is None or not _thread.is_alive():
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                loop.run_forever()

            thread = threading.Thread(target=run, name="genlm-backend-sync", daemon=True)
            thread.start()
            started.wait()
            _loop, _thread = loop, thread
        return _loop


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Runs ``coro`` on the background loop and blocks until it returns or raises.

    Raises:
        RuntimeError: when called from the background loop itself, which would deadlock.
    """
    loop = _background_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError(
            "a *_sync method was called from inside an async evaluation; "
            "await the async method instead"
        )
    return asyncio.run_coroutine_threadsafe(coro, loop).result()
