"""What each awaiter of a finished batch gets: its result, its own copy, or its own error.

Private to :mod:`genlm_backend._batch_queue`. Nothing here raises into the queue: a result
that cannot be checked, copied or set fails the awaiters it could not reach.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
from collections.abc import Callable
from typing import Any

from .exceptions import ClosedError, EngineError

__all__ = ["batch_error", "check_results", "fail_all", "outcome", "resolve_all"]


def outcome(future: asyncio.Future | concurrent.futures.Future) -> tuple[Any, BaseException | None]:
    """``(result, None)`` or ``(None, error)`` of a finished future; never raises."""
    if future.cancelled():
        return None, ClosedError("the evaluation of the batch was cancelled")
    try:
        return future.result(), None
    except BaseException as exc:  # noqa: BLE001 - handed to the batch's awaiters
        return None, exc


def check_results(results: Any, num_keys: int) -> Exception | None:
    try:
        num_results = len(results)
    except TypeError:
        return TypeError(
            f"evaluate returned {type(results).__name__}, not a sequence of {num_keys} results"
        )
    if num_results != num_keys:
        return RuntimeError(f"evaluate returned {num_results} results for {num_keys} keys")
    return None


def batch_error(error: BaseException, batch_size: int) -> BaseException:
    """The error one awaiter of a failed batch gets: its own instance."""
    if isinstance(error, (asyncio.CancelledError, concurrent.futures.CancelledError)):
        return ClosedError("the evaluation of the batch was cancelled")
    if isinstance(error, ClosedError):
        return ClosedError(str(error))
    try:
        described = repr(error)
    except Exception:  # noqa: BLE001 - an exception whose repr fails still fails the batch
        described = type(error).__name__
    exc = EngineError(f"the engine failed on a batch of {batch_size} requests: {described}")
    exc.__cause__ = error
    return exc


def fail_all(waiters: list[asyncio.Future], error_factory: Callable[[], BaseException]) -> None:
    for fut in waiters:
        if not fut.done():
            _fail(fut, error_factory())


def _fail(fut: asyncio.Future, error: BaseException) -> None:
    """Sets ``error`` on ``fut``. On a closed loop, where nobody can await ``fut`` any more,
    the error also counts as retrieved: asyncio would otherwise log "exception was never
    retrieved" when the future is collected."""
    try:
        fut.set_exception(error)
    except RuntimeError:  # its loop is closed: the future is marked done all the same
        pass
    if fut.get_loop().is_closed():
        fut.exception()


def resolve_all(waiters: list[asyncio.Future], result: Any, copy_result: Callable) -> None:
    live = [fut for fut in waiters if not fut.done()]
    failed = isinstance(result, BaseException)
    for i, fut in enumerate(live):
        is_error = failed
        try:
            value = result if i == 0 else (_copy_exception if failed else copy_result)(result)
        except Exception as exc:  # noqa: BLE001 - the copy failed: this waiter gets why
            value, is_error = exc, True
        if is_error:
            _fail(fut, value)
            continue
        try:
            fut.set_result(value)
        except RuntimeError:  # its loop is closed: the future is marked done all the same
            pass


def _copy_exception(exc: BaseException) -> BaseException:
    """A twin of ``exc`` for another awaiter (the same instance where none can be made)."""
    try:
        twin = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an __init__ that its args cannot call again
        try:
            twin = type(exc).__new__(type(exc), *exc.args)  # the same args, no __init__
            twin.__dict__.update(getattr(exc, "__dict__", {}))
        except Exception:  # noqa: BLE001
            return exc
    twin.__cause__ = exc.__cause__
    return twin
