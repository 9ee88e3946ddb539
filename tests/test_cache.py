"""OutputCache against a plain ordered-dict model of least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_backend.cache import OutputCache


@settings(max_examples=100, deadline=None)
@given(
    maxsize=st.integers(1, 5),
    ops=st.lists(st.tuples(st.sampled_from(["set", "get"]), st.integers(0, 7)), max_size=40),
)
def test_matches_a_reference_lru(maxsize, ops):
    cache, model = OutputCache(maxsize), OrderedDict()
    for op, key in ops:
        if op == "set":
            cache[key] = torch.tensor([float(key)])
            model[key] = float(key)
            model.move_to_end(key)
            while len(model) > maxsize:
                model.popitem(last=False)
        elif key in model:
            assert float(cache[key]) == model[key]
            model.move_to_end(key)
        else:
            assert key not in cache
            with pytest.raises(KeyError):
                cache[key]
        assert len(cache) == len(model)
        assert all(k in cache for k in model)


def test_keys_with_adapters_do_not_mix():
    cache = OutputCache(4)
    cache[((1, 2), None)] = torch.zeros(2)
    cache[((1, 2), "a")] = torch.ones(2)
    assert torch.equal(cache[((1, 2), None)], torch.zeros(2))
    assert torch.equal(cache[((1, 2), "a")], torch.ones(2))
    cache.clear()
    assert len(cache) == 0 and cache.get(((1, 2), None)) is None


def test_bad_size_is_refused():
    for size in (0, -1, 1.5):
        with pytest.raises(ValueError):
            OutputCache(size)


def test_move_to_cpu_keeps_cpu_tensors_as_they_are():
    cache = OutputCache(2, move_to_cpu=True)
    row = torch.arange(3.0)
    cache["k"] = row
    assert torch.equal(cache["k"], row) and cache["k"].device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_move_to_cpu_stores_on_cpu_and_returns_on_the_original_device():
    cache = OutputCache(2, move_to_cpu=True)
    row = torch.arange(3.0, device="cuda")
    cache["k"] = row
    stored, device = cache._entries["k"]
    assert stored.device.type == "cpu" and device == row.device
    assert cache["k"].device == row.device and torch.equal(cache["k"], row)
