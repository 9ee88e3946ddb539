"""Log-probability requests, and the checker that makes them from what callers pass.

A sampler sends, every step, a prompt that extends one it sent the step before by a token.
:class:`PromptChecker` makes use of that: such a prompt is checked by its last id alone, its
request is built on the earlier request's (already checked) token tuple, and it is linked to
that request (``parent``), so a backend can find what it keeps for the earlier context
(``kept``: e.g. the engine session standing for it) without hashing a long context again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .validation import check_token_ids

__all__ = ["LogprobsRequest", "PromptChecker"]


class LogprobsRequest:
    """One distinct request handed to a backend: a prompt and the adapter to use.

    Equal when ``token_ids`` and ``lora_name`` are; the hash is computed once (a prompt of a
    few hundred tokens costs about a microsecond to hash, and a request is looked up in
    several tables on its way through the batcher and the backend).

    Attributes:
        token_ids: the prompt, a tuple of ints.
        lora_name: the adapter, or None.
        parent: the recent request whose prompt this one extends by its last token, or None.
            Takes no part in equality.
        kept: what a backend keeps for this prompt (None until it sets it).
    """

    __slots__ = ("token_ids", "lora_name", "parent", "kept", "_hash")

    def __init__(
        self, token_ids: tuple[int, ...], lora_name: str | None = None, parent: LogprobsRequest | None = None
    ):
        self.token_ids = token_ids
        self.lora_name = lora_name
        self.parent = parent
        self.kept: Any = None
        self._hash = hash((token_ids, lora_name))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, LogprobsRequest):
            return NotImplemented
        return self._hash == other._hash and self.token_ids == other.token_ids and self.lora_name == other.lora_name

    def __iter__(self) -> Iterator[Any]:
        return iter((self.token_ids, self.lora_name))

    def __repr__(self) -> str:
        return f"LogprobsRequest(token_ids={self.token_ids!r:.80}, lora_name={self.lora_name!r})"


class PromptChecker:
    """Makes checked :class:`LogprobsRequest` objects for one model's prompts.

    A prompt is checked in full by :func:`~genlm_backend.llm.validation.check_token_ids`
    unless it extends, by one plain-int id inside the vocabulary, a prompt this checker
    passed recently (same adapter): then its request is that request's token tuple plus the
    new id. The earlier ids are taken from the checked tuple, equal to the caller's: an id
    the caller changed in place into an equal non-int (``5.0`` for ``5``) is read as that
    int instead of being refused. An equal request made recently is returned again (so what
    a backend keeps for a prompt is found by every caller that sends it).

    Remembers between ``remember`` and ``2 * remember`` of the requests it made last.
    """

    def __init__(self, vocab_size: int, max_len: int | None, remember: int = 4096):
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.remember = remember
        # Two generations: the newer fills up, then replaces the older (no per-entry eviction).
        self._new: dict[LogprobsRequest, LogprobsRequest] = {}
        self._old: dict[LogprobsRequest, LogprobsRequest] = {}

    def request(self, token_ids: Any, lora_name: str | None) -> LogprobsRequest:
        """The checked request for ``token_ids`` (see :func:`check_token_ids` for what raises)."""
        if (type(token_ids) is list or type(token_ids) is tuple) and len(token_ids) > 1:
            last = token_ids[-1]
            if type(last) is int and 0 <= last < self.vocab_size and (self.max_len is None or len(token_ids) <= self.max_len):
                probe = LogprobsRequest(tuple(token_ids[:-1]), lora_name)
                parent = self._new.get(probe) or self._old.get(probe)
                if parent is not None:
                    parent.parent = None  # planned long ago: no chains of requests kept alive
                    return self._remember(LogprobsRequest(parent.token_ids + (last,), lora_name, parent))
        return self._remember(LogprobsRequest(check_token_ids(token_ids, self.vocab_size, self.max_len), lora_name))

    def _remember(self, request: LogprobsRequest) -> LogprobsRequest:
        request = self._new.setdefault(request, request)
        if len(self._new) >= self.remember:
            self._old, self._new = self._new, {}
        return request
