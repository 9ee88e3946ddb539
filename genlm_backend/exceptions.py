"""Every exception the package raises on purpose.

The hierarchy::

    GenlmBackendError
    ├── InvalidRequestError (also ValueError)   a caller's request is malformed: empty
    │                                          prompt, negative or out-of-vocabulary id,
    │                                          too-long prompt, unknown adapter, bad weights
    │   └── UnsupportedTokenizerError           a tokenizer whose tokens have no fixed bytes
    ├── InvalidRequestTypeError (also TypeError) a caller passed a value of the wrong type
    ├── ClosedError (also RuntimeError)         the object was used after ``cleanup()``
    ├── RequestDroppedError (also RuntimeError) ``reset_async_queries()`` dropped the request
    │                                          before it ran
    └── EngineError (also RuntimeError)         the engine failed while evaluating a batch;
                                               ``__cause__`` holds the engine's own exception

Bad input is rejected before it is queued, so it reaches only the caller that sent it.
An engine failure reaches exactly the awaiters of the batch that failed, each with its own
``EngineError`` instance; the next batch runs as usual.
"""

from __future__ import annotations

__all__ = [
    "GenlmBackendError",
    "InvalidRequestError",
    "InvalidRequestTypeError",
    "UnsupportedTokenizerError",
    "ClosedError",
    "RequestDroppedError",
    "EngineError",
]


class GenlmBackendError(Exception):
    """Base class of every exception raised on purpose by ``genlm_backend``."""


class InvalidRequestError(GenlmBackendError, ValueError):
    """A request is malformed; raised to the caller that sent it, before it is queued."""


class UnsupportedTokenizerError(InvalidRequestError):
    """The tokenizer's decoding cannot be expressed as fixed bytes per token."""


class InvalidRequestTypeError(GenlmBackendError, TypeError):
    """A request holds a value of the wrong type; raised to the caller that sent it."""


class ClosedError(GenlmBackendError, RuntimeError):
    """The object was used after ``cleanup()`` (or ``close()``) was called."""


class RequestDroppedError(GenlmBackendError, RuntimeError):
    """A queued request was dropped by ``reset_async_queries()`` before it ran."""


class EngineError(GenlmBackendError, RuntimeError):
    """The engine raised while evaluating a batch; ``__cause__`` is the original error."""
