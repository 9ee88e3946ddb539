"""``decode_vocab``: the exact bytes and a readable string for every token id."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError
from genlm_backend.tokenization._fast import UnsupportedTokenizerError, fast_token_bytes
from genlm_backend.tokenization._slow import slow_token_bytes
from genlm_backend.tokenization.token import Token

__all__ = ["decode_vocab", "token_bytes", "UnsupportedTokenizerError", "BYTE2STR_FALLBACKS"]

#: The accepted values of ``byte2str_fallback``.
BYTE2STR_FALLBACKS = ("tokenizer", "latin1", "replace")


def decode_vocab(
    tokenizer: Any, byte2str_fallback: str = "tokenizer"
) -> tuple[list[Token], list[str]]:
    """The bytes every token id stands for, and a string for each.

    ``byte_vocab[i]`` is a :class:`Token` (exactly that class) with ``token_id == i`` holding
    the bytes token ``i`` contributes to a decoded text when it stands in the middle of it,
    so that for any ids ``b"".join(byte_vocab[i] for i in ids)`` equals the UTF-8 of
    ``tokenizer.decode(ids, skip_special_tokens=False)`` up to the start of the text, where
    decoders may drop one leading space (SentencePiece's ``▁Hello`` is ``b" Hello"`` here; a
    WordPiece word such as ``hello`` is ``b" hello"`` and ``##lo`` is ``b"lo"``), and up to
    transformers' optional ``clean_up_tokenization_spaces``, which rewrites the joined text
    (``" ,"`` -> ``","``) and so is no property of a token. A token's bytes need not be valid
    UTF-8: byte-level BPE splits an emoji into tokens holding parts of its four bytes.

    How the bytes are found (nothing is downloaded, ever):

    * A fast tokenizer (one with ``backend_tokenizer``; a bare ``tokenizers.Tokenizer`` also
      works) is read from its own structure: token strings from the model and the added
      tokens, then the decoder's steps replayed on the whole vocabulary (``ByteLevel`` =
      GPT-2 byte alphabet, ``ByteFallback`` = ``<0x0A>`` pieces, ``Metaspace``/``Replace``
      = ``▁`` as space, ``WordPiece`` = ``##`` continuation, ...). See
      ``genlm_backend.tokenization._fast`` for the full table.
    * A slow tokenizer is read through its SentencePiece model (``sp_model``), its GPT-2
      ``byte_decoder``, or else by decoding each token after an anchor token (see
      ``genlm_backend.tokenization._slow``).
    * Added tokens, special ones included, go through the decoder like any token, as the
      ``tokenizers`` library decodes them: in practice a special token is its own text in
      UTF-8 (``<s>``, ``<|endoftext|>``), with the leading space a WordPiece decoder puts
      before every word (``b" [CLS]"``). A slow tokenizer's added tokens are their text.
    * Ids below ``len(tokenizer)`` that no token has (holes) are ``Token(i, b"")`` with the
      string ``""``. The vocabulary covers ``max(len(tokenizer), largest id + 1)`` ids.

    Args:
        tokenizer: A Hugging Face tokenizer (fast or slow) or a ``tokenizers.Tokenizer``.
        byte2str_fallback: How ``str_vocab`` spells a token whose bytes are not valid UTF-8
            (valid ones are always their UTF-8 decoding): ``"tokenizer"`` the tokenizer's own
            token string (e.g. ``"ĠðŁ"``), ``"latin1"`` one character per byte,
            ``"replace"`` UTF-8 with U+FFFD for the invalid bytes.

    Returns:
        ``(byte_vocab, str_vocab)``, two lists indexed by token id.

    Raises:
        InvalidRequestError: ``byte2str_fallback`` is not one of the three values.
        InvalidRequestTypeError: ``tokenizer`` is not a tokenizer object (for instance a
            model name: load the tokenizer yourself, this function never downloads).
        UnsupportedTokenizerError: the tokenizer's decoding cannot be written as fixed
            bytes per token (for instance a CTC decoder); a subclass of
            ``InvalidRequestError``.
    """
    if byte2str_fallback not in BYTE2STR_FALLBACKS:
        raise InvalidRequestError(
            f"unknown byte2str_fallback {byte2str_fallback!r}; expected one of "
            f"{', '.join(map(repr, BYTE2STR_FALLBACKS))}"
        )
    with _gc_paused():
        byte_strings, pieces = token_bytes(tokenizer)
        byte_vocab = list(map(Token._unchecked, range(len(byte_strings)), byte_strings))
        str_vocab = _to_strings(byte_strings, pieces, byte2str_fallback)
    return byte_vocab, str_vocab


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector while a vocabulary's objects are built.

    Each Token has a ``__dict__``, so the collector tracks it; building 10^5 of them starts
    many collections, and each one walks every tracked object (a loaded model holds many),
    which would make decoding a large vocabulary several times slower
    (``benchmarks/README.md``). Nothing built here forms a reference cycle, so the
    pause (process-wide, for the fraction of a second this takes) delays no memory release.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def token_bytes(tokenizer: Any) -> tuple[list[bytes], list[str | None]]:
    """Plain bytes and the tokenizer's own token string of every id (None for holes)."""
    backend = _fast_backend(tokenizer)
    is_hf = _is_hf_tokenizer(tokenizer)
    if backend is None and not is_hf:
        raise InvalidRequestTypeError(
            f"decode_vocab needs a tokenizer object (a Hugging Face tokenizer or a "
            f"tokenizers.Tokenizer), got {tokenizer!r} ({type(tokenizer).__name__}); load "
            "the tokenizer first: decode_vocab never downloads anything"
        )
    if backend is not None:
        size = len(tokenizer) if is_hf else backend.get_vocab_size(with_added_tokens=True)
        return fast_token_bytes(backend, size)
    largest = max(tokenizer.get_vocab().values(), default=-1)
    return slow_token_bytes(tokenizer, max(len(tokenizer), largest + 1))


def _is_hf_tokenizer(tokenizer: Any) -> bool:
    return all(
        callable(getattr(tokenizer, name, None))
        for name in ("convert_ids_to_tokens", "decode", "encode", "get_vocab", "__len__")
    )


def _fast_backend(tokenizer: Any) -> Any | None:
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - a dependency of this package
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _to_strings(byte_strings: list[bytes], pieces: list[str | None], fallback: str) -> list[str]:
    strings = [b.decode("utf-8", "replace") for b in byte_strings]
    for i, text in enumerate(strings):
        if "\ufffd" not in text:
            continue
        raw = byte_strings[i]
        try:
            raw.decode("utf-8")  # a genuine U+FFFD in valid UTF-8
        except UnicodeDecodeError:
            if fallback == "latin1":
                strings[i] = raw.decode("latin-1")
            elif fallback == "tokenizer":
                strings[i] = pieces[i] if pieces[i] is not None else text
    return strings
