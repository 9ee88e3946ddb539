"""Exact token bytes of a Hugging Face *fast* tokenizer, read from its own structure.

``tokenizers.Tokenizer.decode(ids)`` looks every id up (added tokens first, then the model's
vocabulary) and passes the token strings through the tokenizer's decoder. The decoder is a
chain of steps with a fixed meaning; this module replays that chain on the whole vocabulary
at once, for a token standing *in the middle of a text* (not first, not last), so that

    b"".join(token_bytes[i] for i in ids)

equals the decoded text, in UTF-8, except at the very start and end of the text (where a
decoder may strip a space). Steps that stand for bytes (``ByteLevel``, ``ByteFallback``)
give bytes that need not be valid UTF-8: half an emoji stays half an emoji.

Supported decoder steps, and their meaning for a token in the middle of a text:

=================  =======================================================================
``ByteLevel``      every character is one byte of the GPT-2 alphabet (``Ġ`` = space); a
                   token holding another character gives its own UTF-8
``ByteFallback``   a token ``<0xXY>`` is the single byte 0xXY
``Replace``        replaces a literal string (``▁`` -> space) in each token
``Metaspace``      the replacement character (``▁``) is a space
``WordPiece``      ``##rest`` is ``rest``; any other token gets a leading space; with
                   ``cleanup`` the decoder's own per-token clean-up (`` ,`` -> ``,``, ...)
``BPEDecoder``     the end-of-word suffix (``</w>``) is a space
``Strip``          per token before the tokens are fused; after that it only trims the two
                   ends of the whole text, which a token in the middle never touches
``Fuse``           joins the tokens: no change to any token's bytes
(no decoder)       tokens are joined by spaces: a leading space
=================  =======================================================================

Anything else (``CTC``, which merges repeated tokens; regex ``Replace``; a string step
after the tokens were joined or turned into bytes) depends on the neighbouring tokens, and
:class:`UnsupportedTokenizerError` is raised rather than returning approximate bytes.

Added tokens, special ones included, go through the decoder like any vocabulary entry, as
``tokenizers`` does when decoding with ``skip_special_tokens=False``: in practice their
content in UTF-8 (``<|endoftext|>``, ``<s>``), with a leading space under a WordPiece decoder
(``" [CLS]"``, ``" [UNK]"``), which is what they add to a text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from genlm_backend.exceptions import UnsupportedTokenizerError
from genlm_backend.tokenization._byte_level import byte_level_to_bytes

__all__ = ["UnsupportedTokenizerError", "fast_token_bytes", "decoder_steps"]


# ``<0xXY>`` as the ByteFallback decoder reads it: Rust's u8::from_str_radix(.., 16) over the
# two characters, which also takes a leading '+'.
_BYTE_PIECE = re.compile(r"<0x(\+[0-9A-Fa-f]|[0-9A-Fa-f]{2})>")

# The clean-up of the WordPiece decoder, applied to each token after its leading space.
_WORDPIECE_CLEANUP = [
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" do not", " don't"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
]


def decoder_steps(backend: Any) -> list[dict[str, Any]] | None:
    """The decoder of a ``tokenizers.Tokenizer`` as a flat list of steps (None: no decoder)."""
    decoder = backend.decoder
    if decoder is None:
        return None
    steps: list[dict[str, Any]] = []

    def flatten(step: dict[str, Any]) -> None:
        if step.get("type") == "Sequence":
            for inner in step["decoders"]:
                flatten(inner)
        else:
            steps.append(step)

    flatten(json.loads(decoder.__getstate__()))
    return steps


def fast_token_bytes(backend: Any, size: int) -> tuple[list[bytes], list[str | None]]:
    """Bytes and token strings of every id of a ``tokenizers.Tokenizer``.

    Covers ids ``0 .. size-1``, and further up to the largest id when the vocabulary has
    holes (then ``len(tokenizer)``, a count of tokens, is below the largest id + 1). Ids the
    tokenizer does not know (holes) give ``b""`` and ``None``.
    """
    pieces: list[str | None] = list(map(backend.id_to_token, range(size)))  # added first
    num_found = size - pieces.count(None)
    if num_found < backend.get_vocab_size(with_added_tokens=True):  # ids beyond ``size``
        largest = max(backend.get_vocab(with_added_tokens=True).values())
        pieces += map(backend.id_to_token, range(size, largest + 1))
        size = len(pieces)
    if None not in pieces:
        return _apply_decoder(decoder_steps(backend), pieces), pieces  # type: ignore[arg-type]
    text_ids = [i for i, piece in enumerate(pieces) if piece is not None]
    result = [b""] * size
    decoded = _apply_decoder(decoder_steps(backend), [pieces[i] for i in text_ids])
    for i, value in zip(text_ids, decoded, strict=True):
        result[i] = value
    return result, pieces


def _apply_decoder(steps: list[dict[str, Any]] | None, pieces: list[str]) -> list[bytes]:
    """Replays the decoder ``steps`` on every piece, as if it stood in the middle of a text."""
    if steps is None:
        return [(" " + piece).encode("utf-8") for piece in pieces]
    values: list[Any] = list(pieces)  # str, or bytes once a step turned a token into bytes
    has_bytes = False  # some values are bytes
    joined = False  # a step has joined all tokens into one text
    for step in steps:
        kind = step.get("type")
        if kind == "Fuse":
            joined = True
            continue
        if kind == "Strip" and joined:
            continue  # trims the ends of the whole text only
        if has_bytes or joined:
            raise UnsupportedTokenizerError(
                f"decoder step {kind!r} comes after the tokens were joined or turned into "
                f"bytes ({_describe(steps)}); its effect depends on neighbouring tokens"
            )
        if kind == "ByteLevel":
            values = byte_level_to_bytes(values)
            has_bytes = joined = True
        elif kind == "ByteFallback":
            values = [_byte_piece(v) for v in values]
            has_bytes = True
        elif kind == "Replace":
            pattern = step.get("pattern", {})
            if "String" not in pattern:
                raise UnsupportedTokenizerError(
                    f"decoder step Replace with pattern {pattern!r} is not a literal string"
                )
            old, new = pattern["String"], step.get("content", "")
            values = [v.replace(old, new) for v in values]
        elif kind == "Metaspace":
            values = [v.replace(step.get("replacement", "\u2581"), " ") for v in values]
        elif kind == "WordPiece":
            values = _wordpiece(values, step.get("prefix", "##"), step.get("cleanup", True))
        elif kind == "BPEDecoder":
            values = [v.replace(step.get("suffix", "</w>"), " ") for v in values]
        elif kind == "Strip":
            values = [
                _strip(v, step.get("content", " "), step.get("start", 0), step.get("stop", 0))
                for v in values
            ]
        else:
            raise UnsupportedTokenizerError(
                f"decoder step {kind!r} ({_describe(steps)}) is not supported: its output "
                "for one token depends on the tokens around it or is unknown"
            )
    return [v if type(v) is bytes else v.encode("utf-8") for v in values]


def _byte_piece(piece: str) -> str | bytes:
    if len(piece) == 6 and piece.startswith("<0x"):
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
    return piece


def _wordpiece(values: list[str], prefix: str, cleanup: bool) -> list[str]:
    size = len(prefix)
    out = [v[size:] if v.startswith(prefix) else " " + v for v in values]
    if cleanup:
        for old, new in _WORDPIECE_CLEANUP:
            out = [v.replace(old, new) if old in v else v for v in out]
    return out


def _strip(value: str, char: str, start: int, stop: int) -> str:
    begin = 0
    while begin < start and begin < len(value) and value[begin] == char:
        begin += 1
    end = len(value)
    while len(value) - end < stop and end > begin and value[end - 1] == char:
        end -= 1
    return value[begin:end]


def _describe(steps: list[dict[str, Any]]) -> str:
    return "decoder " + " -> ".join(str(step.get("type")) for step in steps)
