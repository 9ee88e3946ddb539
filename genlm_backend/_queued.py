"""The future of one queued request, which asyncio also accepts where it takes a coroutine.

``asyncio.gather`` wraps every coroutine it is given in a task: a task object, a first step
scheduled on the loop and a wake-up when the result arrives, for each particle of a
lockstep program at every step. A future it takes as it is. :class:`QueuedResult` is the
loop future the batcher resolves, so ``await`` and ``gather`` pay no task; and it answers
the coroutine protocol (``send``, ``throw``, ``close``, registered as a
``collections.abc.Coroutine``), so ``asyncio.create_task``, ``TaskGroup.create_task`` and
``loop.run_until_complete`` take it as they take the coroutine of an ``async def``.
"""

from __future__ import annotations

import asyncio
import collections.abc
from typing import Any

__all__ = ["QueuedResult", "failed", "running_loop"]


class QueuedResult(asyncio.Future):
    """A loop future that a task can also drive as its coroutine: each ``send`` or
    ``throw`` of the task goes to a fresh ``__await__`` step of the future, which yields the
    future while it is pending and returns its result (or raises its exception) once it is
    done. A task resumes its coroutine only when the future it waits on is done, so no step
    is ever left suspended: nothing is kept between calls."""

    def send(self, value: Any) -> Any:
        return self.__await__().send(value)

    def throw(self, *exc_info: Any) -> Any:
        return self.__await__().throw(*exc_info)

    def close(self) -> None:
        """Nothing to close (no step is kept)."""


collections.abc.Coroutine.register(QueuedResult)


def failed(loop: asyncio.AbstractEventLoop, error: BaseException) -> QueuedResult:
    """A :class:`QueuedResult` that raises ``error`` where it is awaited (as an ``async
    def`` raises in its caller's await, not at the call)."""
    result = QueuedResult(loop=loop)
    result.set_exception(error)
    return result


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
