"""replace_prefix_tokens: the model's own ids for earlier turns, the template's after them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import genlm_backend
from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError
from genlm_backend.tokenization import replace_prefix_tokens
from tests.real_tokenizers import load_tokenizer

# The worked example of NeMo RL's ``_replace_prefix_tokens`` (eos_token_id = 2).
MODEL_PREFIX = [11, 12, 13, 40, 41, 220, 17, 2]  # template prefill + model output " 4" + EOS
TEMPLATE_PREFIX = [11, 12, 13, 40, 41, 1001, 2]  # the template writes " 4" as 1001
TEMPLATE = [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41]


def test_the_worked_example():
    got = replace_prefix_tokens(MODEL_PREFIX, TEMPLATE_PREFIX, TEMPLATE, eos_token_ids=2)
    assert got == [11, 12, 13, 40, 41, 220, 17, 2, 21, 22, 40, 41]


def test_inputs_are_not_changed_and_the_result_is_a_new_list():
    model, prefix, full = list(MODEL_PREFIX), list(TEMPLATE_PREFIX), list(TEMPLATE)
    got = replace_prefix_tokens(model, prefix, full, eos_token_ids=[2])
    got.append(99)
    assert (model, prefix, full) == (MODEL_PREFIX, TEMPLATE_PREFIX, TEMPLATE)


def test_eos_as_an_int_a_list_an_array_or_a_tensor():
    torch = pytest.importorskip("torch")
    want = replace_prefix_tokens(MODEL_PREFIX, TEMPLATE_PREFIX, TEMPLATE, eos_token_ids=2)
    for eos in ([2], (2,), {2, 7}, np.int64(2), np.array([2, 7]), torch.tensor(2), [7, 2]):
        assert (
            replace_prefix_tokens(MODEL_PREFIX, TEMPLATE_PREFIX, TEMPLATE, eos_token_ids=eos)
            == want
        )
    arrays = [np.array(x) for x in (MODEL_PREFIX, TEMPLATE_PREFIX, TEMPLATE)]
    assert replace_prefix_tokens(*arrays, eos_token_ids=2) == want


def test_several_eos_ids_keep_the_models_own_eos():
    """The model stopped at 7, the template closes the message with 2: the model's 7 stays."""
    model = [11, 12, 220, 17, 7]
    got = replace_prefix_tokens(model, [11, 12, 1001, 2, 5], [11, 12, 1001, 2, 5, 21, 22],
                                eos_token_ids=[2, 7])
    assert got == [11, 12, 220, 17, 7, 5, 21, 22]


def test_the_template_may_shorten_or_lengthen_the_models_message():
    shorter = replace_prefix_tokens([1, 5, 6, 7, 2], [1, 8, 2], [1, 8, 2, 3, 4], eos_token_ids=2)
    longer = replace_prefix_tokens(
        [1, 8, 2], [1, 5, 6, 7, 2], [1, 5, 6, 7, 2, 3, 4], eos_token_ids=2
    )
    assert shorter == [1, 5, 6, 7, 2, 3, 4]
    assert longer == [1, 8, 2, 3, 4]


def test_nothing_after_the_eos_gives_back_the_model_prefix():
    assert replace_prefix_tokens([1, 5, 2], [1, 8, 2], [1, 8, 2], eos_token_ids=2) == [1, 5, 2]


@pytest.mark.parametrize(
    ("model", "prefix", "full", "eos", "match"),
    [
        ([], TEMPLATE_PREFIX, TEMPLATE, 2, "model_prefix_token_ids is empty"),
        (MODEL_PREFIX, [], TEMPLATE, 2, "template_prefix_token_ids is empty"),
        (MODEL_PREFIX, TEMPLATE_PREFIX, [], 2, "template_token_ids is empty"),
        (MODEL_PREFIX, TEMPLATE_PREFIX, TEMPLATE, [], "eos_token_ids is empty"),
        (MODEL_PREFIX, TEMPLATE_PREFIX, TEMPLATE, -1, "negative id -1"),
        ([11, -3, 2], TEMPLATE_PREFIX, TEMPLATE, 2, r"model_prefix_token_ids\[1\] is a negative"),
        # no EOS at the end of the model's turn (cut short by max_tokens)
        (MODEL_PREFIX[:-1], TEMPLATE_PREFIX, TEMPLATE, 2, "ends in 17, not in an EOS id"),
        # the declared EOS is not the one the model stopped at
        (MODEL_PREFIX, TEMPLATE_PREFIX, TEMPLATE, 7, "ends in 2, not in an EOS id"),
        # the template does not close the message with the EOS
        ([11, 12, 220, 17, 2], [11, 12, 1001, 9], [11, 12, 1001, 9, 21], 2, "holds no EOS id"),
        # the prefixes are of different conversations: one turn more in the template's
        ([11, 220, 2], [11, 1001, 2, 21, 1001, 2], [11, 1001, 2, 21, 1001, 2, 5], 2,
         "holds 1 EOS ids and template_prefix_token_ids 2"),
        ([11, 2, 220, 2], [11, 1001, 2], [11, 1001, 2, 5], 2, "holds 2 EOS ids"),
        # the whole conversation's template ids are shorter than the prefix's
        (MODEL_PREFIX, TEMPLATE_PREFIX, TEMPLATE_PREFIX[:-1], 2, "does not begin with"),
        # ... or render the prefix differently (position 5: 1002 for 1001)
        (MODEL_PREFIX, TEMPLATE_PREFIX, [11, 12, 13, 40, 41, 1002, 2, 21], 2, "from position 5"),
        (MODEL_PREFIX, TEMPLATE_PREFIX, [11, 12, 13, 40, 41, 1001, 9, 2, 21], 2, "from position 6"),
    ],
)
def test_inputs_that_do_not_fit_together_are_refused(model, prefix, full, eos, match):
    with pytest.raises(InvalidRequestError, match=match):
        replace_prefix_tokens(model, prefix, full, eos_token_ids=eos)


