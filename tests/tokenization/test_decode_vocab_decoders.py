"""``decode_vocab`` on small in-memory tokenizers: one per decoder step, and slow tokenizers.

The reference for every token is the ``tokenizers`` library's own decoder run on
``[anchor, token, anchor]``: the text between the anchors' is what the token adds in the
middle of a text.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models

from genlm_backend.exceptions import InvalidRequestError
from genlm_backend.tokenization import Token, UnsupportedTokenizerError, decode_vocab
from tests.real_tokenizers import mistral_data_dir

ANCHOR = "q"


def word_level(pieces: list[str], decoder=None) -> Tokenizer:
    vocab = {piece: i for i, piece in enumerate([ANCHOR, *pieces])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=ANCHOR))
    if decoder is not None:
        tokenizer.decoder = decoder
    return tokenizer


def decoder_reference(tokenizer: Tokenizer, token_id: int) -> bytes:
    """What the token adds between two anchors, by the library's own decoder."""
    first = tokenizer.decode([0], skip_special_tokens=False)  # the anchor at the start
    middle = tokenizer.decode([0, 0], skip_special_tokens=False)[len(first) :]  # and after it
    text = tokenizer.decode([0, token_id, 0], skip_special_tokens=False)
    assert text.startswith(first) and text.endswith(middle)
    return text[len(first) : len(text) - len(middle)].encode("utf-8")


def assert_matches_decoder(tokenizer: Tokenizer) -> list[bytes]:
    byte_vocab, _ = decode_vocab(tokenizer)
    assert len(byte_vocab) == tokenizer.get_vocab_size(with_added_tokens=True)
    assert all(type(t) is Token for t in byte_vocab)
    for token_id in range(1, len(byte_vocab)):
        assert byte_vocab[token_id] == decoder_reference(tokenizer, token_id), token_id
    return [bytes(t) for t in byte_vocab]


WORDS = ["a", "b", "ab", "x y", "  two", "tail  ", "é", "東京", "😀", "Ġ", "▁", "▁▁a▁", "##"]


def test_no_decoder_joins_tokens_with_spaces():
    result = assert_matches_decoder(word_level(WORDS))
    assert result[1:3] == [b" a", b" b"]


@pytest.mark.parametrize("scheme", ["always", "first", "never"])
def test_metaspace(scheme):
    decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme, split=True)
    result = assert_matches_decoder(word_level([*WORDS, "▁the", "▁▁x▁"], decoder))
    assert result[-2:] == [b" the", b"  x "]


@pytest.mark.parametrize("cleanup", [True, False])
def test_wordpiece(cleanup):
    pieces = [*WORDS, "##ing", "hello", ",", ".", "n't", "'s", "'", "do", "[CLS]", "##,", "###"]
    result = assert_matches_decoder(word_level(pieces, decoders.WordPiece("##", cleanup)))
    assert result[len(WORDS) + 1 : len(WORDS) + 3] == [b"ing", b" hello"]


def test_wordpiece_with_another_prefix():
    assert_matches_decoder(word_level(["@@a", "b", "@@"], decoders.WordPiece("@@", True)))


def test_bpe_decoder_suffix():
    pieces = ["a</w>", "b", "ab</w>cd</w>", "</w>"]
    result = assert_matches_decoder(word_level(pieces, decoders.BPEDecoder(suffix="</w>")))
    assert result[1] == b"a "


def test_replace_then_strip_per_token():
    decoder = decoders.Sequence([decoders.Replace("_", " "), decoders.Strip(" ", 1, 1)])
    assert_matches_decoder(word_level(["_a_", "__b__", "c", "_x", "y_"], decoder))


@pytest.mark.parametrize(("left", "right"), [(0, 0), (2, 0), (1, 2), (3, 3)])
def test_strip_per_token(left, right):
    # tokens made only of the stripped character make the library panic (tokenizers 0.23)
    pieces = ["xxaxx", "xa", "ax", "xxxaxxx", "abc", "axbxc"]
    assert_matches_decoder(word_level(pieces, decoders.Strip("x", left, right)))


