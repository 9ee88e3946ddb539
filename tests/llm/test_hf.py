"""AsyncTransformer against an independent reference: a plain uncached forward pass.

Tolerance: 1e-5 (max abs difference of fp32 log-probabilities on the CPU). Resuming from
cached key/values, padding and batching change only the order of floating-point operations;
on this model such reorderings move log-probabilities by about 1e-6, while any real error
(a wrong position, a leaked padding position, another prompt's states) moves them by more
than 1e-2 (the weights are drawn wide enough for that, see ``hf_fixtures``).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hf_fixtures import (
    MAX_POSITIONS,
    VOCAB_SIZE,
    random_prompt,
    reference_logprobs,
    shared_tiny_llama,
    tiny_tokenizer,
    trie_nodes,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_backend.exceptions import (
    ClosedError,
    EngineError,
    InvalidRequestError,
    InvalidRequestTypeError,
)
from genlm_backend.llm.hf import AsyncTransformer

TOL = 1e-5


@pytest.fixture
def hf_model():
    """The shared read-only fp32 tiny Llama."""
    return shared_tiny_llama()


@pytest.fixture
def hf_lm(hf_model):
    """A fresh AsyncTransformer on the shared model (its own trie, stats and caches)."""
    lm = AsyncTransformer(hf_model, tiny_tokenizer())
    yield lm
    lm.cleanup()


def assert_close(row: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    assert row.dtype == torch.float32
    assert row.shape == expected.shape
    diff = (row.cpu() - expected).abs().max().item()
    assert diff <= tol, f"max abs difference {diff} > {tol}"


def forward_counts(lm: AsyncTransformer) -> tuple[int, int, int]:
    stats = lm.stats()
    return stats["num_forward_passes"], stats["num_forward_tokens"], stats["num_reused_tokens"]


# ---- exactness --------------------------------------------------------------------------


async def test_mixed_batch_matches_reference(hf_lm, hf_model):
    base = random_prompt(60, seed=1)
    prompts = [
        base[:10],
        base[:30],
        base[:30] + [5],  # extends another prompt of the same batch
        base[:7] + [1, 2, 3],  # shares a prefix, then diverges
        [9],  # a single token
        base,
        base[:59] + [3],  # differs from `base` in the last token only
        random_prompt(3, seed=2),
    ]
    rows = await hf_lm.batch_next_token_logprobs(prompts)
    assert rows.shape == (len(prompts), VOCAB_SIZE)
    for prompt, row in zip(prompts, rows):
        assert_close(row, reference_logprobs(hf_model, prompt))
    # Second round: every prompt extended by a token or two resumes from cached states of
    # different lengths in one batch (padded past states, masked).
    longer = [p + [4] for p in prompts] + [prompts[1] + [6, 7], prompts[4] + [8, 9, 10]]
    rows = await hf_lm.batch_next_token_logprobs(longer)
    for prompt, row in zip(longer, rows):
        assert_close(row, reference_logprobs(hf_model, prompt))
    assert hf_lm.stats()["num_reused_tokens"] > 0


@settings(max_examples=12)
@given(
    data=st.lists(
        st.tuples(
            st.integers(0, 40), st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=0, max_size=12)
        ),
        min_size=1,
        max_size=6,
    )
)
def test_any_mix_of_shared_prefixes_matches_reference(data):
    """Prompts = a prefix of one shared stem + their own tail, evaluated over two batches."""
    model = shared_tiny_llama()
    stem = random_prompt(40, seed=3)
    prompts = []
    for cut, tail in data:
        prompt = stem[:cut] + tail
        if prompt and prompt not in prompts:
            prompts.append(prompt)
    if not prompts:
        return
    with AsyncTransformer(model, tiny_tokenizer()) as lm:
        first = lm.batch_next_token_logprobs_sync(prompts[: len(prompts) // 2 + 1])
        second = lm.batch_next_token_logprobs_sync(prompts)
    for prompt, row in zip(prompts, second):
        assert_close(row, reference_logprobs(model, prompt))
    for prompt, row in zip(prompts, first):
        assert_close(row, reference_logprobs(model, prompt))


async def test_rows_are_normalised_fp32_on_the_model_device(hf_lm):
    row = await hf_lm.next_token_logprobs(random_prompt(5, seed=4))
    assert row.dtype == torch.float32 and row.device == hf_lm.device
    assert abs(torch.logsumexp(row, 0).item()) < 1e-5


def test_bf16_model_gives_fp32_rows(hf_model):
    """The log-softmax is taken in fp32 even when the model computes in bf16."""
    from hf_fixtures import load_tiny_llama

    model = load_tiny_llama(torch.bfloat16)
    prompt = random_prompt(20, seed=5)
    with AsyncTransformer(model, tiny_tokenizer()) as lm:
        uncached = lm.next_token_logprobs_uncached(prompt)
        lm.cache_kv(prompt[:-3])
        cached = lm.next_token_logprobs_sync(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    assert logits.dtype == torch.bfloat16
    expected = logits.float().log_softmax(-1)
    assert uncached.dtype == cached.dtype == torch.float32
    assert torch.equal(uncached, expected)  # the very same computation
    assert abs(torch.logsumexp(cached, 0).item()) < 1e-5
    # Resumed from cached bf16 states: bf16 rounding of a different operation order.
    assert (cached - expected).abs().max().item() < 0.1


# ---- key/value reuse ----------------------------------------------------------------------


async def test_extension_runs_only_new_tokens(hf_lm, hf_model):
    prompt = random_prompt(50, seed=6)
    await hf_lm.next_token_logprobs(prompt)
    passes, tokens, reused = forward_counts(hf_lm)
    assert (passes, tokens, reused) == (1, 50, 0)
    row = await hf_lm.next_token_logprobs(prompt + [11])
    assert forward_counts(hf_lm) == (2, 51, 50)
    assert_close(row, reference_logprobs(hf_model, prompt + [11]))
    # A prefix of a cached prompt resumes from the row of its descendant.
    row = await hf_lm.next_token_logprobs(prompt[:20] + [12])
    assert forward_counts(hf_lm) == (3, 52, 70)
    assert_close(row, reference_logprobs(hf_model, prompt[:20] + [12]))
    # The very same prompt again: only its last token runs (no output cache by default).
    row = await hf_lm.next_token_logprobs(prompt)
    assert forward_counts(hf_lm) == (4, 53, 119)
    assert_close(row, reference_logprobs(hf_model, prompt))


async def test_lockstep_particles_cost_one_single_token_pass_per_step(hf_lm, hf_model):
    prompt = random_prompt(30, seed=7)
    num_particles, num_steps = 8, 5
    contexts: list[list[int]] = [list(prompt) for _ in range(num_particles)]
    rows_seen = {}

    async def particle(i: int) -> None:
        generator = torch.Generator().manual_seed(i)
        for _ in range(num_steps):
            row = await hf_lm.next_token_logprobs(contexts[i])
            rows_seen[tuple(contexts[i])] = row
            contexts[i].append(int(torch.multinomial(row.exp(), 1, generator=generator)))

    await asyncio.gather(*(particle(i) for i in range(num_particles)))
    passes, tokens, _ = forward_counts(hf_lm)
    distinct = {tuple(c[: len(prompt) + s]) for c in contexts for s in range(1, num_steps)}
    assert passes == num_steps
    assert tokens == len(prompt) + len(distinct)
    for context, row in list(rows_seen.items())[:: max(1, len(rows_seen) // 10)]:
        assert_close(row, reference_logprobs(hf_model, context))


async def test_shared_prefix_in_one_batch_runs_once(hf_lm, hf_model):
    prompt = random_prompt(40, seed=8)
    prompts = [prompt + [t] for t in (5, 6, 7, 8)]
    rows = await hf_lm.batch_next_token_logprobs(prompts)
    _, tokens, _ = forward_counts(hf_lm)
    assert tokens == len(prompt) + len(prompts)
    for p, row in zip(prompts, rows):
        assert_close(row, reference_logprobs(hf_model, p))


async def test_cache_kv_then_extensions(hf_lm, hf_model):
    prompt = random_prompt(64, seed=9)
    hf_lm.cache_kv(prompt)
    assert forward_counts(hf_lm) == (1, 64, 0)
    hf_lm.cache_kv(prompt)  # already cached: nothing runs
    hf_lm.cache_kv(prompt[:10])
    assert forward_counts(hf_lm)[:2] == (1, 64)
    rows = await hf_lm.batch_next_token_logprobs([prompt + [1], prompt + [2]])
    assert forward_counts(hf_lm)[1] == 66
    for t, row in zip((1, 2), rows):
        assert_close(row, reference_logprobs(hf_model, prompt + [t]))


async def test_uncached_does_not_touch_the_trie(hf_lm, hf_model):
    prompt = random_prompt(25, seed=10)
    row = hf_lm.next_token_logprobs_uncached(prompt)
    assert_close(row, reference_logprobs(hf_model, prompt))
    stats = hf_lm.stats()
    assert stats["kv_cache_bytes"] == 0 and stats["num_forward_passes"] == 0
    await hf_lm.next_token_logprobs(prompt)
    before = hf_lm.stats()
    hf_lm.next_token_logprobs_uncached(prompt + [3])
    after = hf_lm.stats()
    assert after["kv_cache_bytes"] == before["kv_cache_bytes"]
    assert after["num_forward_passes"] == before["num_forward_passes"]


async def test_clear_kv_cache_and_clear_cache(hf_model):
    prompt = random_prompt(20, seed=11)
    with AsyncTransformer(hf_model, tiny_tokenizer(), cache_size=8) as lm:
        await lm.next_token_logprobs(prompt)
        assert lm.stats()["kv_cache_bytes"] > 0
        lm.clear_kv_cache()
        assert lm.stats()["kv_cache_bytes"] == 0
        await lm.next_token_logprobs(prompt + [1])
        assert forward_counts(lm)[1] == 20 + 21  # recomputed from scratch
        await lm.next_token_logprobs(prompt + [1])
        assert lm.stats()["cache_hits"] == 1  # the output cache still holds it
        lm.clear_cache()
        assert lm.stats()["kv_cache_bytes"] == 0 and len(lm.cache) == 0
        row = await lm.next_token_logprobs(prompt + [1])
        assert_close(row, reference_logprobs(hf_model, prompt + [1]))


async def test_memory_bound_evicts_least_recently_used(hf_model):
    """Distinct prompts under a bound of about three blocks; results stay exact throughout."""
    prompt_len = 32
    # 2 layers x (keys + values) x 2 KV heads x 16 dimensions x 4 bytes
    per_token = 2 * 2 * 2 * 16 * 4
    bound = 3 * per_token * prompt_len + 8 * per_token
    prompts = [random_prompt(prompt_len, seed=100 + i) for i in range(8)]
    with AsyncTransformer(hf_model, tiny_tokenizer(), max_kv_cache_bytes=bound) as lm:
        for i, prompt in enumerate(prompts):
            row = await lm.next_token_logprobs(prompt)
            assert_close(row, reference_logprobs(hf_model, prompt))
            stats = lm.stats()
            assert stats["kv_cache_bytes"] <= bound
            assert stats["kv_cache_blocks"] == min(i + 1, 3)
        assert lm.stats()["kv_evicted_blocks"] == 5
        # Kept: prompts 5, 6, 7. Using prompt 5 makes it the most recent, so the next
        # insertion evicts prompt 6 (least recently used), not prompt 5 (oldest).
        row = await lm.next_token_logprobs(prompts[5] + [1])
        assert_close(row, reference_logprobs(hf_model, prompts[5] + [1]))
        _, tokens, _ = forward_counts(lm)
        row = await lm.next_token_logprobs(prompts[5] + [2])
        assert forward_counts(lm)[1] == tokens + 1
        assert_close(row, reference_logprobs(hf_model, prompts[5] + [2]))
        row = await lm.next_token_logprobs(prompts[6] + [2])
        assert forward_counts(lm)[1] == tokens + 1 + prompt_len + 1
        assert_close(row, reference_logprobs(hf_model, prompts[6] + [2]))
        assert lm.stats()["kv_cache_bytes"] <= bound
        # Nodes go with their blocks: what is left is at most the paths of the kept blocks.
        assert trie_nodes(lm.engine.kv) <= lm.stats()["kv_cache_blocks"] * (prompt_len + 2)


async def test_zero_bound_keeps_nothing_but_stays_exact(hf_model):
    prompt = random_prompt(16, seed=12)
    with AsyncTransformer(hf_model, tiny_tokenizer(), max_kv_cache_bytes=0) as lm:
        await lm.next_token_logprobs(prompt)
        row = await lm.next_token_logprobs(prompt + [1])
        assert lm.stats()["kv_cache_bytes"] == 0
        assert forward_counts(lm)[1] == 16 + 17
        assert_close(row, reference_logprobs(hf_model, prompt + [1]))


async def test_oversized_block_warns(hf_model):
    lm = AsyncTransformer(hf_model, tiny_tokenizer(), max_kv_cache_bytes=100)
    with lm, pytest.warns(RuntimeWarning, match="max_kv_cache_bytes"):
        await lm.next_token_logprobs(random_prompt(16, seed=13))


async def test_long_context_no_recursion(hf_lm, hf_model):
    prompt = random_prompt(1600, seed=14)
    row = await hf_lm.next_token_logprobs(prompt)
    assert_close(row, reference_logprobs(hf_model, prompt))
    row = await hf_lm.next_token_logprobs(prompt + [7])
    assert_close(row, reference_logprobs(hf_model, prompt + [7]))
    row = await hf_lm.next_token_logprobs(prompt[:1500] + [8])
    assert_close(row, reference_logprobs(hf_model, prompt[:1500] + [8]))
    assert forward_counts(hf_lm)[1] == 1600 + 1 + 1
    hf_lm.clear_kv_cache()


# ---- bad input and engine failures ---------------------------------------------------------


@pytest.mark.parametrize(
    "bad, error",
    [
        ([], InvalidRequestError),
        ([5, -1], InvalidRequestError),
        ([5, VOCAB_SIZE], InvalidRequestError),
        ([1] * (MAX_POSITIONS + 1), InvalidRequestError),
        ([1.0, 2.0], InvalidRequestTypeError),
        ("hello", InvalidRequestTypeError),
        ([1, True], InvalidRequestTypeError),
        (None, InvalidRequestTypeError),
    ],
)
async def test_bad_input_fails_only_its_caller(hf_lm, hf_model, bad, error):
    good = [random_prompt(8, seed=15), random_prompt(12, seed=16)]
    results = await asyncio.gather(
        hf_lm.next_token_logprobs(good[0]),
        hf_lm.next_token_logprobs(bad),
        hf_lm.next_token_logprobs(good[1]),
        return_exceptions=True,
    )
    assert isinstance(results[1], error)
    assert isinstance(results[1], ValueError if error is InvalidRequestError else TypeError)
    assert_close(results[0], reference_logprobs(hf_model, good[0]))
    assert_close(results[2], reference_logprobs(hf_model, good[1]))


async def test_longest_allowed_prompt_runs(hf_lm, hf_model):
    prompt = random_prompt(MAX_POSITIONS, seed=17)
    row = await hf_lm.next_token_logprobs(prompt)
    assert_close(row, reference_logprobs(hf_model, prompt))
    hf_lm.clear_kv_cache()


async def test_unknown_adapter_fails_only_its_caller(hf_lm):
    results = await asyncio.gather(
        hf_lm.next_token_logprobs([1, 2, 3]),
        hf_lm.next_token_logprobs([1, 2, 3], lora_name="nope"),
        return_exceptions=True,
    )
    assert isinstance(results[0], torch.Tensor)
    assert isinstance(results[1], InvalidRequestError) and "nope" in str(results[1])


class FailOnToken(torch.nn.Module):
    """Wraps a model; its forward pass raises when ``bad_token`` is among the inputs."""

    def __init__(self, model, bad_token: int):
        super().__init__()
        self.inner = model
        self.bad_token = bad_token
        self.config = model.config

    def forward(self, input_ids, **kwargs):
        if (input_ids == self.bad_token).any():
            raise RuntimeError(f"cannot run token {self.bad_token}")
        return self.inner(input_ids=input_ids, **kwargs)

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


async def test_engine_failure_is_isolated_to_its_prompt(hf_model):
    bad_token = 31999
    with AsyncTransformer(FailOnToken(hf_model, bad_token), tiny_tokenizer()) as lm:
        good = [random_prompt(10, seed=18), random_prompt(6, seed=19)]
        results = await asyncio.gather(
            lm.next_token_logprobs(good[0]),
            lm.next_token_logprobs([4, 5, bad_token]),
            lm.next_token_logprobs(good[1]),
            return_exceptions=True,
        )
        assert isinstance(results[1], EngineError) and isinstance(
            results[1].__cause__, RuntimeError
        )
        assert_close(results[0], reference_logprobs(hf_model, good[0]))
        assert_close(results[2], reference_logprobs(hf_model, good[1]))
        # The next batch works, and the cached states of the good prompts are intact.
        row = await lm.next_token_logprobs(good[0] + [1])
        assert_close(row, reference_logprobs(hf_model, good[0] + [1]))
        with pytest.raises(EngineError):
            await lm.next_token_logprobs([bad_token])


# ---- sampling --------------------------------------------------------------------------------


async def test_sample_is_reproducible_and_stops_at_eos(hf_lm):
    prompt = random_prompt(10, seed=20)
    a = await hf_lm.sample(prompt, max_tokens=12, eos_token_ids=[], temperature=1.0, seed=3)
    b = await hf_lm.sample(prompt, max_tokens=12, eos_token_ids=[], temperature=1.0, seed=3)
    assert a == b and len(a) == 12
    stop = a[5]
    c = await hf_lm.sample(prompt, max_tokens=12, eos_token_ids=[stop], temperature=1.0, seed=3)
    assert c == a[: a.index(stop)]
    batch = await hf_lm.batch_sample([prompt, prompt], max_tokens=6, eos_token_ids=[], seed=3)
    assert batch[0] == a[:6]
    assert len(batch[1]) == 6


async def test_temperature_zero_is_greedy_decoding(hf_lm, hf_model):
    prompt = random_prompt(12, seed=21)
    sampled = await hf_lm.sample(prompt, max_tokens=10, eos_token_ids=[], temperature=0)
    context, expected = list(prompt), []
    for _ in range(10):
        token = int(reference_logprobs(hf_model, context).argmax())
        expected.append(token)
        context.append(token)
    assert sampled == expected


# ---- loading and lifecycle ---------------------------------------------------------------------


def test_from_name_loads_a_local_folder_offline(monkeypatch):
    from hf_fixtures import tiny_llama_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with AsyncTransformer.from_name(str(tiny_llama_dir()), batch_size=4) as lm:
        assert lm.vocab_size == VOCAB_SIZE
        assert lm.max_prompt_len == MAX_POSITIONS
        assert lm.batch_size == 4
        assert lm.tokenizer.name_or_path == str(tiny_llama_dir())
        prompt = lm.tokenizer.encode("Hello world")
        row = lm.next_token_logprobs_sync(prompt)
        assert_close(row, reference_logprobs(shared_tiny_llama(), prompt))


def test_load_model_by_name_hf(monkeypatch):
    from hf_fixtures import tiny_llama_dir

    from genlm_backend import load_model_by_name

    lm = load_model_by_name(
        str(tiny_llama_dir()), backend="hf", llm_opts={"hf_opts": {"dtype": torch.float32}}
    )
    with lm:
        assert type(lm).__name__ == "AsyncTransformer"
        assert lm.model.dtype == torch.float32


@pytest.mark.slow
def test_from_name_loads_the_smollm2_gguf_file():
    """The real trained SmolLM2-135M, from its GGUF file: it knows the capital of France."""
    from tests.real_tokenizers import smollm2_gguf_path

    with AsyncTransformer.from_name(
        str(smollm2_gguf_path()), hf_opts={"dtype": torch.float32}
    ) as lm:
        assert lm.vocab_size == 49152
        prompt = lm.tokenizer.encode("The capital of France is")
        sampled = lm.batch_next_token_logprobs_sync([prompt])
        assert_close(sampled[0], lm.next_token_logprobs_uncached(prompt), tol=1e-4)
        tokens = asyncio.run(lm.sample(prompt, max_tokens=3, eos_token_ids=[0, 2], temperature=0))
        assert "Paris" in lm.tokenizer.decode(tokens)


def test_cleanup_semantics(hf_model):
    lm = AsyncTransformer(hf_model, tiny_tokenizer())
    lm.next_token_logprobs_sync([1, 2, 3])
    lm.cleanup()
    lm.cleanup()  # idempotent
    assert lm.model is None
    with pytest.raises(ClosedError):
        lm.next_token_logprobs_sync([1, 2, 3])
    with pytest.raises(ClosedError):
        lm.cache_kv([1, 2, 3])
    with pytest.raises(ClosedError):
        lm.next_token_logprobs_uncached([1, 2, 3])
    with pytest.raises(RuntimeError):
        asyncio.run(lm.next_token_logprobs([1, 2, 3]))


async def test_async_context_manager(hf_model):
    async with AsyncTransformer(hf_model, tiny_tokenizer()) as lm:
        await lm.next_token_logprobs([1, 2])
    assert lm.is_closed


def test_a_missing_tokenizer_is_refused_at_construction(hf_model):
    with pytest.raises(TypeError, match="hf_tokenizer"):
        AsyncTransformer(hf_model, None)


# ---- CUDA ----------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
async def test_cuda_model_matches_its_reference(dtype, tol):
    """On CUDA, kernels differ with batch shape (and bf16 rounds coarsely): looser tolerances."""
    from hf_fixtures import load_tiny_llama

    model = load_tiny_llama(dtype).to("cuda")
    base = random_prompt(40, seed=50)
    prompts = [base, base[:20] + [3], base[:5], [7, 8]]
    async with AsyncTransformer(model, tiny_tokenizer()) as lm:
        rows = await lm.batch_next_token_logprobs(prompts)
        more = await lm.batch_next_token_logprobs([p + [1] for p in prompts])
    assert rows.device.type == "cuda" and rows.dtype == torch.float32
    for prompt, row, row_more in zip(prompts, rows, more):
        assert_close(row, reference_logprobs(model, prompt), tol)
        assert_close(row_more, reference_logprobs(model, prompt + [1]), tol)


def test_a_failed_constructor_stops_the_threads_it_started():
    """Anything the constructor started, it stops when it fails: a bad argument after the
    engine thread was started used to leave that thread running (one per retry)."""
    import threading

    def ours() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("genlm-AsyncTransformer")}

    before = ours()  # (other tests' models may still be winding their threads down)
    with pytest.raises(ValueError, match="max_bytes"):
        AsyncTransformer(shared_tiny_llama(), tiny_tokenizer(), max_kv_cache_bytes=-1)
    assert not ours() - before  # no thread of this constructor is left running
