"""Multi-turn prompts that keep the token ids the model itself produced in earlier turns.

A chat template re-tokenises the text of earlier assistant messages, and the result can
differ from the ids the model sampled (``" 4"`` as one token where the model wrote ``" "``,
``"4"``). :func:`replace_prefix_tokens` builds the next turn's prompt from the model's own
ids for everything up to the end of its last message, and from the template after it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError

__all__ = ["replace_prefix_tokens"]


def replace_prefix_tokens(
    model_prefix_token_ids: Sequence[int],
    template_prefix_token_ids: Sequence[int],
    template_token_ids: Sequence[int],
    *,
    eos_token_ids: int | Iterable[int],
) -> list[int]:
    """The template's ids for a conversation, with the previous turn's model ids put back.

    ``model_prefix_token_ids`` is what the model saw and produced in the previous turn: its
    prompt followed by its output, ending in the EOS id it stopped at.
    ``template_prefix_token_ids`` is the chat template's tokenisation of the same conversation
    (the previous turn's messages, the model's answer included), and ``template_token_ids``
    the template's tokenisation of the whole conversation, which must begin with it. The
    result is the model's ids up to and including its final EOS, followed by the
    template's ids after the last EOS of ``template_prefix_token_ids`` (a newline the template
    writes after the EOS, the next user message, the generation prompt). With EOS id 2:

        model_prefix_token_ids    = [11, 12, 13, 40, 41, 220, 17, 2]     # model wrote 220, 17
        template_prefix_token_ids = [11, 12, 13, 40, 41, 1001, 2]        # template: 1001
        template_token_ids        = [11, 12, 13, 40, 41, 1001, 2, 21, 22, 40, 41]
        result                    = [11, 12, 13, 40, 41, 220, 17, 2, 21, 22, 40, 41]

    The model's ids are kept whole, including its EOS where ``eos_token_ids`` holds several
    and the template closes the message with another of them. The function never splices
    inputs that do not describe the same conversation: each check below raises instead.

    Args:
        model_prefix_token_ids: the previous turn's prompt and output, ending in an EOS id.
        template_prefix_token_ids: the template's ids for the conversation up to and
            including the model's last message.
        template_token_ids: the template's ids for the whole conversation.
        eos_token_ids: the id, or the ids, that end an assistant message (for a Hugging Face
            tokenizer, ``tokenizer.eos_token_id``, or the ids generation stopped at).

    Returns:
        A new list of ints.

    Raises:
        InvalidRequestTypeError: an argument is not a sequence of ints (a 1-D numpy array or
            tensor is accepted; a ``BatchEncoding`` is not: pass its ``input_ids``).
        InvalidRequestError: an input or ``eos_token_ids`` is empty, or holds a negative id;
            ``model_prefix_token_ids`` does not end in an EOS id (a turn cut short by
            ``max_tokens``: append the EOS first if the template closes such a message);
            ``template_prefix_token_ids`` holds no EOS id; the two prefixes hold different
            numbers of EOS ids (they are not the same conversation); ``template_token_ids``
            does not begin with ``template_prefix_token_ids`` (it is shorter, or the template
            renders earlier messages differently once more follow).
    """
    eos = _eos_set(eos_token_ids)
    model = _ids("model_prefix_token_ids", model_prefix_token_ids)
    prefix = _ids("template_prefix_token_ids", template_prefix_token_ids)
    full = _ids("template_token_ids", template_token_ids)
    if model[-1] not in eos:
        raise InvalidRequestError(
            f"model_prefix_token_ids ends in {model[-1]!r}, not in an EOS id {sorted(eos)}: "
            "the previous turn did not finish (append the EOS id if it should be closed)"
        )
    cut = next((i for i in range(len(prefix) - 1, -1, -1) if prefix[i] in eos), None)
    if cut is None:
        raise InvalidRequestError(
            f"template_prefix_token_ids holds no EOS id {sorted(eos)}: the template does not "
            "close the model's message with one of eos_token_ids"
        )
    num_model_eos = sum(tid in eos for tid in model)
    num_template_eos = sum(tid in eos for tid in prefix[: cut + 1])
    if num_model_eos != num_template_eos:
        raise InvalidRequestError(
            f"model_prefix_token_ids holds {num_model_eos} EOS ids and "
            f"template_prefix_token_ids {num_template_eos}: they are not the same conversation"
        )
    if len(full) < len(prefix) or full[: len(prefix)] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), len(full))
        raise InvalidRequestError(
            f"template_token_ids ({len(full)} ids) does not begin with template_prefix_token_ids "
            f"({len(prefix)} ids): they differ from position {at}"
        )
    return list(model) + list(full[cut + 1 :])


def _ids(name: str, values: Sequence[int]) -> tuple[int, ...]:
    if not isinstance(values, Sequence) and hasattr(values, "tolist"):  # numpy, torch
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidRequestTypeError(
            f"{name} must be a list of ints, got {type(values).__name__}: {values!r:.80}"
        )
    ids = []
    for position, tid in enumerate(values):
        if isinstance(tid, bool) or not isinstance(tid, numbers.Integral):
            raise InvalidRequestTypeError(
                f"{name}[{position}] is {tid!r}, not an int ({type(tid).__name__})"
            )
        if tid < 0:
            raise InvalidRequestError(f"{name}[{position}] is a negative id {int(tid)}")
        ids.append(int(tid))
    if not ids:
        raise InvalidRequestError(f"{name} is empty")
    return tuple(ids)


def _eos_set(eos_token_ids: int | Iterable[int]) -> frozenset[int]:
    if hasattr(eos_token_ids, "tolist"):  # numpy, torch (a scalar too)
        eos_token_ids = eos_token_ids.tolist()
    if isinstance(eos_token_ids, numbers.Integral) and not isinstance(eos_token_ids, bool):
        eos_token_ids = [eos_token_ids]
    elif isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, Iterable):
        raise InvalidRequestTypeError(
            f"eos_token_ids must be an int or a list of ints, got {eos_token_ids!r:.80}"
        )
    return frozenset(_ids("eos_token_ids", list(eos_token_ids)))
