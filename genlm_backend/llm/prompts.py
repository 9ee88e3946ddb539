"""Log-probability requests, and the checker that makes them from what callers pass.

A sampler sends, every step, a prompt that extends one it sent the step before by a token.
:class:`PromptChecker` makes use of that: such a prompt is checked by its last id alone, its
request is built on the earlier request's (already checked) token tuple, and it is linked to
that request (``parent``), so a backend can find what it keeps for the earlier context
(``kept``: e.g. the engine session standing for it) without hashing a long context again.
``benchmarks/bench_prompts.py`` times a request made this way against the full check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .validation import check_token_ids

__all__ = ["LogprobsRequest", "PromptChecker"]


def _key(ids_hash: int, lora_name: str | None) -> int:
    return ids_hash if lora_name is None else hash((ids_hash, lora_name))


# CPython's tuple hash (xxHash-based, 3.8 on; 64-bit): acc = P5; per item acc = rotl31(acc +
# hash(item) * P2) * P1; then acc + (len ^ (P5 ^ 3527539)), with -1 mapped to 1546275796.
# Undoing the last item's round gives the hash of the tuple without it in O(1): the key of a
# prompt's parent, from the hash of the prompt, without hashing the prefix again. Checked
# against the built-in hash at import; where it differs, the prefix is hashed instead.
_MASK = (1 << 64) - 1
_XXPRIME_1, _XXPRIME_2, _XXPRIME_5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_XXPRIME_1_INVERSE = pow(_XXPRIME_1, -1, 1 << 64)
_LEN_MIX = _XXPRIME_5 ^ 3527539
_MINUS_ONE_STANDIN = 1546275796


def _prefix_hash(ids_hash: int, length: int, last: int) -> int | None:
    """``hash(t[:-1])`` from ``hash(t)``, ``len(t)`` and ``t[-1]`` (an int below 2**61 - 1);
    None where it cannot be told."""
    if ids_hash == _MINUS_ONE_STANDIN:
        return None
    acc = (((ids_hash - (length ^ _LEN_MIX)) & _MASK) * _XXPRIME_1_INVERSE) & _MASK
    acc = (((acc >> 31) | (acc << 33)) - last * _XXPRIME_2 + ((length - 1) ^ _LEN_MIX)) & _MASK
    if acc == _MASK:
        return _MINUS_ONE_STANDIN
    return acc - (1 << 64) if acc >> 63 else acc


def _prefix_hash_works() -> bool:
    samples = [(1, 2), (0, 5, 7), tuple(range(1000, 1300)), (2**40, 3, 4), tuple(range(200))[::-1]]
    try:
        return all(_prefix_hash(hash(t), len(t), t[-1]) == hash(t[:-1]) for t in samples)
    except Exception:  # noqa: BLE001 - any surprise: hash prefixes the plain way
        return False


if not _prefix_hash_works():  # pragma: no cover - another Python's tuple hash
    _prefix_hash = None  # type: ignore[assignment]

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
        self,
        token_ids: tuple[int, ...],
        lora_name: str | None = None,
        parent: LogprobsRequest | None = None,
        key: int | None = None,
    ):
        self.token_ids = token_ids
        self.lora_name = lora_name
        self.parent = parent
        self.kept: Any = None
        # ``key``: the hash, where the caller computed it already (the checker does).
        self._hash = _key(hash(token_ids), lora_name) if key is None else key

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, LogprobsRequest):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.token_ids == other.token_ids
            and self.lora_name == other.lora_name
        )

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

    What "recently" means adapts to the caller: requests are kept in three generations, and
    a new generation starts when a prompt extends one of the current generation (a sampler's
    next step began) once it holds ``min_remember`` requests and at least as many as the one
    before, or when it holds ``remember``. So a lockstep sampler's requests live about three
    steps: long enough for every particle to find its parent also when some particles run
    a step or two ahead of others (particles that do not move in lockstep, e.g. whose rows
    came from the output cache), short enough that they die young (requests held longer
    are what Python's garbage collector spends its time on).
    """

    def __init__(
        self, vocab_size: int, max_len: int | None, remember: int = 4096, min_remember: int = 64
    ):
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.remember = remember
        self.min_remember = min(min_remember, remember)
        # request hash -> request, newest generation first; a new one of equal hash replaces
        # an older one.
        self._new: dict[int, LogprobsRequest] = {}
        self._old: dict[int, LogprobsRequest] = {}
        self._older: dict[int, LogprobsRequest] = {}

    def request(self, token_ids: Any, lora_name: str | None) -> LogprobsRequest:
        """The checked request for ``token_ids`` (see :func:`check_token_ids` for what raises)."""
        kind = type(token_ids)
        if (kind is list or kind is tuple) and len(token_ids) > 1:
            last = token_ids[-1]
            if (
                type(last) is int
                and 0 <= last < self.vocab_size
                and (self.max_len is None or len(token_ids) <= self.max_len)
            ):
                request = self._extension(token_ids, last, lora_name)
                if request is not None:
                    return request
        checked = check_token_ids(token_ids, self.vocab_size, self.max_len)
        return self._remember(LogprobsRequest(checked, lora_name))

    def _extension(
        self, token_ids: Any, last: int, lora_name: str | None
    ) -> LogprobsRequest | None:
        """The request of ``token_ids`` built on the remembered request of all but its last
        id, or None when there is none."""
        try:
            ids = tuple(token_ids)
            ids_hash = hash(ids)
            prefix_hash = None if _prefix_hash is None else _prefix_hash(ids_hash, len(ids), last)
            if prefix_hash is None:
                prefix_hash = hash(ids[:-1])
        except TypeError:  # an unhashable id: the full check says what is wrong
            return None
        parent = self._parent(_key(prefix_hash, lora_name), lora_name)
        if parent is None:
            return None
        # The ids equal to the caller's, in the parent's checked form (plain ints).
        checked = parent.token_ids + (last,)
        if checked != ids:
            return None
        parent.parent = None  # planned long ago: no chains of requests kept alive
        key = _key(ids_hash, lora_name)
        return self._remember(LogprobsRequest(checked, lora_name, parent, key=key))

    def _parent(self, key: int, lora_name: str | None) -> LogprobsRequest | None:
        """The remembered request of hash ``key`` (under ``lora_name``), or None; starts a
        new generation when it is of the current one and that one is full enough."""
        new = self._new
        parent = new.get(key)
        if parent is None:
            parent = self._old.get(key)
            if parent is None:
                parent = self._older.get(key)
        elif len(new) >= self.min_remember and len(new) >= len(self._old):
            self._older, self._old, self._new = self._old, new, {}  # a sampler's next step began
        if parent is None or parent.lora_name != lora_name:
            return None
        return parent

    def _remember(self, request: LogprobsRequest) -> LogprobsRequest:
        key = request._hash
        known = self._new.get(key)
        if known is None:
            known = self._old.get(key)
            if known is None:
                known = self._older.get(key)
        if known is not None and known == request:
            request = known
        self._new[key] = request
        if len(self._new) >= self.remember:
            self._older, self._old, self._new = self._old, self._new, {}
        return request
