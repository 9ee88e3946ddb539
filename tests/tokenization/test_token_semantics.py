"""The rules of ``Token``: bytes content, identity by token id, immutability, pickling."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError
from genlm_backend.tokenization import Token

token_ids = st.integers(min_value=0, max_value=2**40)
byte_strings = st.binary(max_size=12)


def test_keyword_construction_and_attributes():
    token = Token(token_id=7, byte_string=b"ab")
    assert token.token_id == 7
    assert token.byte_string == b"ab"
    assert type(token.byte_string) is bytes
    assert isinstance(token, bytes)
    assert type(token) is Token
    assert Token(7, b"ab") == token  # positional too


def test_byte_string_of_a_token_argument_is_plain_bytes():
    inner = Token(token_id=1, byte_string=b"xy")
    outer = Token(token_id=2, byte_string=inner)
    assert type(outer.byte_string) is bytes
    assert outer.byte_string == b"xy"
    assert outer.token_id == 2


@given(token_ids, byte_strings)
def test_behaves_as_its_bytes(token_id, data):
    token = Token(token_id=token_id, byte_string=data)
    assert bytes(token) == data
    assert len(token) == len(data)
    assert list(token) == list(data)  # iterating gives ints
    assert all(type(x) is int for x in token)
    assert token[:1] == data[:1]
    assert b"".join([token, Token(token_id + 1, b"|"), token]) == data + b"|" + data
    assert type(b"".join([token])) is bytes
    assert token.decode("latin-1") == data.decode("latin-1")


@given(token_ids, byte_strings, byte_strings)
def test_tokens_compare_and_hash_by_id_only(token_id, data_a, data_b):
    a = Token(token_id=token_id, byte_string=data_a)
    b = Token(token_id=token_id, byte_string=data_b)
    assert a == b and not (a != b)  # noqa: SIM202 - tests the operator itself
    assert hash(a) == hash(b) == hash(token_id)
    assert len({a, b}) == 1


@given(token_ids, byte_strings)
def test_distinct_ids_with_equal_bytes_stay_distinct(token_id, data):
    a = Token(token_id=token_id, byte_string=data)
    b = Token(token_id=token_id + 1, byte_string=data)
    assert a != b and not (a == b)  # noqa: SIM201 - tests the operator itself
    assert len({a, b}) == 2
    counts = {a: "first", b: "second"}
    assert counts[Token(token_id, b"other bytes")] == "first"


@given(token_ids, byte_strings, byte_strings)
def test_against_plain_bytes_compares_content(token_id, data, other):
    token = Token(token_id=token_id, byte_string=data)
    assert token == data and data == token
    assert not (token != data) and not (data != token)  # noqa: SIM202 - tests the operator itself
    assert (token == other) == (data == other)
    assert (token != other) == (data != other)
    assert token == bytearray(data)


def test_tokens_order_by_id_as_in_genlm_backend_0_3_1():
    z, a = Token(1, b"z"), Token(2, b"a")
    assert z < a and z <= a and a > z and a >= z
    assert not (a < z) and not (z > a) and not (a <= z) and not (z >= a)
    assert sorted([a, z]) == [z, a] and max(a, z) is a and min(a, z) is z
    same_id = Token(1, b"other bytes")
    assert z <= same_id and z >= same_id and not (z < same_id) and not (z > same_id)


@given(token_ids, token_ids, byte_strings, byte_strings)
def test_two_tokens_compare_as_their_ids(id_a, id_b, data_a, data_b):
    a, b = Token(id_a, data_a), Token(id_b, data_b)
    assert (a < b, a <= b, a > b, a >= b) == (id_a < id_b, id_a <= id_b, id_a > id_b, id_a >= id_b)


@given(token_ids, byte_strings, byte_strings)
def test_a_token_against_plain_bytes_orders_by_content(token_id, data, other):
    token = Token(token_id, data)
    for plain in (other, bytearray(other)):
        assert (token < plain, token <= plain, token > plain, token >= plain) == (
            data < other, data <= other, data > other, data >= other)
    # plain bytes on the left: Python asks the Token (a bytes subclass) first
    assert (other < token, other <= token, other > token, other >= token) == (
        other < data, other <= data, other > data, other >= data)


def test_ordering_against_non_bytes_is_a_type_error():
    token = Token(3, b"3")
    for other in ("3", 3, None):
        with pytest.raises(TypeError):
            token < other  # noqa: B015
        with pytest.raises(TypeError):
            other >= token  # noqa: B015


def test_never_equal_to_non_bytes():
    token = Token(token_id=3, byte_string=b"3")
    assert token != "3" and token != 3 and token != None
    assert not (token == "3")  # noqa: SIM201 - tests the operator itself


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_keeps_id_bytes_and_class(protocol):
    token = Token(token_id=12345, byte_string=b"\xf0\x9f")
    restored = pickle.loads(pickle.dumps(token, protocol=protocol))
    assert type(restored) is Token
    assert restored.token_id == 12345
    assert restored.byte_string == b"\xf0\x9f"
    assert restored == token
    vocab = [Token(i, b"x") for i in range(3)]
    assert [t.token_id for t in pickle.loads(pickle.dumps(vocab, protocol))] == [0, 1, 2]


def test_copy_and_deepcopy_keep_id():
    token = Token(token_id=4, byte_string=b"four")
    for clone in (copy.copy(token), copy.deepcopy(token), copy.deepcopy([token])[0]):
        assert type(clone) is Token
        assert clone.token_id == 4 and clone.byte_string == b"four"


def test_is_plain_bytes():
    assert Token.is_plain_bytes(b"abc")
    assert Token.is_plain_bytes(b"")
    assert not Token.is_plain_bytes(Token(0, b"abc"))
    assert not Token.is_plain_bytes("abc")
    assert not Token.is_plain_bytes(bytearray(b"abc"))
    assert not Token.is_plain_bytes(None)


def test_as_bytes():
    token = Token(token_id=9, byte_string=b"nine")
    assert Token.as_bytes(token) == b"nine" and type(Token.as_bytes(token)) is bytes
    plain = b"plain"
    assert Token.as_bytes(plain) is plain
    with pytest.raises(TypeError, match="'text'"):
        Token.as_bytes("text")


def test_repr_shows_id_and_bytes():
    text = repr(Token(token_id=42, byte_string=b"\xc3\xa9!"))
    assert text == "Token(token_id=42, byte_string=b'\\xc3\\xa9!')"


def test_immutable():
    token = Token(token_id=1, byte_string=b"a")
    with pytest.raises(AttributeError):
        token.token_id = 2
    with pytest.raises(AttributeError):
        token.extra = 1
    with pytest.raises(AttributeError):
        del token.token_id
    assert token.token_id == 1


def test_integer_like_ids_are_accepted():
    token = Token(token_id=np.int64(5), byte_string=b"five")
    assert token.token_id == 5 and type(token.token_id) is int


@pytest.mark.parametrize("bad", [-1, -(2**40)])
def test_negative_id_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=str(bad)) as info:
        Token(token_id=bad, byte_string=b"x")
    assert isinstance(info.value, InvalidRequestError)


@pytest.mark.parametrize("bad", [1.0, "1", None, True, [1]])
def test_non_int_id_is_a_type_error_naming_it(bad):
    with pytest.raises(TypeError, match="token_id") as info:
        Token(token_id=bad, byte_string=b"x")
    assert isinstance(info.value, InvalidRequestTypeError)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", ["text", None, 3, bytearray(b"x"), [1, 2]])
def test_non_bytes_byte_string_is_a_type_error(bad):
    with pytest.raises(TypeError, match="byte_string") as info:
        Token(token_id=0, byte_string=bad)
    assert isinstance(info.value, InvalidRequestTypeError)
