"""``decode_vocab`` on real tokenizers of every family, against independent references.

References, per family (none of them uses ``genlm_backend``):

* tekken: the ``token_bytes`` (base64) that mistral_common's ``tekken_240718.json`` stores
  for every rank; id = 1000 + rank.
* llama3: the tiktoken ranks file ``tokenizer.model`` shipped next to ``tokenizer.json``.
* gpt2, smollm2: the token strings (gpt2 ``vocab.json``; the token list stored in the GGUF
  file) mapped through GPT-2's byte alphabet, rebuilt here from Unicode categories.
* sentencepiece, unigram: the ``sentencepiece`` library reading the ``.model`` file.
* wordpiece: ``vocab.txt`` and the WordPiece decoder of the ``tokenizers`` library.
* every family: round trips of sample texts through ``tokenizer.encode``/``decode``.
"""

from __future__ import annotations

import base64
import json
import socket

import pytest
import sentencepiece
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm_backend.tokenization import Token, decode_vocab
from tests.real_tokenizers import (
    FAMILIES,
    asset_path,
    fresh_tokenizer,
    load_tokenizer,
    mistral_data_dir,
    smollm2_gguf_path,
)

BYTE_LEVEL = ["gpt2", "tekken", "llama3", "smollm2"]

SAMPLE_TEXTS = [
    "Hello, world!",
    "multiple   spaces  here",
    "new\nlines\n\nand\ttabs\r\nend",
    "accents: café naïve façade Ångström",
    "CJK: 東京は日本の首都です。中文测试",
    "emoji: 😀👍🏽🎉 family 👨‍👩‍👧",
    "code:\ndef f(x):\n    return {'a': [x ** 2]}  # comment\n",
    " leading and trailing  ",
    "mixed — dashes … ellipsis “quotes” ¿qué?",
    "numbers 1234567 3.14159",
]


def gpt2_alphabet() -> dict[str, int]:
    """GPT-2's byte alphabet: a byte whose Latin-1 character is printable and not a space
    stands for itself; the others take U+0100, U+0101, ... in byte order."""
    shifted = iter(range(0x100, 0x200))
    table = {}
    for byte in range(256):
        char = chr(byte)
        visible = char.isprintable() and not char.isspace()
        table[chr(byte) if visible else chr(next(shifted))] = byte
    return table


def special_ids(tokenizer) -> dict[int, str]:
    return {
        i: added.content
        for i, added in tokenizer.backend_tokenizer.get_added_tokens_decoder().items()
        if added.special
    }


def joined(byte_vocab, ids) -> bytes:
    return b"".join(byte_vocab[i] for i in ids)


# ---------------------------------------------------------------------------------------------
# Shape and types


@pytest.mark.parametrize("family", FAMILIES)
def test_one_token_per_id(family, decoded):
    tokenizer = load_tokenizer(family)
    byte_vocab, str_vocab = decoded(family)
    assert len(byte_vocab) == len(tokenizer) == len(str_vocab)
    assert type(byte_vocab[0]) is Token
    assert all(type(token) is Token for token in byte_vocab)
    assert [token.token_id for token in byte_vocab] == list(range(len(byte_vocab)))
    assert all(type(token.byte_string) is bytes for token in byte_vocab)
    assert all(type(text) is str for text in str_vocab)


@pytest.mark.parametrize("family", FAMILIES)
def test_str_vocab_is_the_utf8_reading_of_valid_tokens(family, decoded):
    byte_vocab, str_vocab = decoded(family)
    for token, text in zip(byte_vocab, str_vocab, strict=True):
        try:
            expected = token.byte_string.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert text == expected


# ---------------------------------------------------------------------------------------------
# Round trips of sample texts


def _round_trip_prefix(family: str) -> bytes:
    # SentencePiece-style and WordPiece tokenizers mark a word start (``▁``, no ``##``); a
    # word-start token holds its leading space here, and the decoder drops it only for the
    # very first token of a text. SentencePiece's encoder also adds that first space.
    return b" " if family in ("sentencepiece", "unigram", "wordpiece") else b""


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_round_trip_matches_the_tokenizers_decode(family, text, decoded):
    tokenizer = load_tokenizer(family)
    byte_vocab, _ = decoded(family)
    ids = tokenizer.encode(text, add_special_tokens=False)
    # transformers' optional clean-up rewrites the joined text (" ," -> ","); it is not a
    # property of any token, so the reference decodes without it.
    text_out = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert joined(byte_vocab, ids) == _round_trip_prefix(family) + text_out.encode("utf-8")