@pytest.mark.parametrize(
    ("model", "eos", "match"),
    [
        ("abc", 2, "model_prefix_token_ids must be a list of ints, got str"),
        ({"input_ids": MODEL_PREFIX}, 2, "must be a list of ints, got dict"),
        ([11, 2.0], 2, r"model_prefix_token_ids\[1\] is 2.0, not an int \(float\)"),
        ([11, True], 2, r"\[1\] is True, not an int \(bool\)"),
        (np.array([[11, 2]]), 2, r"\[0\] is \[11, 2\], not an int"),
        (MODEL_PREFIX, None, "eos_token_ids must be an int or a list of ints, got None"),
        (MODEL_PREFIX, "2", "eos_token_ids must be an int or a list of ints"),
        (MODEL_PREFIX, True, "eos_token_ids must be an int or a list of ints, got True"),
        (MODEL_PREFIX, [2, True], r"eos_token_ids\[1\] is True"),
    ],
)
def test_values_of_the_wrong_type_are_refused(model, eos, match):
    with pytest.raises(InvalidRequestTypeError, match=match):
        replace_prefix_tokens(model, TEMPLATE_PREFIX, TEMPLATE, eos_token_ids=eos)


def test_exported_from_the_package():
    assert genlm_backend.replace_prefix_tokens is replace_prefix_tokens


# ---- an explicit construction: conversations whose structure the test knows -------------

EOS, SEP = 2, 3  # SEP: what a template writes after the EOS (SmolLM2's "\n")
piece = st.lists(st.integers(10, 99), min_size=1, max_size=5)


@st.composite
def conversations(draw):
    """Turns of (header ids, model ids, template ids of the same text), and the next
    turn's header (the next user message and the generation prompt)."""
    turns = draw(st.lists(st.tuples(piece, piece, piece), min_size=1, max_size=4))
    return turns, draw(piece)


def template_ids(turns, upto, tail=()):
    """What a template writes for the first ``upto`` turns: each header, the template's own
    ids for the answer, the EOS and the separator."""
    return [t for header, _, written in turns[:upto] for t in (*header, *written, EOS, SEP)] + list(
        tail
    )


@settings(max_examples=300, deadline=None)
@given(conversations())
def test_turn_after_turn_every_answer_keeps_the_models_ids(conversation):
    turns, last_header = conversation
    model = []  # what the model saw and produced so far, built as a caller would
    for k, (header, produced, _) in enumerate(turns):
        if k == 0:
            model = list(header)
        else:  # the template's ids for the conversation so far, with the model's put back
            nxt = template_ids(turns, k, header)
            model = replace_prefix_tokens(model, template_ids(turns, k), nxt, eos_token_ids=EOS)
        model += [*produced, EOS]
    got = replace_prefix_tokens(model, template_ids(turns, len(turns)),
                                template_ids(turns, len(turns), last_header), eos_token_ids=EOS)
    # Built from the structure alone: headers and separators from the template, answers
    # from the model.
    want = [t for i, (header, produced, _) in enumerate(turns)
            for t in ((*header,) if i == 0 else (SEP, *header)) + (*produced, EOS)]
    assert got == [*want, SEP, *last_header]


# ---- a real chat template: SmolLM2's ------------------------------------------------------


def test_a_real_chat_template_round_trip():
    """SmolLM2's template closes each message with <|im_end|> (the EOS, 2) and a newline. The
    model wrote " Paris" as " Par" + "is"; the template writes it as one token. The spliced
    prompt keeps the model's two ids, then continues with the template's newline, the next
    user message and the generation prompt; its text is the template's text."""
    tokenizer = load_tokenizer("smollm2")
    eos = tokenizer.eos_token_id

    def ids(messages, **kwargs):
        return list(tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])

    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = ids(question, add_generation_prompt=True)
    produced = [*tokenizer.encode(" Par"), *tokenizer.encode("is"), eos]
    assert (
        tokenizer.decode(produced[:-1]) == " Paris" and tokenizer.encode(" Paris") != produced[:-1]
    )
    answered = [*question, {"role": "assistant", "content": tokenizer.decode(produced[:-1])}]
    follow_up = [*answered, {"role": "user", "content": "And of Germany?"}]
    template_prefix = ids(answered)
    template = ids(follow_up, add_generation_prompt=True)

    got = replace_prefix_tokens(prompt + produced, template_prefix, template, eos_token_ids=eos)

    assert got[: len(prompt) + len(produced)] == prompt + produced
    assert template_prefix[-2:] == [eos, *tokenizer.encode("\n")]  # the cut: after the EOS
    assert got[len(prompt) + len(produced):] == template[len(template_prefix) - 1:]
    assert len(got) == len(template) + 1  # one template id became two of the model's
    assert tokenizer.decode(got) == tokenizer.decode(template)
    assert tokenizer.decode(got).endswith("And of Germany?<|im_end|>\n<|im_start|>assistant\n")
