"""Byte vocabularies: the exact bytes every token id of a tokenizer stands for.

* :class:`Token` — a ``bytes`` subclass tagged with its token id (equality and hash by id).
* :func:`decode_vocab` — ``(byte_vocab, str_vocab)`` of a Hugging Face tokenizer, indexed by
  token id, derived offline from the tokenizer's own structure.
* :func:`replace_prefix_tokens` — a multi-turn prompt that keeps the ids the model produced
  in earlier turns where a chat template would re-tokenise them.
"""

from genlm_backend.tokenization.token import Token
from genlm_backend.tokenization.turns import replace_prefix_tokens
from genlm_backend.tokenization.vocab import (
    BYTE2STR_FALLBACKS,
    UnsupportedTokenizerError,
    decode_vocab,
    token_bytes,
)

__all__ = [
    "Token",
    "decode_vocab",
    "token_bytes",
    "UnsupportedTokenizerError",
    "BYTE2STR_FALLBACKS",
    "replace_prefix_tokens",
]
