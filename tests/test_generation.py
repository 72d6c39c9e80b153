"""generate() of a model qcompile loaded: its stop check deferred by one step on CUDA (qcompile.generation).
The CUDA behaviour itself (same tokens, no wait per token) is checked on the device in test_gpu_product."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers.cache_utils import StaticCache
from transformers.generation import utils as generation_utils

import qcompile
from qcompile import generation

CUDA = torch.device("cuda")


class _Cache:
    def __init__(self, croppable: bool):
        self.is_croppable = croppable


def test_is_supported_accepts_cuda_only_inside_deferred_stop():
    check = generation_utils.DeferredStopCheck
    generation._install()
    assert not check.is_supported(CUDA, None, False, False)  # transformers' own rule: mps only
    with generation.deferred_stop():
        assert check.is_supported(CUDA, None, False, False)
        assert check.is_supported("cuda:0", _Cache(False), False, False)  # the cache is not handed back
        assert check.is_supported(CUDA, _Cache(True), True, False)  # handed back, but croppable
        assert not check.is_supported(CUDA, _Cache(False), True, False)  # handed back, cannot undo a step
        assert not check.is_supported(CUDA, None, False, True)  # assisted decoding keeps its own loop
        assert not check.is_supported(torch.device("cpu"), None, False, False)  # nothing to overlap on CPU
    assert not check.is_supported(CUDA, None, False, False)


def test_several_processes_keep_transformers_loop():
    generation._install()
    with generation.deferred_stop(), mock.patch.object(torch.distributed, "is_initialized", return_value=True), \
            mock.patch.object(torch.distributed, "get_world_size", return_value=2):
        assert not generation_utils.DeferredStopCheck.is_supported(CUDA, None, False, False)


def test_install_leaves_a_check_without_is_supported_alone(monkeypatch):
    """A transformers whose DeferredStopCheck has no is_supported: nothing to wrap, no error."""
    monkeypatch.setattr(generation_utils, "DeferredStopCheck", type("DeferredStopCheck", (), {}))
    generation._install()
    assert not hasattr(generation_utils.DeferredStopCheck, "is_supported")


def test_install_is_idempotent():
    generation._install()
    first = generation_utils.DeferredStopCheck.is_supported
    generation._install()
    assert generation_utils.DeferredStopCheck.is_supported is first


def test_static_cache_qualifies():
    """generate's static cache is the one the CUDA path uses: it must pass the returned-cache rule or the
    deferral would never apply when the caller asks for the cache back."""
    from transformers import LlamaConfig

    cache = StaticCache(config=LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=2), max_cache_len=8)
    with generation.deferred_stop():
        assert generation_utils.DeferredStopCheck.is_supported(CUDA, cache, False, False)


def test_loaded_model_generates_inside_deferred_stop(synth_ckpt, monkeypatch):
    model = qcompile.load(str(synth_ckpt("ct-w4a16")))
    assert isinstance(model.generate, generation.DeferredGenerate)
    assert model.generate.__doc__ == type(model).generate.__doc__
    seen = []
    original = type(model).generate

    def spy(self, *args, **kwargs):
        seen.append(generation._ACTIVE.get())
        return original(self, *args, **kwargs)

    ids = torch.tensor([[5, 9, 13, 2]])
    greedy = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0)
    with mock.patch.object(type(model), "generate", spy):
        out = model.generate(ids, **greedy)
        monkeypatch.setenv("QCOMPILE_DEFER_STOP", "0")
        off = model.generate(ids, **greedy)
    assert seen == [True, False]
    assert torch.equal(out, off) and out.shape == (1, 10)
    assert not generation._ACTIVE.get()


def test_deferred_stop_resets_after_an_error():
    with pytest.raises(RuntimeError):
        with generation.deferred_stop():
            raise RuntimeError("inside")
    assert not generation._ACTIVE.get()
