"""The counter pass: the graph rewrite (expecttest), equal results and counters with and without it, what it
leaves alone, and a tiny Llama's decode step through the backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from expecttest import assert_expected_inline

import qcompile
from qcompile.passes.counters import batch_counter_increments

from .test_topk_pass import body

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def rewritten(fn, *args):
    """(output, graph code before the pass, after) of ``fn(*args)`` compiled as one Dynamo graph that the
    counter pass rewrites, then runs as it is."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        before = gm.code
        batch_counter_increments(gm, example_inputs)
        graphs.append((before, gm.code))
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return (out, *graphs[0])


def cache_layers(x, counters, keys):
    """What a static cache's layers do: the position from the counter, the counter bumped, the key written."""
    for counter, k in zip(counters, keys):
        position = torch.arange(1) + counter
        counter.add_(1)
        k.index_copy_(0, position, x)
        x = x * 2
    return x


def state(n=3):
    return torch.randn(1, 4), [torch.tensor(i) for i in range(n)], [torch.zeros(8, 4) for _ in range(n)]


def test_cache_layers_graph():
    x, counters, keys = state()
    out, before, after = rewritten(cache_layers, x, counters, keys)
    assert before.count(".add_(1)") == 3
    assert_expected_inline(body(after), """\
l_counters_0_ = L_counters_0_
l_keys_0_ = L_keys_0_
l_x_ = L_x_
l_counters_1_ = L_counters_1_
l_keys_1_ = L_keys_1_
l_counters_2_ = L_counters_2_
l_keys_2_ = L_keys_2_
arange = torch.arange(1)
position = arange + l_counters_0_;  arange = None
index_copy_ = l_keys_0_.index_copy_(0, position, l_x_);  l_keys_0_ = position = index_copy_ = None
x = l_x_ * 2;  l_x_ = None
arange_1 = torch.arange(1)
position_1 = arange_1 + l_counters_1_;  arange_1 = None
index_copy__1 = l_keys_1_.index_copy_(0, position_1, x);  l_keys_1_ = position_1 = index_copy__1 = None
x_1 = x * 2;  x = None
arange_2 = torch.arange(1)
position_2 = arange_2 + l_counters_2_;  arange_2 = None
index_copy__2 = l_keys_2_.index_copy_(0, position_2, x_1);  l_keys_2_ = position_2 = index_copy__2 = None
x_2 = x_1 * 2;  x_1 = None
_foreach_add_ = torch._foreach_add_([l_counters_0_, l_counters_1_, l_counters_2_], 1);  l_counters_0_ = l_counters_1_ = l_counters_2_ = _foreach_add_ = None
return (x_2,)""")
    x2, counters2, keys2 = x.clone(), [torch.tensor(i) for i in range(3)], [torch.zeros(8, 4) for _ in range(3)]
    torch.testing.assert_close(out, cache_layers(x2, counters2, keys2), rtol=0, atol=0)
    assert [int(c) for c in counters] == [int(c) for c in counters2] == [1, 2, 3]
    for got, want in zip(keys, keys2):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def read_after(x, counters, keys):
    y = cache_layers(x, counters, keys)
    return y + counters[1]  # the second counter read after its increment


def view_read_after(x, counters, keys):
    seen = counters[0].view(1)  # a view made before the increment, read after it
    y = cache_layers(x, counters, keys)
    return y + seen


def result_used(x, counters, keys):
    y = cache_layers(x, counters[1:], keys[1:])
    return y + counters[0].add_(1)


def one_counter(x, counters, keys):
    return cache_layers(x, counters[:1], keys[:1])


# case -> the counter whose increment stays where it is (the others move), or None: all stay
KEPT = {"read-after": (read_after, 1), "view-read-after": (view_read_after, 0), "result-used": (result_used, 0),
        "one-counter": (one_counter, None)}


@pytest.mark.parametrize("case", KEPT)
def test_left_alone(case):
    fn, kept = KEPT[case]
    x, counters, keys = state()
    out, before, after = rewritten(fn, x, counters, keys)
    if kept is None:
        assert ".add_(1)" in before and before == after
    else:
        moved = ", ".join(f"l_counters_{i}_" for i in range(3) if i != kept)
        assert after.count(".add_(1)") == 1 and f"l_counters_{kept}_.add_(1)" in after
        assert f"_foreach_add_([{moved}], 1)" in after
    x2, counters2, keys2 = x.clone(), [torch.tensor(i) for i in range(3)], [torch.zeros(8, 4) for _ in range(3)]
    torch.testing.assert_close(out, fn(x2, counters2, keys2), rtol=0, atol=0)
    assert [int(c) for c in counters] == [int(c) for c in counters2]


