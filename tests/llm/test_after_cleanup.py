"""After ``cleanup()`` every public method and property of every backend raises ``ClosedError``.

The methods are found by walking the class, so a method added later is checked too; each is
called with arguments it would accept before cleanup (:data:`ARGUMENTS`, by parameter name).
Only these are exempt: ``cleanup`` (idempotent, per the contract), ``is_closed``, and what
needs no model (``hash_to_int``, a static hash of a name; ``from_name``, which builds a new one).
"""

from __future__ import annotations

import inspect

import pytest
from backends import SizedTokenizer
from hf_fixtures import shared_tiny_llama, tiny_tokenizer

from genlm_backend.exceptions import ClosedError
from genlm_backend.llm import MockAsyncLM
from genlm_backend.llm.hf import AsyncTransformer

EXEMPT = {"cleanup", "is_closed", "hash_to_int", "from_name"}
ARGUMENTS = {
    "token_ids": [1, 2],
    "token_ids_list": [[1, 2]],
    "prompt_token_ids": [1, 2],
    "prompt_token_ids_list": [[1, 2]],
    "prompt_tokens": [1, 2],
    "prefixes": [1, 2],
    "max_tokens": 1,
    "eos_token_ids": [],
    "lora_path": "/nonexistent/adapter",
    "lora_name": "lora_1",
    "sessions": True,
}


def public_members(cls: type) -> list[tuple[str, object]]:
    members = []
    for name in dir(cls):
        if name.startswith("_") or name in EXEMPT:
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, (property, staticmethod, classmethod)) or inspect.isfunction(member):
            members.append((name, member))
    return members


async def use(lm, name: str, member: object) -> None:
    """Reads the property ``name``, or calls (and awaits) the method with plausible arguments."""
    if isinstance(member, property):
        getattr(lm, name)
        return
    method = getattr(lm, name)
    kwargs = {}
    for param in inspect.signature(method).parameters.values():
        if param.default is not param.empty or param.kind in (param.VAR_POSITIONAL,
                                                                 param.VAR_KEYWORD):
            continue
        assert param.name in ARGUMENTS, f"add an argument for {name}({param.name}=...) to ARGUMENTS"
        kwargs[param.name] = ARGUMENTS[param.name]
    result = method(**kwargs)
    if inspect.isawaitable(result):
        await result


async def check_every_member_raises(lm) -> list[str]:
    lm.cleanup()
    lm.cleanup()  # idempotent
    assert lm.is_closed
    members = public_members(type(lm))
    for name, member in members:
        with pytest.raises(ClosedError):
            await use(lm, name, member)
    return [name for name, _ in members]


async def test_mock():
    names = await check_every_member_raises(MockAsyncLM(SizedTokenizer()))
    assert {"next_token_logprobs", "sample", "byte_vocab", "stats", "logprobs_of"} <= set(names)


async def test_transformers():
    names = await check_every_member_raises(AsyncTransformer(shared_tiny_llama(), tiny_tokenizer()))
    assert {"cache_kv", "clear_kv_cache", "next_token_logprobs_uncached", "set_lora"} <= set(names)


@pytest.mark.vllm
async def test_vllm(vllm_lm):
    from vllm_fixtures import front_on_shared_engine

    names = await check_every_member_raises(front_on_shared_engine(vllm_lm.llm))
    assert {"underlying_model", "set_sessions", "warm_up", "close_sessions"} <= set(names)
    assert (await vllm_lm.next_token_logprobs([5, 6])).shape == (32000,)  # the engine still works
