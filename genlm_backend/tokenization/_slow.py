"""Token bytes of tokenizers without a ``tokenizers`` backend ("slow" Python tokenizers).

Tried in this order:

0. **mistral_common** (transformers' ``MistralCommonBackend``, whose ``tokenizer`` is a
   ``mistral_common`` ``MistralTokenizer``): a tekken tokenizer reports each id's bytes
   itself (``id_to_byte_piece``, special tokens as their text); a SentencePiece one is read
   through its SentencePiece model as in 1.
1. **SentencePiece** (the tokenizer has an ``sp_model``, as transformers'
   ``SentencePieceBackend`` tokenizers do): each id's piece is looked up in the SentencePiece
   model; a byte piece (``<0x0A>``) is that byte, any other piece its text with ``▁`` read as a
   space — what SentencePiece's own decoder produces in the middle of a text.
2. **Byte-level** (the tokenizer has a ``byte_decoder`` mapping, as GPT-2-style Python
   tokenizers do): each character of the token string is one byte.
3. **Anything else**: the text ``tokenizer.decode([anchor, id])`` gives after the text of
   ``decode([anchor])``, in UTF-8, where the anchor is the encoding of ``"a"``; this is exact
   for tokenizers whose decoding is a concatenation of per-token strings. A token whose text
   is not a clean extension of the anchor's, or which decodes to U+FFFD (part of a
   multi-byte character that a string cannot hold), raises
   :class:`UnsupportedTokenizerError`.

In cases 1-3 added tokens (``tokenizer.added_tokens_decoder``) give their content in UTF-8;
SentencePiece control pieces (``<s>``) and the unknown piece give their own text.
"""

from __future__ import annotations

from typing import Any

from genlm_backend.tokenization._byte_level import byte_level_to_bytes
from genlm_backend.tokenization._fast import UnsupportedTokenizerError

__all__ = ["slow_token_bytes"]


def slow_token_bytes(tokenizer: Any, size: int) -> tuple[list[bytes], list[str | None]]:
    """Bytes and token strings of ids ``0 .. size-1`` of a tokenizer without a fast backend."""
    pieces = [_as_str(p) for p in tokenizer.convert_ids_to_tokens(list(range(size)))]
    mistral = _mistral_common_tokenizer(tokenizer)
    if mistral is not None and hasattr(mistral, "id_to_byte_piece"):
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        keep = SpecialTokenPolicy.KEEP
        return [mistral.id_to_byte_piece(i, keep) for i in range(size)], pieces
    if mistral is not None and _is_sentencepiece(getattr(mistral, "_model", None)):
        sp_model = mistral._model
        return [_sentencepiece_id(sp_model, i) for i in range(size)], pieces

    added_tokens = getattr(tokenizer, "added_tokens_decoder", None)
    added = {
        i: getattr(token, "content", str(token))
        for i, token in (added_tokens.items() if isinstance(added_tokens, dict) else ())
        if 0 <= i < size
    }
    text_ids = [i for i in range(size) if i not in added and pieces[i] is not None]
    if _is_sentencepiece(getattr(tokenizer, "sp_model", None)):
        decoded = _sentencepiece(tokenizer.sp_model, [pieces[i] for i in text_ids])
    elif isinstance(getattr(tokenizer, "byte_decoder", None), dict):
        decoded = byte_level_to_bytes([pieces[i] for i in text_ids])
    else:
        decoded = _by_decoding(tokenizer, text_ids)
    result = [b""] * size
    for i, value in zip(text_ids, decoded, strict=True):
        result[i] = value
    for i, content in added.items():
        result[i] = content.encode("utf-8")
    return result, pieces


def _mistral_common_tokenizer(tokenizer: Any) -> Any | None:
    """The tekken or SentencePiece tokenizer inside a ``mistral_common`` wrapper, if any."""
    wrapped = getattr(tokenizer, "tokenizer", None)
    inner = getattr(getattr(wrapped, "instruct_tokenizer", None), "tokenizer", None)
    return inner if type(inner).__module__.startswith("mistral_common.") else None


def _is_sentencepiece(model: Any) -> bool:
    return all(callable(getattr(model, name, None)) for name in ("id_to_piece", "is_byte"))


def _sentencepiece_id(sp_model: Any, sp_id: int) -> bytes:
    piece = sp_model.id_to_piece(sp_id)
    if sp_model.is_byte(sp_id):
        return bytes([int(piece[3:5], 16)])
    if sp_model.is_control(sp_id) or sp_model.is_unknown(sp_id):
        return piece.encode("utf-8")
    return piece.replace("\u2581", " ").encode("utf-8")


def _as_str(piece: Any) -> str | None:
    return piece if isinstance(piece, str) and piece else None


def _sentencepiece(sp_model: Any, pieces: list[str]) -> list[bytes]:
    result = []
    for piece in pieces:
        sp_id = sp_model.piece_to_id(piece)
        if sp_model.id_to_piece(sp_id) != piece:
            raise UnsupportedTokenizerError(
                f"token {piece!r} is not a piece of the tokenizer's SentencePiece model"
            )
        result.append(_sentencepiece_id(sp_model, sp_id))
    return result


def _by_decoding(tokenizer: Any, ids: list[int]) -> list[bytes]:
    anchor = tokenizer.encode("a", add_special_tokens=False)
    options = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    anchor_text = tokenizer.decode(anchor, **options)
    if not anchor or not anchor_text:
        raise UnsupportedTokenizerError(
            f"cannot decode the vocabulary of {type(tokenizer).__name__}: it has no fast "
            "backend and no usable anchor token"
        )
    result = []
    for i in ids:
        text = tokenizer.decode([*anchor, i], **options)
        if not text.startswith(anchor_text) or "\ufffd" in text:
            raise UnsupportedTokenizerError(
                f"cannot derive the exact bytes of token {i} of {type(tokenizer).__name__} "
                f"(decoded after an anchor it reads {text!r}); use a fast tokenizer"
            )
        result.append(text[len(anchor_text) :].encode("utf-8"))
    return result