@pytest.mark.parametrize("family", ["sentencepiece", *BYTE_LEVEL])
@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_round_trip_gives_back_the_text_for_lossless_tokenizers(family, text, decoded):
    # Byte-level BPE and SentencePiece with byte fallback have no normaliser and cover every
    # byte, so they are lossless (SentencePiece adds one leading space). WordPiece is not
    # (lower-cases, strips accents, drops whitespace, maps unknown words to [UNK]); nor is
    # the unigram model (NFKC normalisation, <unk> for characters outside its 1000 pieces).
    tokenizer = load_tokenizer(family)
    byte_vocab, _ = decoded(family)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert joined(byte_vocab, ids) == _added_space(family, text) + text.encode("utf-8")


def _added_space(family: str, text: str) -> bytes:
    # SentencePiece's encoder (Metaspace, prepend_scheme "first") marks the text start as a
    # word start: it adds one space unless the text already starts with one.
    return b" " if family == "sentencepiece" and not text.startswith(" ") else b""


@pytest.mark.parametrize("family", ["gpt2", "llama3", "sentencepiece"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(
        alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\u2581"),
        min_size=1,
    )
)
def test_round_trip_of_any_text(family, text, decoded):
    # Lone surrogates cannot be encoded at all; "▁" is excluded because SentencePiece reads
    # it as a space, by design.
    tokenizer = load_tokenizer(family)
    byte_vocab, _ = decoded(family)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert joined(byte_vocab, ids) == _added_space(family, text) + text.encode("utf-8")


# ---------------------------------------------------------------------------------------------
# Independent per-token references


def test_tekken_matches_the_bytes_stored_in_tekken_json(decoded):
    data = json.loads((mistral_data_dir() / "tekken_240718.json").read_text())
    num_special = data["config"]["default_num_special_tokens"]
    byte_vocab, _ = decoded("tekken")
    tokenizer = load_tokenizer("tekken")
    num_checked = 0
    for entry in data["vocab"]:
        token_id = num_special + entry["rank"]
        if token_id >= len(tokenizer):
            continue
        assert byte_vocab[token_id] == base64.b64decode(entry["token_bytes"]), token_id
        num_checked += 1
    assert num_checked == len(tokenizer) - num_special == 130072
    assert [byte_vocab[num_special + b] for b in range(256)] == [bytes([b]) for b in range(256)]


def test_llama3_matches_its_tiktoken_ranks_file(decoded):
    byte_vocab, _ = decoded("llama3")
    lines = asset_path("llama3/tokenizer.model").read_text().split("\n")
    ranks = dict(line.split() for line in lines if line)
    assert len(ranks) == 128000
    for encoded, rank in ranks.items():
        assert byte_vocab[int(rank)] == base64.b64decode(encoded), rank


def test_gpt2_matches_its_vocab_json_through_the_byte_alphabet(decoded):
    alphabet = gpt2_alphabet()
    assert len(alphabet) == 256 and alphabet["Ġ"] == 0x20 and alphabet["Ċ"] == 0x0A
    vocab = json.loads(asset_path("gpt2/vocab.json").read_text(encoding="utf-8"))
    byte_vocab, _ = decoded("gpt2")
    specials = special_ids(load_tokenizer("gpt2"))
    assert specials == {50256: "<|endoftext|>"}
    for piece, token_id in vocab.items():
        if token_id in specials:
            continue
        assert byte_vocab[token_id] == bytes(alphabet[c] for c in piece), piece


def test_smollm2_matches_the_token_list_of_its_gguf_file(decoded):
    from gguf import GGUFReader

    field = GGUFReader(smollm2_gguf_path()).fields["tokenizer.ggml.tokens"]
    pieces = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    byte_vocab, _ = decoded("smollm2")
    assert len(pieces) == len(byte_vocab) == 49152
    specials = special_ids(load_tokenizer("smollm2"))
    assert {specials[i] for i in (0, 1, 2)} == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    alphabet = gpt2_alphabet()
    for token_id, piece in enumerate(pieces):
        expected = (
            piece.encode("utf-8") if token_id in specials else bytes(alphabet[c] for c in piece)
        )
        assert byte_vocab[token_id] == expected, (token_id, piece)


def _sentencepiece_reference(model_file) -> list[bytes]:
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    reference = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            reference.append(bytes([int(piece[3:5], 16)]))
        elif sp.is_control(i) or sp.is_unknown(i):
            reference.append(piece.encode("utf-8"))  # <s>, </s>, <unk>: their own text
        else:
            reference.append(piece.replace("\u2581", " ").encode("utf-8"))
    return reference


def test_sentencepiece_matches_the_sentencepiece_library(decoded):
    byte_vocab, _ = decoded("sentencepiece")
    reference = _sentencepiece_reference(mistral_data_dir() / "tokenizer.model.v1")
    assert len(reference) == len(byte_vocab) == 32000
    assert [bytes(t) for t in byte_vocab] == reference
    # the spellings the family is known for
    assert byte_vocab[13] == b"\n"  # <0x0A>
    assert byte_vocab[load_tokenizer("sentencepiece").convert_tokens_to_ids("▁the")] == b" the"
    assert sorted(bytes(byte_vocab[3 + b]) for b in range(256)) == [bytes([b]) for b in range(256)]


def test_sentencepiece_bytes_agree_with_the_library_decoder_in_context(decoded):
    sp = sentencepiece.SentencePieceProcessor(
        model_file=str(mistral_data_dir() / "tokenizer.model.v1")
    )
    byte_vocab, _ = decoded("sentencepiece")
    anchor = sp.piece_to_id("▁x")
    for i in range(sp.get_piece_size()):
        if sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i):
            continue
        # the library decodes [anchor, i] to "x" + the token's text
        assert sp.decode([anchor, i]).encode("utf-8") == b"x" + byte_vocab[i], i


