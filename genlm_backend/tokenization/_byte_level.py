"""The byte-level alphabet of GPT-2-style BPE: 256 printable characters, one per byte.

Byte-level BPE vocabularies (GPT-2, Llama-3, tekken, SmolLM2, Qwen, ...) spell every byte
as one printable character: the bytes that are printable in Latin-1 (``!``..``~``,
``¡``..``¬``, ``®``..``ÿ``) stand for themselves; the other 68 bytes (controls, space,
DEL, NBSP, soft hyphen) take the characters U+0100, U+0101, ... in byte order, so a space
is ``Ġ`` (U+0120) and a newline ``Ċ`` (U+010A).

:func:`byte_level_to_bytes` maps many token strings at once with one table lookup over all
their characters (numpy), which is what makes decoding a 131k vocabulary fast.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np

__all__ = ["BYTE_TO_CHAR", "CHAR_TO_BYTE", "byte_level_to_bytes"]


def _byte_alphabet() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    printable_set = set(printable)
    chars = [""] * 256
    next_code = 0x100
    for byte in range(256):
        if byte in printable_set:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(next_code)
            next_code += 1
    return chars


#: ``BYTE_TO_CHAR[b]`` is the character that spells byte ``b``.
BYTE_TO_CHAR: tuple[str, ...] = tuple(_byte_alphabet())
#: The inverse of :data:`BYTE_TO_CHAR`.
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}

_MAX_CODE = max(map(ord, BYTE_TO_CHAR))  # U+0143
_NOT_IN_ALPHABET = 256
# code point -> byte, or _NOT_IN_ALPHABET; the last slot catches every code point above _MAX_CODE
_LOOKUP = np.full(_MAX_CODE + 2, _NOT_IN_ALPHABET, dtype=np.uint16)
for _byte, _char in enumerate(BYTE_TO_CHAR):
    _LOOKUP[ord(_char)] = _byte


def byte_level_to_bytes(pieces: list[str]) -> list[bytes]:
    """Maps byte-level token strings to the bytes they spell.

    A piece made only of alphabet characters gives one byte per character. A piece holding
    any other character is not byte-level (an added token such as ``"<|endoftext|>"`` in
    some vocabularies, or text like ``"東"``) and gives its own UTF-8 bytes, as the
    ``ByteLevel`` decoder of Hugging Face tokenizers does.
    """
    if not pieces:
        return []
    text = "".join(pieces)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    mapped = _LOOKUP[np.minimum(codes, _MAX_CODE + 1)]
    data = mapped.astype(np.uint8).tobytes()  # one byte per character
    ends = list(accumulate(map(len, pieces)))
    starts = [0, *ends[:-1]]
    result = [data[a:b] for a, b in zip(starts, ends, strict=True)]
    bad_positions = np.flatnonzero(mapped == _NOT_IN_ALPHABET)
    if bad_positions.size:
        bad_pieces = np.unique(np.searchsorted(np.asarray(ends), bad_positions, side="right"))
        for index in bad_pieces.tolist():
            result[index] = pieces[index].encode("utf-8")
    return result