def test_byte_fallback_then_fuse_and_strip_like_sentencepiece():
    decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    pieces = ["▁a", "<0x0A>", "<0x0a>", "<0x41>", "<0x+A>", "<0xZZ>", "<0x0A", "<0x0AA>", "▁"]
    tokenizer = word_level(pieces, decoder)
    result, _ = decode_vocab(tokenizer)
    assert [bytes(t) for t in result[1:]] == [
        b" a",
        b"\n",
        b"\n",
        b"A",
        b"\n",
        b"<0xZZ>",
        b"<0x0A",
        b"<0x0AA>",
        b" ",
    ]
    for token_id in range(1, len(result)):
        # single bytes below 0x80 are whole characters, so the decoder agrees
        assert result[token_id] == decoder_reference(tokenizer, token_id)


def test_byte_fallback_bytes_above_0x7f_are_single_bytes():
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = word_level(pieces, decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()]))
    byte_vocab, str_vocab = decode_vocab(tokenizer, byte2str_fallback="tokenizer")
    assert [bytes(t) for t in byte_vocab[1:]] == [bytes([b]) for b in range(256)]
    assert str_vocab[1 + 0xE2] == "<0xE2>"  # not UTF-8: the tokenizer's own piece
    assert tokenizer.decode([1 + 0xE2, 1 + 0x82, 1 + 0xAC]) == "€"
    assert b"".join(byte_vocab[1 + b] for b in (0xE2, 0x82, 0xAC)) == "€".encode()


def test_byte_level_with_pieces_outside_the_alphabet():
    # a piece holding any non-alphabet character is its own UTF-8 (tokenizers' rule)
    pieces = ["Ġa", "ĠðŁĺ", "Ģ", "東", "Ġ ", "a\u0080", "<|end|>", "ĠĠ"]
    tokenizer = word_level(pieces, decoders.ByteLevel())
    byte_vocab, _ = decode_vocab(tokenizer)
    assert [bytes(t) for t in byte_vocab[1:]] == [
        b" a",
        b" \xf0\x9f\x98",
        b"\x80",
        "東".encode(),
        "Ġ ".encode(),
        "a\u0080".encode(),
        b"<|end|>",
        b"  ",
    ]
    assert tokenizer.decode([2, 3]) == " 😀"


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=20, unique=True))
def test_replace_and_metaspace_on_any_pieces(pieces):
    pieces = [p for p in pieces if p != ANCHOR]
    decoder = decoders.Sequence(
        [decoders.Replace("ab", "-"), decoders.Metaspace(replacement="_", prepend_scheme="never")]
    )
    assert_matches_decoder(word_level(pieces, decoder))


def test_holes_are_empty_tokens_and_all_ids_are_covered():
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 5, "c": 2}, unk_token="a"))
    byte_vocab, str_vocab = decode_vocab(tokenizer)
    # three tokens, but ids up to 5: the vocabulary covers ids 0..5, holes are empty
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 3
    assert [bytes(t) for t in byte_vocab] == [b" a", b"", b" c", b"", b"", b" b"]
    assert [t.token_id for t in byte_vocab] == list(range(6))
    assert str_vocab[1] == ""


def test_added_token_sharing_a_string_with_a_model_token():
    tokenizer = word_level(["a", "b"], decoders.ByteLevel())
    tokenizer.add_special_tokens(["<s>"])
    tokenizer.add_tokens(["Ġnew"])
    byte_vocab, _ = decode_vocab(tokenizer)
    assert [bytes(t) for t in byte_vocab] == [b"q", b"a", b"b", b"<s>", b" new"]


@pytest.mark.parametrize(
    "decoder",
    [
        decoders.CTC(),
        decoders.Replace(Regex("a+"), "b"),
        decoders.Sequence([decoders.ByteLevel(), decoders.Replace("a", "b")]),
        decoders.Sequence([decoders.Fuse(), decoders.Replace("a", "b")]),
        decoders.Sequence([decoders.ByteFallback(), decoders.Replace("a", "b")]),
    ],
    ids=[
        "ctc",
        "regex-replace",
        "replace-after-byte-level",
        "replace-after-fuse",
        "replace-after-byte-fallback",
    ],
)
def test_context_dependent_decoders_are_refused(decoder):
    with pytest.raises(UnsupportedTokenizerError, match="decoder") as info:
        decode_vocab(word_level(["a", "b"], decoder))
    assert isinstance(info.value, InvalidRequestError)


