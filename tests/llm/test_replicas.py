"""ReplicatedLM: one AsyncLM over several replicas (genlm_backend.llm.replicas).

Most tests run on mock replicas whose rows are their own: each salts the mock's seeded
rows with its name, so a row that came from another replica than the one that evaluated its
request, or went to another request, differs. The reference of every row is then the
replica's own ``logprobs_of`` (a direct computation, no batching), compared exactly. The
vLLM tests run two replicas of the tiny model, each an engine in a process of its own
(``test_replica_processes.py`` tests that route on mock replicas), against a plain
transformers forward pass (``ROW_ATOL``, as in ``test_vllm.py``) and against each replica's
own rows (identical on CPU: same kernels, same weights).
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import math
import os
import random
import threading
from types import SimpleNamespace

import pytest
import torch

from genlm_backend.exceptions import ClosedError, EngineError, InvalidRequestError
from genlm_backend.llm import MockAsyncLM, ReplicatedLM
from genlm_backend.llm.replicas.building import device_groups, visible_ids
from genlm_backend.llm.replicas.process import ProcessReplica

V = 300


class SizedTokenizer:
    """Only the length of a tokenizer matters to the mock."""

    def __len__(self) -> int:
        return V


class Replica(MockAsyncLM):
    """A mock replica whose rows are salted by ``salt``; records the batches it evaluates."""

    def __init__(self, salt, **kwargs):
        super().__init__(SizedTokenizer(), **kwargs)
        self.salt = salt
        self.batches: list[list[tuple]] = []
        self.fail_with: BaseException | None = None  # raised by the next evaluations
        self.bad_rows: set[tuple] = set()  # contexts answered with an exception instance
        self.gate: threading.Event | None = None  # evaluations wait for it

    def logprobs_of(self, token_ids, lora_name=None):
        return super().logprobs_of(token_ids, f"{self.salt}/{lora_name}")

    def _evaluate_logprobs(self, requests):
        self.batches.append([r.token_ids for r in requests])
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_with is not None:
            raise self.fail_with
        return [InvalidRequestError(f"no row for {r.token_ids}") if r.token_ids in self.bad_rows
                else self.logprobs_of(r.token_ids, r.lora_name) for r in requests]

    def evaluated(self) -> set[tuple]:
        return {ids for batch in self.batches for ids in batch}


class LoopReplica(Replica):
    """Evaluates on the event loop and answers with a future, as the vLLM backend does."""

    _evaluates_on_loop = True

    def _evaluate_logprobs(self, requests):
        future = asyncio.get_running_loop().create_future()

        def answer():
            try:
                future.set_result(Replica._evaluate_logprobs(self, requests))
            except Exception as exc:  # noqa: BLE001
                future.set_exception(exc)

        asyncio.get_running_loop().call_later(0.001, answer)
        return future


def owner(replicas, context) -> int:
    """The one replica that evaluated ``context``."""
    found = [i for i, r in enumerate(replicas) if tuple(context) in r.evaluated()]
    assert len(found) == 1, found
    return found[0]


# ---- rows --------------------------------------------------------------------------------


@pytest.mark.parametrize("kinds", [(Replica, Replica, Replica), (LoopReplica, Replica)])
async def test_every_row_is_the_row_of_the_replica_that_evaluated_it(kinds):
    replicas = [kind(i) for i, kind in enumerate(kinds)]
    with ReplicatedLM(replicas) as lm:
        contexts = [[3, i, i + 1] for i in range(25)] + [[3, 0, 1]]  # a duplicate
        for _ in range(3):
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
            for context, row in zip(contexts, rows):
                replica = replicas[owner(replicas, context)]
                assert torch.equal(row, replica.logprobs_of(context))
                assert torch.equal(row, await replica.next_token_logprobs(context))  # its own route
            contexts = [c + [int(r.argmax())] for c, r in zip(contexts, rows)]
        assert all(r.batches for r in replicas)
        assert lm.stats()["num_deduplicated"] == 3


def test_sync_twins_and_the_output_cache():
    replicas = [Replica(0), Replica(1)]
    lm = ReplicatedLM(replicas, cache_size=16)
    row = lm.next_token_logprobs_sync([4, 5, 6])
    assert torch.equal(row, replicas[owner(replicas, [4, 5, 6])].logprobs_of([4, 5, 6]))
    assert torch.equal(lm.next_token_logprobs_sync([4, 5, 6]), row)
    assert lm.stats()["cache_hits"] == 1 and sum(len(r.evaluated()) for r in replicas) == 1
    contexts = [[8, i] for i in range(6)]
    rows = lm.batch_next_token_logprobs_sync(contexts)
    assert rows.shape == (6, V)
    for context, row in zip(contexts, rows):
        assert torch.equal(row, replicas[owner(replicas, context)].logprobs_of(context))
    lm.cleanup()


async def test_rows_reach_the_caller_on_replica_0s_device():
    """Rows that a replica computes on another device are moved to replica 0's (here the
    meta device stands for replica 0's GPU), so a sampler can stack every particle's row."""

    class OnMeta(Replica):
        def _evaluate_logprobs(self, requests):
            return [row.to("meta") for row in super()._evaluate_logprobs(requests)]

    replicas = [OnMeta(0), Replica(1)]
    lm = ReplicatedLM(replicas)
    rows = await asyncio.gather(*(lm.next_token_logprobs([9, i]) for i in range(8)))
    assert {row.device.type for row in rows} == {"meta"} and lm.device == torch.device("meta")
    assert replicas[1].batches  # some rows did come from the CPU replica
    assert torch.stack(rows).shape == (8, V)
    lm.cleanup()


# ---- routing -----------------------------------------------------------------------------


@pytest.mark.parametrize("margin", [1.0, 1.25])
async def test_routing_keeps_lineage_and_balances_a_seeded_smc_workload(margin):
    """N particles from one prompt, T steps, resampling every 3 steps with random weights.
    Checked against the replicas' own records of what they evaluated: every batch within
    the margin; only a replica's excess over an even share moves, and only where it is
    beyond the margin (so a step where every particle extends its own parent keeps every
    particle in place); children of a context that another request extends already move
    first; and the counters say the same."""
    k, n, steps = 3, 60, 12
    replicas = [Replica(i) for i in range(k)]
    lm = ReplicatedLM(replicas, batch_size=256, balance_margin=margin)
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    contexts = [[1, 2, 3] for _ in range(n)]
    placed: dict[tuple, int] = {}  # context -> replica, from the replicas' records
    placed_before: dict[tuple, int] = {}
    counted = collections.Counter()
    for step in range(steps):
        before = [len(r.batches) for r in replicas]
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        shares = [sum(len(b) for b in r.batches[before[i]:]) for i, r in enumerate(replicas)]
        distinct = list(dict.fromkeys(tuple(c) for c in contexts))  # the batch, in its order
        even = math.ceil(len(distinct) / k)
        most = max(math.ceil(len(distinct) * margin / k), even)
        assert sum(shares) == len(distinct) and max(shares) <= most
        for i, r in enumerate(replicas):
            for batch in r.batches[before[i]:]:
                placed.update((ids, i) for ids in batch)
        if step:
            children = collections.defaultdict(list)  # parent -> its children, in batch order
            for context in distinct:
                children[context[:-1]].append(context)
            lineage = collections.Counter(placed_before[parent] for parent in children for _ in children[parent])
            moved = [kid for parent, kids in children.items() for kid in kids if placed[kid] != placed_before[parent]]
            counted["kept"] += len(distinct) - len(moved)
            counted["moved"] += len(moved)
            assert len(moved) == sum(load - even for load in lineage.values() if load > most)
            for r in range(k):  # children of a context that another request extends move first
                mine = [kids for parent, kids in children.items() if placed_before[parent] == r]
                first_moved = any(placed[kids[0]] != r for kids in mine)
                sibling_stayed = any(placed[kid] == r for kids in mine for kid in kids[1:])
                assert not (first_moved and sibling_stayed)
        placed_before = dict(placed)
        tokens = torch.multinomial(torch.stack(rows).exp(), 1, generator=generator).squeeze(1).tolist()
        contexts = [c + [t] for c, t in zip(contexts, tokens)]
        if step % 3 == 2:
            weights = [rng.random() for _ in contexts]
            contexts = [list(contexts[a]) for a in rng.choices(range(n), weights=weights, k=n)]
    routing = lm.stats()["routing"]
    assert routing["num_new"] == 1  # the prompt; every later context follows its parent
    assert routing["num_kept"] == counted["kept"] and routing["num_moved"] == counted["moved"]
    assert routing["num_routed"] == routing["num_kept"] + routing["num_moved"] + routing["num_new"]
    assert routing["num_kept"] > 3 * routing["num_moved"]
    assert routing["num_rows"] == [sum(len(b) for b in r.batches) for r in replicas]
    lm.cleanup()


# ---- failures and cancellation -------------------------------------------------------------


@pytest.mark.parametrize("kind", [Replica, LoopReplica])
async def test_a_failing_replica_fails_only_its_requests(kind):
    replicas = [kind(0), kind(1)]
    lm = ReplicatedLM(replicas)
    replicas[1].fail_with = RuntimeError("replica down")
    contexts = [[5, i] for i in range(10)]
    results = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts), return_exceptions=True)
    failed = replicas[1].evaluated()
    assert 0 < len(failed) < len(contexts)
    for context, result in zip(contexts, results):
        if tuple(context) in failed:
            assert isinstance(result, EngineError) and "replica 1" in str(result)
            assert isinstance(result.__cause__, RuntimeError)
        else:
            assert torch.equal(result, replicas[0].logprobs_of(context))
    # A row answered with an exception fails that request only; the model goes on.
    replicas[1].fail_with = None
    replicas[0].bad_rows = {(6, 0)}
    results = await asyncio.gather(*(lm.next_token_logprobs([6, i]) for i in range(4)), return_exceptions=True)
    assert isinstance(results[0], InvalidRequestError) and owner(replicas, [6, 0]) == 0
    for i, result in enumerate(results[1:], start=1):
        assert torch.equal(result, replicas[owner(replicas, [6, i])].logprobs_of([6, i]))
    assert lm.stats()["num_failed_batches"] == 0
    lm.cleanup()


async def test_a_closed_replica_fails_its_requests_with_closed_error():
    replicas = [Replica(0), Replica(1)]
    lm = ReplicatedLM(replicas)
    replicas[1].cleanup()
    results = await asyncio.gather(*(lm.next_token_logprobs([2, i]) for i in range(6)), return_exceptions=True)
    assert any(isinstance(r, ClosedError) and "replica 1" in str(r) for r in results)
    assert any(isinstance(r, torch.Tensor) for r in results)
    lm.cleanup()


async def test_cancelling_one_awaiter_harms_no_other():
    replicas = [Replica(0), Replica(1)]
    lm = ReplicatedLM(replicas)
    for r in replicas:
        r.gate = threading.Event()
    contexts = [[7, i] for i in range(6)]
    tasks = [asyncio.create_task(lm.next_token_logprobs(c)) for c in contexts]
    while sum(len(r.batches) for r in replicas) < 2:  # the batch is with both replicas
        await asyncio.sleep(0.005)
    tasks[2].cancel()
    queued = asyncio.create_task(lm.next_token_logprobs([7, 99]))  # waits for the next batch
    await asyncio.sleep(0)
    queued.cancel()
    for r in replicas:
        r.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[2], asyncio.CancelledError)
    for i, (context, result) in enumerate(zip(contexts, results)):
        if i != 2:
            assert torch.equal(result, replicas[owner(replicas, context)].logprobs_of(context))
    assert torch.equal(await lm.next_token_logprobs([7, 1]), replicas[owner(replicas, [7, 1])].logprobs_of([7, 1]))
    assert all((7, 99) not in r.evaluated() for r in replicas)  # nobody waited for it any more
    lm.cleanup()


# ---- adapters, sampling, lifecycle ---------------------------------------------------------


async def test_adapters_reach_every_replica():
    replicas = [Replica(0), Replica(1)]
    lm = ReplicatedLM(replicas)
    lm.add_new_lora("/adapters/a", "a")
    assert all(r._lora_paths == {"a": "/adapters/a"} for r in replicas)
    contexts = [[11, i] for i in range(6)]
    rows = await asyncio.gather(*(lm.next_token_logprobs(c, lora_name="a") for c in contexts))
    for context, row in zip(contexts, rows):
        assert torch.equal(row, replicas[owner(replicas, context)].logprobs_of(context, "a"))
    lm.set_lora(lora_name="a")
    assert lm.active_lora == "a" and all(r.active_lora == "a" for r in replicas)
    row = await lm.next_token_logprobs([12])
    assert torch.equal(row, replicas[owner(replicas, [12])].logprobs_of([12], "a"))
    lm.clear_lora()
    assert all(r.active_lora is None for r in replicas)
    lm.remove_lora("a")
    assert all(not r._lora_paths for r in replicas) and not lm._lora_paths
    with pytest.raises(InvalidRequestError):
        await lm.next_token_logprobs([12], lora_name="a")

    def refuse(name, path):
        raise InvalidRequestError("no room for another adapter")

    replicas[1]._load_lora = refuse  # all replicas or none
    with pytest.raises(InvalidRequestError, match="no room"):
        lm.add_new_lora("/adapters/b", "b")
    assert not lm._lora_paths and all(not r._lora_paths for r in replicas)
    lm.cleanup()


async def test_samples_spread_over_the_replicas_and_follow_their_seeds():
    replicas = [Replica("same"), Replica("same")]  # the same rows: the same samples anywhere
    reference = Replica("same")
    lm = ReplicatedLM(replicas)
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    samples = await lm.batch_sample(prompts, max_tokens=6, eos_token_ids=[0], seed=5)
    assert samples == await reference.batch_sample(prompts, max_tokens=6, eos_token_ids=[0], seed=5)
    assert await lm.sample([1, 2], 6, [0], seed=5) == samples[0]
    assert lm.stats()["routing"]["num_samples"] == [3, 2]
    for model in (lm, reference):
        model.cleanup()


def test_cleanup_cleans_every_replica_even_when_one_fails():
    replicas = [Replica(0), Replica(1), Replica(2)]
    lm = ReplicatedLM(replicas)

    def fail():
        raise RuntimeError("replica 0 would not stop")

    replicas[0]._close = fail
    with pytest.raises(RuntimeError, match="would not stop"):
        lm.cleanup()
    assert all(r.is_closed for r in replicas)
    lm.cleanup()  # idempotent
    with pytest.raises(ClosedError):
        lm.next_token_logprobs_sync([1])
    with ReplicatedLM([Replica(0), Replica(1)]) as lm:
        lm.next_token_logprobs_sync([1])
    assert lm.is_closed and all(r.is_closed for r in lm.replicas)


def test_replicas_must_be_distinct_open_models_of_one_vocabulary():
    a, b = Replica(0), Replica(1)
    with pytest.raises(InvalidRequestError, match="at least one"):
        ReplicatedLM([])
    with pytest.raises(InvalidRequestError, match="twice"):
        ReplicatedLM([a, a])
    with pytest.raises(InvalidRequestError, match="output size"):
        ReplicatedLM([a, MockAsyncLM(SizedTokenizer(), vocab_size=V + 1)])
    with pytest.raises(InvalidRequestError, match="not an AsyncLM"):
        ReplicatedLM([a, object()])
    b.cleanup()
    with pytest.raises(InvalidRequestError, match="cleaned up"):
        ReplicatedLM([a, b])
    lm = ReplicatedLM([a, Replica(2)])
    assert lm.batch_size == 40 and lm.vocab_size == V  # the sum of the replicas' batch sizes
    lm.cleanup()


def test_from_name_builds_mock_replicas_and_passes_the_wrappers_options(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, "<unk>"))
                            ).save_pretrained(tmp_path)
    lm = ReplicatedLM.from_name(str(tmp_path), replicas=3, backend="mock", cache_size=4, batch_size=7)
    assert len(lm.replicas) == 3 and lm.batch_size == 7 and lm.cache is not None
    assert all(r.cache is None for r in lm.replicas)
    assert torch.equal(lm.next_token_logprobs_sync([0, 1]), lm.replicas[0].logprobs_of([0, 1]))
    lm.cleanup()
    with pytest.raises(InvalidRequestError, match="unknown backend"):
        ReplicatedLM.from_name(str(tmp_path), backend="nope")


def test_replicas_take_consecutive_gpu_groups_named_as_this_process_names_them():
    assert device_groups(2, 1, [0, 1, 2]) == [[0], [1]]
    assert device_groups(2, 2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="need 4 GPUs"):
        device_groups(2, 2, [0, 1, 2])
    assert visible_ids([1], None) == ["1"]
    assert visible_ids([0, 1], "4, 6,7") == ["4", "6"]  # this process's cuda:0 is GPU 4
    assert visible_ids([1], "GPU-aa,GPU-bb") == ["GPU-bb"]


def test_a_session_pool_never_continues_another_pools_session():
    """Replicas share the caller's requests, so ``parent.kept`` may be a session of another
    replica's pool: a pool continues only its own sessions."""
    from genlm_backend.llm.prompts import PromptChecker
    from genlm_backend.llm.vllm.sessions import PlanEntry, SessionPool

    checker = PromptChecker(100, None)
    parent = checker.request([1, 2, 3], None)
    child = checker.request([1, 2, 3, 4], None)
    assert child.parent is parent
    a, b = SessionPool(lambda ids: None, 4), SessionPool(lambda ids: None, 4)
    b.plan([], None)  # b's batches are not a's
    (entry,) = a.plan([parent], None)
    job = SimpleNamespace(result=torch.zeros(3), stream_id=entry.session.request_id, stream_request=None,
                          params=None)
    a.bind(entry, job, tag=1)
    a.settle([parent], [entry], [job], [job.result])
    assert parent.kept is entry.session and entry.session.state == "parked"
    (elsewhere,) = b.plan([child], None)
    assert isinstance(elsewhere, PlanEntry) and elsewhere.session is not entry.session
    assert elsewhere.tokens == (1, 2, 3, 4) and b.stats()["num_extended"] == 0
    (here,) = a.plan([child], None)
    assert here.session is entry.session and here.tokens == (4,)


