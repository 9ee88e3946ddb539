"""The shape of the trie: nodes, edges, leaves and the lookup tables consumers read."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError
from genlm_backend.tokenization import Token
from genlm_backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
from tests.trie.reference import node_prefixes, symbols
from tests.trie.strategies import EndOfSequence, vocabularies


def word_key(item, position):
    """The key genlm-backend 0.3.1 gives a vocabulary item (and genlm-control looks up)."""
    if isinstance(item, Token):
        return (item.byte_string, item.token_id)
    return item


@settings(max_examples=150)
@given(vocabularies())
def test_nodes_are_the_prefixes_plus_one_leaf_per_position(vocab):
    trie = TokenCharacterTrie(vocab)
    prefixes, leaves = node_prefixes(trie)
    spelled = [symbols(item) for item in vocab]
    expected = {s[:k] for s in spelled for k in range(len(s) + 1)}
    assert sorted(prefixes.values(), key=repr) == sorted(expected, key=repr)  # each once
    assert trie.root == 0 and prefixes[trie.root] == ()
    assert sorted(leaves.values()) == list(range(len(vocab)))
    for leaf, position in leaves.items():
        parent = next(n for n in prefixes if trie.children[n].get((None, position)) == leaf)
        assert prefixes[parent] == spelled[position]
        assert trie.token_id_to_leaf[position] == leaf == trie.first_leaf + position
    for node in prefixes:
        for label in trie.children[node]:
            assert isinstance(label, (int, tuple)) or label in vocab


@settings(max_examples=100)
@given(vocabularies(eos=True, tokens=True))
def test_word2leaf_and_inverse_tables(vocab):
    trie = TokenCharacterTrie(vocab)
    _, leaves = node_prefixes(trie)
    position_of = {leaf: pos for leaf, pos in leaves.items()}
    for position, item in enumerate(vocab):
        key = word_key(item, position)
        leaf = trie.word2leaf[key]
        first = next(i for i, other in enumerate(vocab) if word_key(other, i) == key)
        assert position_of[leaf] == first  # repeated keys: the first position wins
        assert trie.leaf2word[trie.first_leaf + position] == key
        token_id = item.token_id if isinstance(item, Token) else position
        assert trie.leaf2token_id[trie.first_leaf + position] == token_id
    assert all(
        type(k) is tuple and type(k[0]) is bytes or type(k) is bytes or isinstance(k, EndOfSequence)
        for k in trie.word2leaf
    )


def test_end_of_sequence_object_gets_an_edge_from_the_root():
    eos = EndOfSequence()
    vocab = [Token(token_id=7, byte_string=b"ab"), Token(token_id=3, byte_string=b"a"), eos]
    trie = ParallelTokenCharacterTrie(vocab)
    eos_node = trie.children[trie.root][eos]
    leaf = trie.word2leaf[eos]
    assert trie.children[eos_node] == {(None, 2): leaf}
    a = trie.children[trie.root][ord("a")]
    assert trie.children[a][(None, 1)] == trie.word2leaf[(b"a", 3)]
    assert trie.word2leaf[(b"ab", 7)] == trie.children[trie.children[a][ord("b")]][(None, 0)]
    assert list(trie.children[trie.root]) == [ord("a"), eos]


def test_identical_bytes_keep_separate_leaves():
    vocab = [b"x", b"x", Token(token_id=5, byte_string=b"x"), Token(token_id=5, byte_string=b"x")]
    trie = TokenCharacterTrie(vocab)
    x = trie.children[trie.root][ord("x")]
    assert list(trie.children[x]) == [(None, 0), (None, 1), (None, 2), (None, 3)]
    assert trie.num_nodes == 2 + 4
    # plain bytes, then a Token: the first of the repeats
    assert trie.word2leaf[b"x"] == trie.children[x][(None, 0)]
    assert trie.word2leaf[(b"x", 5)] == trie.children[x][(None, 2)]


def test_children_behaves_like_a_list_of_dicts():
    trie = TokenCharacterTrie([b"ab", b"b", b""])
    children = trie.children
    assert len(children) == trie.num_nodes == 3 + 3 + 0 + 1  # root, a, ab, b + 3 leaves
    assert len(list(children)) == len(children)
    assert children[-1] == {} and children[len(children) - 1] == {}
    assert children[0:2] == [children[0], children[1]]
    assert children[0] is children[0]  # cached: consumers may hold on to it
    assert (None, 2) in children[0]
    with pytest.raises(IndexError):
        children[len(children)]


def test_all_negative_max_at_root_is_the_largest_weight():
    trie = TokenCharacterTrie([b"a", b"ab", b"b"])
    out = trie.weight_max([-3.0, -1.5, -2.0])
    assert out[trie.root] == -1.5
    assert out[trie.children[trie.root][ord("b")]] == -2.0


@pytest.mark.parametrize(
    "decode, error",
    [
        ([], InvalidRequestError),
        (b"abc", InvalidRequestTypeError),
        ("abc", InvalidRequestTypeError),
        ([b"a", "b"], InvalidRequestTypeError),
        ([b"a", [1, 2]], InvalidRequestTypeError),
        ([b"a", object()], InvalidRequestTypeError),
        ([b"a", 3], InvalidRequestTypeError),
        (None, InvalidRequestTypeError),
    ],
)
@pytest.mark.parametrize("cls", [TokenCharacterTrie, ParallelTokenCharacterTrie])
def test_bad_vocabularies_are_rejected(cls, decode, error):
    with pytest.raises(error) as info:
        cls(decode)
    assert isinstance(info.value, (ValueError, TypeError))


def test_bytes_like_items_are_accepted():
    trie = TokenCharacterTrie([bytearray(b"ab"), memoryview(b"a"), b"b"])
    assert trie.word2leaf[b"ab"] == trie.first_leaf
    assert set(trie.children[trie.root]) == {ord("a"), ord("b")}


@pytest.mark.parametrize("cls", [TokenCharacterTrie, ParallelTokenCharacterTrie])
def test_a_set_sampler_finds_every_leaf_as_genlm_control_looks_it_up(cls):
    """genlm-control 0.4.1's ``TrieSetSampler`` keys a Token by ``(byte_string, token_id)``
    and anything else (plain bytes, an end-of-sequence object) by itself, then maps each
    leaf back to the item's position; a plain-bytes item not found there failed its
    samplers with ``KeyError`` (genlm-backend 0.3.1 keys plain bytes by themselves)."""
    eos = EndOfSequence()
    vocab = [b"0", b"ab", Token(token_id=9, byte_string=b"a"), b"", eos]
    trie = cls(vocab)
    found = {
        trie.word2leaf[word_key(item, i)]: i
        for i, item in enumerate(vocab)
        if word_key(item, i) in trie.word2leaf
    }
    assert found == {trie.first_leaf + i: i for i in range(len(vocab))}
