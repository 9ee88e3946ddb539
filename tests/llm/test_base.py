"""The shared AsyncLM behaviour, exercised through MockAsyncLM.

The mock's ``logprobs_of`` computes a row directly, without batching or caching: it is the
independent reference every batched, cached or sync result is compared with (exactly, since
the same generator draws the same numbers).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import threading

import numpy as np
import pytest
import torch

from genlm_backend.exceptions import ClosedError, RequestDroppedError
from genlm_backend.llm import AsyncLM, MockAsyncLM

V = 500


class SizedTokenizer:
    """Only the length of a tokenizer matters to the mock."""

    def __len__(self) -> int:
        return V


@pytest.fixture
def lm():
    model = MockAsyncLM(SizedTokenizer(), timeout=0.01)
    yield model
    model.cleanup()


async def test_rows_are_normalised_and_match_the_direct_computation(lm):
    row = await lm.next_token_logprobs([1, 2, 3])
    assert row.shape == (V,) and row.dtype == torch.float32
    assert torch.logsumexp(row, 0).item() == pytest.approx(0.0, abs=1e-5)
    assert torch.equal(row, lm.logprobs_of([1, 2, 3]))


async def test_batched_equals_unbatched(lm):
    prompts = [[1], [1, 2], [7, 7, 7], [1]]
    batch = await lm.batch_next_token_logprobs(prompts)
    assert batch.shape == (4, V)
    for prompt, row in zip(prompts, batch):
        assert torch.equal(row, lm.logprobs_of(prompt))
    assert lm.num_evaluated == 3  # the repeated prompt ran once


async def test_concurrent_awaits_share_one_batch(lm):
    await asyncio.gather(*(lm.next_token_logprobs([i + 1]) for i in range(10)))
    stats = lm.stats()
    assert stats["num_batches"] == 1 and stats["num_evaluated"] == 10


async def test_accepts_tuples_numpy_and_tensors(lm):
    expected = lm.logprobs_of([4, 5])
    for prompt in ((4, 5), np.array([4, 5]), torch.tensor([4, 5]), [np.int64(4), 5]):
        assert torch.equal(await lm.next_token_logprobs(prompt), expected)


BAD_PROMPTS = [
    ([], ValueError, "empty prompt"),
    ([1, -1], ValueError, "token id -1 at position 1"),
    ([V], ValueError, f"token id {V} at position 0 is outside the vocabulary of size {V}"),
    ([1, 2.0], TypeError, "token id 2.0"),
    ([True], TypeError, "token id True"),
    ("hello", TypeError, "list of ints"),
    (None, TypeError, "NoneType"),
    (np.zeros((2, 2), dtype=np.int64), TypeError, "1-D integer array"),
]


@pytest.mark.parametrize("prompt, error, message", BAD_PROMPTS)
async def test_bad_input_fails_its_caller_only(lm, prompt, error, message):
    results = await asyncio.gather(
        lm.next_token_logprobs([3]),
        lm.next_token_logprobs(prompt),
        lm.next_token_logprobs([4, 4]),
        return_exceptions=True,
    )
    assert isinstance(results[1], error) and message in str(results[1])
    assert torch.equal(results[0], lm.logprobs_of([3]))
    assert torch.equal(results[2], lm.logprobs_of([4, 4]))


async def test_unknown_adapter_fails_its_caller_only(lm):
    results = await asyncio.gather(
        lm.next_token_logprobs([3]),
        lm.next_token_logprobs([3], lora_name="nope"),
        return_exceptions=True,
    )
    assert torch.equal(results[0], lm.logprobs_of([3]))
    assert isinstance(results[1], ValueError) and "'nope'" in str(results[1])


async def test_a_bad_prompt_in_a_batch_call_fails_that_call_before_anything_runs(lm):
    with pytest.raises(ValueError, match="position 0"):
        await lm.batch_next_token_logprobs([[1], [V + 3]])
    assert lm.num_evaluated == 0
    with pytest.raises(ValueError, match="empty"):
        await lm.batch_next_token_logprobs([])


def test_sync_twins_work_from_a_plain_script(lm):
    assert torch.equal(lm.next_token_logprobs_sync([9]), lm.logprobs_of([9]))
    batch = lm.batch_next_token_logprobs_sync([[9], [8, 9]])
    assert torch.equal(batch[1], lm.logprobs_of([8, 9]))


async def test_sync_twins_work_inside_a_running_event_loop(lm):
    # A Jupyter cell: a loop is running in this thread and the user calls the sync twin.
    assert torch.equal(lm.next_token_logprobs_sync([9, 1]), lm.logprobs_of([9, 1]))
    assert torch.equal(lm.batch_next_token_logprobs_sync([[2]])[0], lm.logprobs_of([2]))


def test_output_cache_returns_private_copies_and_is_per_adapter():
    lm = MockAsyncLM(SizedTokenizer(), cache_size=10)
    lm.add_new_lora("/adapters/a", "a")
    first = lm.next_token_logprobs_sync([5])
    first.add_(100.0)  # the caller's copy: must not reach the cache
    again = lm.next_token_logprobs_sync([5])
    assert torch.equal(again, lm.logprobs_of([5]))
    assert lm.stats()["cache_hits"] == 1 and lm.num_evaluated == 1
    adapted = lm.next_token_logprobs_sync([5], lora_name="a")
    assert torch.equal(adapted, lm.logprobs_of([5], "a"))
    assert lm.num_evaluated == 2
    lm.batch_next_token_logprobs_sync([[5]])  # bypasses the cache
    assert lm.num_evaluated == 3
    lm.clear_cache()
    lm.next_token_logprobs_sync([5])
    assert lm.num_evaluated == 4
    lm.cleanup()


def test_adapter_routing():
    lm = MockAsyncLM(SizedTokenizer())
    lm.add_new_lora("/adapters/a", "a")
    lm.add_new_lora("/adapters/b", "b")
    with pytest.raises(ValueError, match="add_new_lora"):
        lm.set_lora("/adapters/c", "c")
    lm.set_lora("/adapters/a", "a")
    assert torch.equal(lm.next_token_logprobs_sync([1]), lm.logprobs_of([1], "a"))
    assert torch.equal(lm.next_token_logprobs_sync([1], lora_name="b"), lm.logprobs_of([1], "b"))
    lm.clear_lora()
    assert torch.equal(lm.next_token_logprobs_sync([1]), lm.logprobs_of([1]))
    lm.remove_lora("b")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'b'"):
        lm.next_token_logprobs_sync([1], lora_name="b")
    with pytest.raises(ValueError, match="already loaded"):
        lm.add_new_lora("/elsewhere", "a")
    lm.cleanup()


def test_adapter_ids_follow_the_contract_and_collisions_are_refused():
    def reference(name: str) -> int:
        return int(hashlib.shake_128(name.encode()).hexdigest(4), 16) % (2**31 - 2) + 1

    for name in ("lora_1", "adapter", "ünïcode"):
        assert AsyncLM.hash_to_int(name) == reference(name)
        assert 1 <= AsyncLM.hash_to_int(name) <= 2**31 - 1
    seen: dict[int, str] = {}
    for i in itertools.count():  # birthday search: ~2^16 names give a collision
        name = f"n{i}"
        other = seen.setdefault(AsyncLM.hash_to_int(name), name)
        if other != name:
            break
    lm = MockAsyncLM(SizedTokenizer())
    lm.add_new_lora("/x", other)
    with pytest.raises(ValueError, match="hash to the same id"):
        lm.add_new_lora("/y", name)
    lm.cleanup()


async def test_reset_drops_queued_requests_with_an_error(lm):
    slow = MockAsyncLM(SizedTokenizer(), timeout=30.0, flush="timer")
    waiting = asyncio.ensure_future(slow.next_token_logprobs([1]))
    await asyncio.sleep(0.01)
    slow.reset_async_queries()
    with pytest.raises(RequestDroppedError):
        await waiting
    slow.cleanup()


async def test_cleanup_fails_waiters_is_idempotent_and_later_use_raises():
    lm = MockAsyncLM(SizedTokenizer(), timeout=30.0, flush="timer")
    waiting = asyncio.ensure_future(lm.next_token_logprobs([1]))
    await asyncio.sleep(0.01)
    lm.cleanup()
    lm.cleanup()
    with pytest.raises(ClosedError):
        await waiting
    with pytest.raises(RuntimeError, match="cleaned up"):
        await lm.next_token_logprobs([1])
    with pytest.raises(RuntimeError):
        lm.next_token_logprobs_sync([1])


async def test_context_managers_clean_up():
    with MockAsyncLM(SizedTokenizer()) as lm:
        await lm.next_token_logprobs([1])
    assert lm.is_closed
    async with MockAsyncLM(SizedTokenizer()) as lm2:
        await lm2.next_token_logprobs([1])
    assert lm2.is_closed


async def test_sampling_is_reproducible_greedy_and_stops_at_eos_by_id(lm):
    a = await lm.sample([1, 2], max_tokens=8, eos_token_ids=[], seed=7)
    b = await lm.sample([1, 2], max_tokens=8, eos_token_ids=[], seed=7)
    assert a == b and len(a) == 8
    # Greedy, against a step-by-step argmax of the reference rows.
    context, expected = [1, 2], []
    for _ in range(6):
        token = int(torch.argmax(lm.logprobs_of(context)))
        expected.append(token)
        context.append(token)
    assert await lm.sample([1, 2], max_tokens=6, eos_token_ids=[], temperature=0) == expected
    stopped = await lm.sample([1, 2], max_tokens=6, eos_token_ids=[expected[3]], temperature=0)
    assert stopped == expected[:3]


async def test_batch_sample_seeds_each_prompt(lm):
    batch = await lm.batch_sample([[1], [1], [2]], max_tokens=4, eos_token_ids=[], seed=3)
    assert batch[0] == await lm.sample([1], 4, [], seed=3)
    assert batch[1] == await lm.sample([1], 4, [], seed=4)
    assert batch[2] == await lm.sample([2], 4, [], seed=5)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"max_tokens": 0}, ValueError),
        ({"max_tokens": 1.5}, TypeError),
        ({"temperature": -1}, ValueError),
        ({"eos_token_ids": [V]}, ValueError),
    ],
)
async def test_bad_sampling_arguments(lm, kwargs, error):
    args = {"prompt_token_ids": [1], "max_tokens": 3, "eos_token_ids": [0], **kwargs}
    with pytest.raises(error):
        await lm.sample(**args)


def test_a_sync_twin_inside_the_sync_loop_raises_instead_of_deadlocking(lm):
    from genlm_backend.sync_calls import run_sync

    async def nested():
        return lm.next_token_logprobs_sync([1])  # would wait on the loop it runs on

    with pytest.raises(RuntimeError, match="await the async method"):
        run_sync(nested())
    assert torch.equal(lm.next_token_logprobs_sync([1]), lm.logprobs_of([1]))  # still works


async def test_sampled_tokens_equal_a_direct_draw_from_the_reference_rows(lm):
    """Exact: the same generator math on the reference rows, step by step."""
    for temperature in (1.0, 0.7):
        generator, context, expected = torch.Generator().manual_seed(11), [4, 5], []
        for _ in range(6):
            probs = torch.softmax(lm.logprobs_of(context) / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            expected.append(token)
            context.append(token)
        assert await lm.sample([4, 5], 6, [], temperature=temperature, seed=11) == expected


async def test_sampling_draws_run_off_the_event_loop_thread(lm, monkeypatch):
    """A draw is an O(V) pass (about 1 ms at V = 32k): run on the loop, concurrent samplers'
    draws add up to blocks of the whole loop."""
    threads, multinomial = [], torch.multinomial

    def recording_multinomial(*args, **kwargs):
        threads.append(threading.current_thread())
        return multinomial(*args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", recording_multinomial)
    await asyncio.gather(*(lm.sample([i + 1], 3, [], seed=i) for i in range(4)))
    assert len(threads) == 12
    assert threading.current_thread() not in threads
    lm.cleanup()  # the draws' thread ends with the model: a library leaves no thread behind
    threads[0].join(timeout=10)
    assert not threads[0].is_alive()


async def test_cancelling_a_batch_call_harms_no_other_awaiter(lm):
    """A batch call queues one future a row; cancelling it cancels only its own waits: a
    caller awaiting the same prompt still gets its row, and nothing else is lost."""
    batch = asyncio.ensure_future(lm.batch_next_token_logprobs([[4, 5], [6]]))
    other = asyncio.ensure_future(lm.next_token_logprobs([6]))
    await asyncio.sleep(0)  # both queued, the batch not run yet
    batch.cancel()
    assert torch.equal(await other, lm.logprobs_of([6]))
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert torch.equal(await lm.next_token_logprobs([4, 5]), lm.logprobs_of([4, 5]))


async def test_a_batch_call_after_cleanup_queues_nothing(lm):
    lm.cleanup()
    with pytest.raises(ClosedError):
        await lm.batch_next_token_logprobs([[1], [2]])