# ---- two vLLM replicas ---------------------------------------------------------------------

STEPS = 4


def needs_vllm(test):
    """vLLM's marks; on a GPU machine, two GPUs (a replica each)."""
    for mark in (
        pytest.mark.vllm,
        pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
        pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                           reason="two replicas on a GPU machine need two GPUs"),
    ):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def replicated_vllm(tiny_model_dirs):
    """Two replicas of the tiny model, each an engine in a process of its own."""
    from vllm_fixtures import ENGINE_OPTS

    lm = ReplicatedLM.from_name(str(tiny_model_dirs["base"]), replicas=2, engine_opts=dict(ENGINE_OPTS))
    yield lm
    lm.cleanup()


async def lockstep(lm, contexts, steps, seed, lora_name=None):
    """Lockstep sampling; returns every step's (contexts, rows)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = await asyncio.gather(*(lm.next_token_logprobs(c, lora_name=lora_name) for c in contexts))
        out.append((contexts, rows))
        tokens = torch.multinomial(torch.stack(rows).exp(), 1, generator=generator).squeeze(1).tolist()
        contexts = [c + [t] for c, t in zip(contexts, tokens)]
    return out


@needs_vllm
async def test_two_vllm_replicas_give_a_forward_pass_and_each_replicas_own_rows(replicated_vllm, hf_reference):
    from vllm_fixtures import assert_matches, assert_same_rows, prompts_of

    lm = replicated_vllm
    assert all(isinstance(r, ProcessReplica) for r in lm.replicas)
    pids = {r.pid for r in lm.replicas}
    assert len(pids) == 2 and os.getpid() not in pids
    before = lm.stats()
    contexts = prompts_of([3, 9, 17, 40, 5, 12, 7, 22, 30, 2], seed=90)
    for contexts_then, rows in await lockstep(lm, contexts, STEPS, seed=1):
        for context, row in zip(contexts_then, rows):
            assert_matches(row, hf_reference("base", context))
    for i, replica in enumerate(lm.replicas):  # the last step's rows, from each replica alone
        own = await asyncio.gather(*(replica.next_token_logprobs(c) for c in contexts_then))
        for mine, theirs in zip(rows, own):
            assert_same_rows(mine, theirs)
    after = lm.stats()
    routed = {k: after["routing"][k] - before["routing"][k] for k in ("num_routed", "num_kept", "num_new")}
    assert routed == {"num_routed": 10 * STEPS, "num_kept": 10 * (STEPS - 1), "num_new": 10}
    for old, new in zip(before["replicas"], after["replicas"]):  # lineage: the sessions were extended
        extended = new["process"]["sessions"]["num_extended"] - old["process"]["sessions"]["num_extended"]
        assert extended >= 5 * (STEPS - 1) - 2


@needs_vllm
async def test_adapters_on_two_vllm_replicas_match_the_merged_models(replicated_vllm, tiny_model_dirs,
                                                                      hf_reference):
    from vllm_fixtures import ON_GPU, assert_matches, prompts_of

    if ON_GPU:
        pytest.skip("vLLM's CUDA LoRA kernels refuse fp32 weights")
    lm = replicated_vllm
    lm.add_new_lora(str(tiny_model_dirs["adapter"]), "a")
    try:
        assert all("a" in r._lora_paths for r in lm.replicas)
        calls = [(p, name) for p in prompts_of([6, 13, 4], seed=91) for name in (None, "a")]
        rows = await asyncio.gather(*(lm.next_token_logprobs(c, lora_name=n) for c, n in calls))
        for (context, name), row in zip(calls, rows):
            assert_matches(row, hf_reference("merged" if name else "base", context))
    finally:
        lm.remove_lora("a")
    assert not any(r._lora_paths for r in lm.replicas)

