"""The worker class an engine whose rows come from Model Runner V2 is started with
(``worker_cls=``, see :mod:`.model_runner_v2`): vLLM imports it by its qualified name in every
worker process."""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_worker import Worker

from .model_runner_v2 import RowSampler

__all__ = ["CaptureWorker"]


class CaptureWorker(Worker):
    """vLLM's CUDA worker whose Model Runner V2 samples through a :class:`RowSampler`."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        runner = self.model_runner
        if type(runner).__module__ != "vllm.v1.worker.gpu.model_runner":
            return  # vLLM chose its V1 runner: no rows here (row_sampler() says None)
        if getattr(runner, "sampler", None) is not None:
            runner.sampler = RowSampler(runner.sampler, runner.device)
