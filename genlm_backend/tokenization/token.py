"""``Token``: the bytes of one vocabulary entry, tagged with its token id."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Token"]


class Token(bytes):
    """The bytes a token stands for, tagged with its token id.

    A ``Token`` *is* a ``bytes`` object holding the token's bytes, so ``b"".join(tokens)``,
    slicing, ``len``, ``startswith`` and iterating (which gives ints) work as on bytes. It
    differs from plain bytes in identity:

    * Two ``Token`` objects are equal, and hash alike, exactly when their token ids are equal;
      their bytes are not compared. Distinct ids with the same bytes (a vocabulary may hold
      duplicates) stay distinct as dict keys and set members, and equal ids are equal across
      separately decoded vocabularies.
    * Two ``Token`` objects order (``<``, ``<=``, ``>``, ``>=``) by token id, as in
      genlm-backend 0.3.1: ``Token(1, b"z") < Token(2, b"a")``, and ``sorted(byte_vocab)``
      follows the ids. Sort by ``bytes(token)`` (or ``Token.as_bytes``) for byte order.
    * A ``Token`` compared with plain ``bytes`` (not a ``Token``) compares, and orders, by
      content, so ``Token(token_id=3, byte_string=b"ab") == b"ab"``. Such a mixed comparison
      may be equal while the hashes differ (the hash is the id's): do not mix ``Token`` and
      plain ``bytes`` as keys of one dict, nor in one list you sort.

    Tokens are immutable; they pickle, copy and deep-copy keeping the id.

    Args:
        token_id: The token id, a non-negative ``int`` (``bool`` is refused).
        byte_string: The token's bytes (``bytes``; a ``Token`` is accepted and unwrapped).

    Raises:
        InvalidRequestTypeError: ``token_id`` is not an int or ``byte_string`` is not bytes.
        InvalidRequestError: ``token_id`` is negative.

    Attributes:
        token_id: The token id (``int``).
        byte_string: The token's bytes as plain ``bytes`` (never a ``Token``).
    """

    token_id: int
    byte_string: bytes

    def __new__(cls, token_id: int, byte_string: bytes) -> Self:
        if type(token_id) is not int:
            if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
                raise InvalidRequestTypeError(
                    f"token_id must be a non-negative int, got {token_id!r} "
                    f"({type(token_id).__name__})"
                )
            token_id = token_id.__index__()  # numpy / torch integer scalars
        if token_id < 0:
            raise InvalidRequestError(f"token_id must be a non-negative int, got {token_id!r}")
        if type(byte_string) is not bytes:
            if not isinstance(byte_string, bytes):
                raise InvalidRequestTypeError(
                    f"byte_string of token {token_id} must be bytes, got {byte_string!r} "
                    f"({type(byte_string).__name__})"
                )
            byte_string = bytes(byte_string)  # a Token or another bytes subclass
        self = bytes.__new__(cls, byte_string)
        attributes = self.__dict__
        attributes["token_id"] = token_id
        attributes["byte_string"] = byte_string
        return self

    @classmethod
    def _unchecked(cls, token_id: int, byte_string: bytes) -> Token:
        """Builds a Token from a known-good int and plain bytes (no validation)."""
        self = bytes.__new__(cls, byte_string)
        attributes = self.__dict__
        attributes["token_id"] = token_id
        attributes["byte_string"] = byte_string
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Token is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Token is immutable; cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id == other.token_id
        if isinstance(other, (bytes, bytearray, memoryview)):
            return bytes.__eq__(self, other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __lt__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id < other.token_id
        return bytes.__lt__(self, other)

    def __le__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id <= other.token_id
        return bytes.__le__(self, other)

    def __gt__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id > other.token_id
        return bytes.__gt__(self, other)

    def __ge__(self, other: object) -> bool:
        if isinstance(other, Token):
            return self.token_id >= other.token_id
        return bytes.__ge__(self, other)

    def __hash__(self) -> int:
        return hash(self.token_id)

    def __repr__(self) -> str:
        return f"Token(token_id={self.token_id}, byte_string={self.byte_string!r})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[type[Token], tuple[int, bytes]]:
        return (Token, (self.token_id, self.byte_string))

    def __copy__(self) -> Token:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Token:
        return self

    @staticmethod
    def is_plain_bytes(value: object) -> bool:
        """True when ``value`` is ``bytes`` but not a ``Token``."""
        return isinstance(value, bytes) and not isinstance(value, Token)

    @staticmethod
    def as_bytes(value: bytes) -> bytes:
        """The plain ``bytes`` of a ``Token`` or of any ``bytes`` object.

        Raises:
            InvalidRequestTypeError: ``value`` is not bytes.
        """
        if isinstance(value, Token):
            return value.byte_string
        if type(value) is bytes:
            return value
        if isinstance(value, bytes):
            return bytes(value)
        raise InvalidRequestTypeError(
            f"expected a Token or bytes, got {value!r} ({type(value).__name__})"
        )