# ---------------------------------------------------------------------------------------------
# Tokenizers without a ``tokenizers`` backend


def test_slow_sentencepiece_tokenizer_matches_the_fast_one():
    from transformers import BertGenerationTokenizer

    slow = BertGenerationTokenizer(vocab_file=str(mistral_data_dir() / "tokenizer.model.v1"))
    assert getattr(slow, "backend_tokenizer", None) is None
    byte_vocab, _ = decode_vocab(slow)
    assert len(byte_vocab) == len(slow)
    fast_vocab, _ = decode_vocab(_fast_sentencepiece())
    assert [bytes(t) for t in byte_vocab[:32000]] == [bytes(t) for t in fast_vocab]
    # the added tokens of this class are their own text
    added = {i: t.content for i, t in slow.added_tokens_decoder.items() if i >= 32000}
    assert {i: bytes(byte_vocab[i]) for i in added} == {i: c.encode() for i, c in added.items()}


def _fast_sentencepiece():
    from tests.real_tokenizers import load_tokenizer

    return load_tokenizer("sentencepiece")


class CharTokenizer:
    """A minimal slow tokenizer: one token per character, decoding by concatenation."""

    def __init__(self, chars: str):
        self.chars = chars

    def __len__(self):
        return len(self.chars)

    def get_vocab(self):
        return {c: i for i, c in enumerate(self.chars)}

    def convert_ids_to_tokens(self, ids):
        return [self.chars[i] for i in ids]

    def encode(self, text, add_special_tokens=True):
        return [self.chars.index(c) for c in text]

    def decode(self, ids, **kwargs):
        return "".join(self.chars[i] for i in ids)


def test_slow_tokenizer_without_structure_is_decoded_after_an_anchor():
    byte_vocab, str_vocab = decode_vocab(CharTokenizer("abé東 "))
    assert [bytes(t) for t in byte_vocab] == [c.encode() for c in "abé東 "]
    assert str_vocab == list("abé東 ")


def test_slow_tokenizer_with_partial_characters_is_refused():
    class Lossy(CharTokenizer):
        def decode(self, ids, **kwargs):
            return "".join("\ufffd" if self.chars[i] == "X" else self.chars[i] for i in ids)

    with pytest.raises(UnsupportedTokenizerError, match="token 2"):
        decode_vocab(Lossy("abX"))


def _mistral_common_backend(file_name: str, saved_as: str):
    import shutil
    import tempfile
    from pathlib import Path

    from transformers import MistralCommonBackend

    with tempfile.TemporaryDirectory() as folder:
        shutil.copyfile(mistral_data_dir() / file_name, Path(folder) / saved_as)
        return MistralCommonBackend.from_pretrained(folder)


def test_mistral_common_tekken_matches_the_fast_tokenizer(decoded):
    tokenizer = _mistral_common_backend("tekken_240718.json", "tekken.json")
    assert getattr(tokenizer, "backend_tokenizer", None) is None
    byte_vocab, _ = decode_vocab(tokenizer)
    assert [bytes(t) for t in byte_vocab] == [bytes(t) for t in decoded("tekken")[0]]


def test_mistral_common_sentencepiece_matches_the_sentencepiece_library():
    import sentencepiece

    name = "mistral_instruct_tokenizer_240323.model.v3"
    tokenizer = _mistral_common_backend(name, "tokenizer.model.v3")
    byte_vocab, _ = decode_vocab(tokenizer)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_data_dir() / name))
    assert len(byte_vocab) == sp.get_piece_size() == 32768
    for i, token in enumerate(byte_vocab):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            assert token == bytes([int(piece[3:5], 16)])
        elif sp.is_control(i) or sp.is_unknown(i):
            assert token == piece.encode()
        else:
            assert sp.decode([sp.piece_to_id("▁x"), i]).encode() == b"x" + token