def test_counters_sharing_memory_are_left_alone():
    """Two graph inputs that are views of one tensor: the pass cannot tell their reads apart, so leaves them."""
    x, _, keys = state()
    base = torch.zeros(2, dtype=torch.long)
    out, before, after = rewritten(lambda x, a, b, keys: cache_layers(x, [a, b], keys), x, base[0], base[1],
                                   keys[:2])
    assert before.count(".add_(1)") == 2 and before == after
    assert base.tolist() == [1, 1]


def test_a_counter_another_input_views_is_left_alone():
    """The first counter is also passed as a view, read after its increment: that increment stays, which leaves
    one to move, so nothing moves."""
    x, counters, keys = state()
    out, before, after = rewritten(lambda x, a, seen, b, keys: cache_layers(x, [a, b], keys) + seen, x,
                                   counters[0], counters[0].view(1), counters[1], keys[:2])
    assert before.count(".add_(1)") == 2 and before == after
    assert [int(c) for c in counters[:2]] == [1, 2] and out[0, 0] == x[0, 0] * 4 + 1


def test_float_values_are_left_alone():
    x, counters, keys = state()

    def layers(x, counters):
        for counter in counters:
            x = x + counter
            counter.add_(1)
        return x

    _, before, after = rewritten(layers, x, [c.float() for c in counters])
    assert before.count(".add_(1)") == 3 and before == after


def test_backend_option():
    assert any(p is batch_counter_increments for p in qcompile.backend().passes())
    assert not any(p is batch_counter_increments for p in qcompile.backend(batch_counters=False).passes())


def decode_with_and_without(kv: str, device: str, cudagraphs: bool = False):
    """A tiny Llama's decode step into a static (or FP8) cache, compiled by qcompile under inductor with and
    without the pass: (tokens, cache lengths, graph code after the passes) of four steps, each way."""
    import e2e_models as em

    from qcompile.kv_cache import FP8Cache

    model = em.build_bf16(em.model_config("llama", True, 3), device)

    def run(batch_counters: bool):
        torch._dynamo.reset()
        graphs = []
        be = qcompile.backend(batch_counters=batch_counters, cudagraphs=cudagraphs,
                              on_graph=lambda b, a: graphs.append(a))
        torch.manual_seed(1)
        dec = em.Decoder(model, lambda f: torch.compile(f, backend=be, fullgraph=True), device, 2, 5, 8)
        if kv == "fp8":
            dec.cache = FP8Cache(model, max_cache_len=5 + 8 + 8, scales="dynamic")
            dec.cache_kw = {next(iter(dec.cache_kw)): dec.cache}
            with torch.no_grad():
                model(input_ids=torch.randint(3, 300, (2, 5), device=device), **dec.cache_kw, use_cache=True,
                      cache_position=torch.arange(5, device=device))
        toks = []
        for _ in range(4):
            dec.run(1)
            toks.append(dec.tok.flatten().tolist())
        return toks, [int(layer.cumulative_length) for layer in dec.cache.layers], graphs[-1]

    return run(True), run(False)


@pytest.mark.parametrize("kv", ["static", "fp8"])
def test_llama_decode_step(kv):
    """One multi-tensor add in the graph in place of the three increments; the same tokens, the same counters."""
    (toks, lengths, graph), (toks_off, lengths_off, graph_off) = decode_with_and_without(kv, "cpu")
    assert graph.count("_foreach_add_(") == 1 and graph_off.count("_foreach_add_(") == 0
    assert "cumulative_length.add_" not in graph and graph_off.count("cumulative_length.add_(") == 3
    assert toks == toks_off and lengths == lengths_off == [9, 9, 9]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["static", "fp8"])
def test_gpu_llama_decode_step_in_cuda_graphs(kv):
    """The same on the GPU, the steps replayed from CUDA graphs: inductor's multi-tensor kernel bumps the
    counters (replayed four times), the tokens equal those without the pass."""
    (toks, lengths, graph), (toks_off, lengths_off, _) = decode_with_and_without(kv, "cuda", cudagraphs=True)
    assert graph.count("_foreach_add_(") == 1
    assert toks == toks_off and lengths == lengths_off == [9, 9, 9]
