"""How :class:`~genlm_backend.llm.vllm.AsyncVirtualLM` closes: ``cleanup`` stops the run in
flight after the engine step it is in, and the engine is shut down once, on its own thread."""

from __future__ import annotations

import concurrent.futures
import warnings

from . import internals

__all__ = ["CLOSE_WAIT_S", "ClosingMixin"]

# The longest ``cleanup`` waits for the engine thread to finish the step it is in.
CLOSE_WAIT_S = 60.0


class ClosingMixin:
    """``_close`` and ``_stop_started`` of ``AsyncVirtualLM`` (its engine thread, runner,
    sampling batcher, capture sink and remote capture are set up by its constructor)."""

    def _close(self) -> None:
        """Fails the sampling callers; the run in flight stops after its step (its callers
        get ``ClosedError``), queued engine work is cancelled, and the engine thread shuts the
        engine down as its last task. Waits for that (at most :data:`CLOSE_WAIT_S`)."""
        self._sample_batcher.close()
        self._runner.close()
        done = self._engine_thread.shutdown(wait=False, cancel_futures=True, last=self._shutdown)
        self.llm = None
        if done is None or self._engine_thread.on_thread:
            return
        try:
            done.result(timeout=CLOSE_WAIT_S)
        except concurrent.futures.TimeoutError:
            warnings.warn(
                f"cleanup: the engine thread is still busy after {CLOSE_WAIT_S} s; the engine "
                "is shut down on it once its work is done", RuntimeWarning, stacklevel=3,
            )

    def _stop_started(self) -> None:
        for name in ("_sample_batcher", "_sink"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
        super()._stop_started()

    def _shutdown(self) -> None:
        """The engine thread's last task: shuts the engine down."""
        llm, self._runner.llm = self._runner.llm, None
        self._sink.close()
        if self._remote is not None and self._remote.ring is not None:
            self._remote.ring.release()  # before its worker exits
        internals.shutdown(llm)
