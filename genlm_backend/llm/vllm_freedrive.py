"""Driving free-running sessions (:mod:`.vllm_freerun`) on one vLLM engine.

:class:`FreeDriver` is what :class:`~genlm_backend.llm.vllm.AsyncVirtualLM` uses when
``sessions="free"``: it adds the sessions' engine requests (temperature 1 and nothing else
that changes vLLM's draw), installs the token tap, and *pumps* the engine: one step at a
time on the engine thread, queued again while some session wants a row, so that batches and
other engine work start between two steps. Requests reach the sessions two ways: a request
that extends a session by its draw takes its row on the event loop (:meth:`FreeDriver.take`,
no batch), every other request comes in a batch (:meth:`FreeDriver.evaluate`).

When the engine steps: it is given steps ("tickets") when requests wait for rows, and only
once the event loop that made them has nothing else to do, its batches of that moment
included (or a batch arrives), so that one step answers every caller of a turn of the loop,
those of the batch too, and the engine does not run ahead of callers still busy with their
last rows. Each such wake-up grants one step for the waiting requests and ``lookahead``
steps more, which compute the rows the callers will ask for next while they look at the
last ones. A request still waiting after a step that should have
answered it (a prompt prefilled over several steps) gets one more.
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from .._batch_queue import call_when_idle
from ..exceptions import EngineError
from . import vllm_internals
from .core_sharing import SharedCore
from .prompts import LogprobsRequest
from .vllm_engine import RowBatch, _invalid
from .vllm_freerun import FREE_KEY, FreeSessions

__all__ = ["FreeDriver"]


class FreeDriver:
    """Free-running sessions of one engine, and the pump that steps it for them.

    Args:
        llm: the ``vllm.LLM``; :meth:`detach` forgets it (the model was closed).
        runner: the model's :class:`~.vllm_engine.EngineRunner` (steps, aborts).
        sink: the model's :class:`~.vllm_capture.CaptureSink` (rows of followed tags).
        engine_thread: the model's engine thread.
        lora_request: ``lora_name -> LoRARequest | None``.
        capacity, lookahead, max_ahead, idle_batches: see :class:`FreeSessions`.
        max_wait: seconds after which waiting requests get their step although the event
            loop never ran out of other work (as the batcher's ``timeout``).
        share_core: pin the event loop's thread and the engine thread to one core while
            sessions run (:mod:`.core_sharing`); released when they are all closed.
    """

    def __init__(self, llm: Any, runner: Any, sink: Any, engine_thread: Any,
                 lora_request: Callable[[str | None], Any], capacity: int, lookahead: int, max_ahead: int,
                 idle_batches: int, max_wait: float, share_core: bool = False):
        self._llm, self._runner, self._sink, self._thread = llm, runner, sink, engine_thread
        self._lora_request, self._max_wait = lora_request, max_wait
        max_model_len = llm.llm_engine.model_config.max_model_len
        self.sessions = FreeSessions(self._start, sink.next_tag, runner.abort, sink.follow, sink.unfollow,
                                     max_model_len, capacity, lookahead=lookahead, max_ahead=max_ahead,
                                     idle_batches=idle_batches)
        self.on = False  # requests go to free sessions
        self._pump_queued = self._tap_installed = False
        self._tickets = 0  # engine steps granted (engine thread only)
        self._probing: set[asyncio.AbstractEventLoop] = set()  # loops with an idle probe queued
        self._sharing = SharedCore() if share_core else None
        import vllm  # (only here: this module is imported where vLLM is)

        self._params = vllm.SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.0, detokenize=False,
                                           **vllm_internals.NO_DEEP_COPY)

    # ---- on the event loop ----------------------------------------------------------------

    def take(self, request: LogprobsRequest) -> torch.Tensor | asyncio.Future | None:
        """The row of a request that extends a session by its draw, or a future of it; None
        for any other request (it goes to a batch). A future's row needs an engine step:
        the pump is queued once the event loop has nothing else to do (or after
        ``max_wait``), so that one step serves every caller of this turn of the loop."""
        taken = self.sessions.take(request)
        if taken is not None and type(taken) is not torch.Tensor:
            loop = asyncio.get_running_loop()
            if loop not in self._probing:
                self._probing.add(loop)
                call_when_idle(loop, functools.partial(self._loop_idle, loop), self._max_wait)
        return taken

    def _loop_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        self._probing.discard(loop)
        if self._sharing is not None:
            self._sharing.join()
        self._thread.submit(self._wake)

    def evaluate(self, requests: list[LogprobsRequest]) -> asyncio.Future:
        """A batch of requests; returns a future of their rows."""
        if self._sharing is not None:
            self._sharing.join()
        batch = RowBatch(asyncio.get_running_loop(), len(requests))
        self._thread.submit(self._start_batch, requests, batch)
        return batch.future

    # ---- on the engine thread -------------------------------------------------------------

    def turn(self, on: bool) -> None:
        """Turns free sessions on (installs the token tap once) or off (stops them: requests
        waiting on them get one-row sessions, which end by themselves)."""
        if on:
            if not self._tap_installed:
                self._tap_installed = vllm_internals.install_token_tap(
                    self._llm.llm_engine, FREE_KEY, self._tokens, lambda: self.sessions.running)
            if not self._tap_installed:
                raise ValueError("free-running sessions need the scheduler's update_from_output, which this "
                                 f"vLLM lacks (checked versions: {vllm_internals.CHECKED_VERSIONS})")
            self.on = self.sessions.enabled = True
        else:
            self.on = self.sessions.enabled = False
            self.close_all()

    def _tokens(self, found: list) -> None:
        self.sessions.tokens(found)  # (looked up each step: see FreeSessions.use_kernel)

    def close_where(self, predicate: Callable[[Any], bool]) -> int:
        """Stops the sessions matching ``predicate``; requests waiting on them get new ones."""
        closed = self.sessions.close_where(predicate)
        self._wake()
        return closed

    def close_all(self) -> int:
        closed = self.close_where(lambda s: True)
        if self._sharing is not None:
            self._sharing.release()
        return closed

    def detach(self) -> None:
        """The model is closing: fails every waiting request, never steps the engine again."""
        self.sessions.fail_all(lambda: EngineError("the model was closed"))
        self._llm = None
        if self._sharing is not None:
            self._sharing.release()

    def _start_batch(self, requests: list[LogprobsRequest], batch: RowBatch) -> None:
        if self._sharing is not None:
            self._sharing.join()
        try:
            self.sessions.start_batch(requests, batch)
        except BaseException as exc:  # noqa: BLE001 - fails this batch only
            batch.fail(exc)
        self._wake()

    def _start(self, session: Any, token_ids: tuple[int, ...], lora_name: str | None) -> None:
        """Adds a session's engine request: temperature 1 and nothing else that changes vLLM's
        draw, so the draw is exact for the row handed out with it."""
        params = copy.copy(self._params)
        params.max_tokens = session.rows_left
        params.extra_args = {**self._sink.extra_args(session.tag), FREE_KEY: session.tag}
        try:
            vllm_internals.add_request(self._llm.llm_engine, session.request_id, token_ids, params,
                                       self._lora_request(lora_name))
        except Exception as exc:
            raise _invalid(exc) from exc

    def _wake(self) -> None:
        """Requests may wait: grants a step for them and ``lookahead`` steps ahead."""
        if self.sessions.has_waiting():
            self._tickets = max(self._tickets, 1 + self.sessions.lookahead)
        self._queue_pump()

    def _queue_pump(self) -> None:
        if not self._pump_queued and self._tickets > 0:
            self._pump_queued = True
            self._thread.submit(self._pump)

    def _pump(self) -> None:
        """One engine step for the free-running sessions while steps are granted (queued
        again after each: the batches that arrive meanwhile start between two steps)."""
        self._pump_queued = False
        if self._llm is None or not self.sessions.running:
            self._tickets = 0
            return
        if self._sharing is not None:
            self._sharing.join()
        self._tickets -= 1
        step = self.sessions.begin_step()
        try:
            self._runner.step_alone()
        except BaseException as exc:  # noqa: BLE001 - every waiting caller hears of it
            failure = exc
            self._tickets = 0
            self.sessions.fail_all(lambda: _engine_failed(failure))
            return
        if self._tickets <= 0 and self.sessions.has_waiting(before=step):
            self._tickets = 1  # its row takes more than one step (a prompt prefilled in chunks)
        self._queue_pump()


def _engine_failed(exc: BaseException) -> EngineError:
    error = EngineError(f"the engine failed while running free sessions: {exc!r}")
    error.__cause__ = exc
    return error