def test_unigram_matches_the_sentencepiece_library(decoded):
    byte_vocab, _ = decoded("unigram")
    reference = _sentencepiece_reference(asset_path("unigram/botchan_en_unigram_1000.model"))
    assert [bytes(t) for t in byte_vocab] == reference


def test_wordpiece_matches_vocab_txt_and_the_wordpiece_decoder(decoded):
    from tokenizers.decoders import WordPiece

    byte_vocab, _ = decoded("wordpiece")
    lines = asset_path("wordpiece/vocab.txt").read_text(encoding="utf-8").split("\n")
    pieces = lines[: len(byte_vocab)]
    assert len(pieces) == len(byte_vocab) == 30522
    decoder = WordPiece(prefix="##", cleanup=True)
    for token_id, piece in enumerate(pieces):
        assert byte_vocab[token_id] == decoder.decode(["x", piece]).encode()[1:], piece
    ids = {p: i for i, p in enumerate(pieces)}
    # a word-start token holds the space before it; "##" continues the previous token;
    # the decoder's clean-up glues punctuation to the word before it
    assert byte_vocab[ids["hello"]] == b" hello"
    assert byte_vocab[ids["##ing"]] == b"ing"
    assert byte_vocab[ids[","]] == b","
    assert byte_vocab[ids["[CLS]"]] == b" [CLS]"


# ---------------------------------------------------------------------------------------------
# Bytes that are not UTF-8, duplicates, special and added tokens


def test_gpt2_splits_an_emoji_into_exact_non_utf8_bytes(decoded):
    tokenizer = load_tokenizer("gpt2")
    byte_vocab, str_vocab = decoded("gpt2")
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["ðŁĺ", "Ģ"]
    assert [bytes(byte_vocab[i]) for i in ids] == [b"\xf0\x9f\x98", b"\x80"]
    assert joined(byte_vocab, ids) == "😀".encode()
    for i in ids:
        with pytest.raises(UnicodeDecodeError):
            byte_vocab[i].decode("utf-8")
    # "tokenizer" fallback: the token's own string stands in for the invalid bytes
    assert [str_vocab[i] for i in ids] == ["ðŁĺ", "Ģ"]


@pytest.mark.parametrize("family", ["sentencepiece", *BYTE_LEVEL])
def test_byte_tokens_are_not_all_utf8(family, decoded):
    byte_vocab, _ = decoded(family)
    invalid = 0
    for token in byte_vocab:
        try:
            token.decode("utf-8")
        except UnicodeDecodeError:
            invalid += 1
    assert invalid >= 128  # at least the single bytes 0x80-0xFF


@pytest.mark.parametrize(
    ("fallback", "expected"),
    [("tokenizer", "ðŁĺ"), ("latin1", "\xf0\x9f\x98"), ("replace", "\ufffd")],
)
def test_byte2str_fallbacks(fallback, expected, decoded):
    tokenizer = load_tokenizer("gpt2")
    token_id = tokenizer.convert_tokens_to_ids("ðŁĺ")
    byte_vocab, str_vocab = decode_vocab(tokenizer, byte2str_fallback=fallback)
    assert str_vocab[token_id] == expected
    assert str_vocab[tokenizer.convert_tokens_to_ids("Ġhello")] == " hello"
    assert [bytes(t) for t in byte_vocab] == [bytes(t) for t in decoded("gpt2")[0]]


def test_duplicate_byte_strings_stay_distinct_tokens(decoded):
    byte_vocab, _ = decoded("sentencepiece")
    tokenizer = load_tokenizer("sentencepiece")
    byte_a = byte_vocab[tokenizer.convert_tokens_to_ids("<0x41>")]
    char_a = byte_vocab[tokenizer.convert_tokens_to_ids("A")]
    assert byte_a.byte_string == char_a.byte_string == b"A"
    assert byte_a != char_a
    assert len({byte_a, char_a}) == 2
    for family in FAMILIES:
        tokens = decoded(family)[0]
        assert len(set(tokens)) == len(tokens), family


def test_equal_ids_are_equal_across_separately_decoded_vocabularies(decoded):
    first, _ = decoded("gpt2")
    second, _ = decode_vocab(load_tokenizer("gpt2"))
    assert first is not second
    assert all(a == b and hash(a) == hash(b) for a, b in zip(first, second, strict=True))
    assert set(first) == set(second)


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_are_their_own_text(family, decoded):
    tokenizer = load_tokenizer(family)
    byte_vocab, str_vocab = decoded(family)
    specials = special_ids(tokenizer)
    assert specials
    # A WordPiece decoder puts a space before every word-start token, special ones too.
    prefix = " " if family == "wordpiece" else ""
    for token_id, content in specials.items():
        assert byte_vocab[token_id] == (prefix + content).encode("utf-8")
        assert str_vocab[token_id] == prefix + content
    for name in ("eos_token_id", "bos_token_id"):
        token_id = getattr(tokenizer, name)
        if token_id is not None:
            assert byte_vocab[token_id] == (prefix + tokenizer.decode([token_id])).encode()


@pytest.mark.parametrize(
    ("family", "new_tokens", "expected"),
    [
        # added tokens pass through the decoder, as in tokenizers: "Ġ" is a space there
        ("gpt2", ["<my_token>", "ĠfooĠ"], [b"<my_token>", b" foo "]),
        ("sentencepiece", ["<my_token>", "\u2581bar\u2581"], [b"<my_token>", b" bar "]),
    ],
)
def test_added_tokens_decode_like_the_tokenizer(family, new_tokens, expected):
    tokenizer = fresh_tokenizer(family)
    size = len(tokenizer)
    tokenizer.add_tokens(new_tokens)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|my_special|>"]})
    byte_vocab, _ = decode_vocab(tokenizer)
    assert len(byte_vocab) == size + 3
    assert [bytes(t) for t in byte_vocab[size:]] == [*expected, b"<|my_special|>"]
    anchor = tokenizer.encode("x", add_special_tokens=False)[-1:]
    backend = tokenizer.backend_tokenizer
    anchor_text = backend.decode(anchor)
    for token_id in range(size, size + 2):
        in_context = backend.decode(anchor + [token_id], skip_special_tokens=False)
        assert in_context.startswith(anchor_text)
        assert byte_vocab[token_id] == in_context[len(anchor_text) :].encode()


# ---------------------------------------------------------------------------------------------
# Offline, and bad input


def test_works_with_the_network_blocked(monkeypatch, decoded):
    def refuse(*args, **kwargs):
        raise OSError("network access attempted during an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    with pytest.raises(OSError, match="offline"):
        socket.create_connection(("example.com", 80))
    # loaded from local folders by LlamaTokenizer.from_pretrained / AutoTokenizer, then decoded
    for family in ("sentencepiece", "wordpiece", "gpt2"):
        tokenizer = fresh_tokenizer(family)
        byte_vocab, _ = decode_vocab(tokenizer)
        assert [bytes(t) for t in byte_vocab] == [bytes(t) for t in decoded(family)[0]]


@pytest.mark.parametrize("fallback", ["utf8", "", None, "Latin1"])
def test_unknown_fallback_is_a_value_error(fallback):
    with pytest.raises(ValueError, match="byte2str_fallback"):
        decode_vocab(load_tokenizer("gpt2"), byte2str_fallback=fallback)


@pytest.mark.parametrize("not_a_tokenizer", ["gpt2", None, 42, object(), {"a": 0}])
def test_non_tokenizer_is_a_type_error(not_a_tokenizer):
    with pytest.raises(TypeError, match="never downloads"):
        decode_vocab(not_a_tokenizer)
