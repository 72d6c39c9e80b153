"""The top-k pass: selection steps equal torch.topk (ties, NaN, -inf, dtypes), the graph rewrite (expecttest),
what it leaves alone, and the backend running it under inductor only."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

import qcompile
from qcompile.passes.topk import MAX_E, MAX_K, rewrite_small_topk, topk_by_selection


def check_topk(x: torch.Tensor, k: int):
    """Equal to torch.topk: the same values in the same (descending) order, and indices that hold them,
    distinct per row; on ties the lowest indices first."""
    vals, ids = topk_by_selection(x, k)
    want, _ = torch.topk(x, k, dim=-1)
    torch.testing.assert_close(vals, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(x.gather(-1, ids), vals, rtol=0, atol=0, equal_nan=True)
    assert ids.dtype == torch.int64 and (ids.sort(-1).values.diff(dim=-1) > 0).all(), "distinct indices"
    return vals, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, k", [((1, 128), 8), ((5, 8), 2), ((3, 2, 32), 4), ((7, 256), 16), ((4, 6), 6)])
def test_selection_equals_topk(dtype, shape, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(shape, generator=g).to(dtype)
    check_topk(x, k)
    check_topk(x.softmax(-1), k)


def test_ties_take_the_lowest_index_first():
    x = torch.tensor([[0.5, 1.0, 0.5, 1.0, 0.2, 0.5]])
    vals, ids = check_topk(x, 4)
    assert ids.tolist() == [[1, 3, 0, 2]] and vals.tolist() == [[1.0, 1.0, 0.5, 0.5]]


def test_nan_and_infinities():
    """NaN ranks above every number (as topk ranks it); rows of -inf still give k distinct indices."""
    x = torch.tensor([[0.1, float("nan"), float("inf"), -1.0, float("-inf")],
                      [float("-inf")] * 5,
                      [float("nan"), 2.0, float("nan"), float("-inf"), 3.0]])
    vals, ids = check_topk(x, 4)
    assert ids.tolist() == [[1, 2, 0, 3], [0, 1, 2, 3], [0, 2, 4, 1]]
    # NaN above +inf wherever it stands
    assert check_topk(torch.tensor([[float("inf"), float("nan"), 0.0]]), 2)[1].tolist() == [[1, 0]]


def test_zeros_of_either_sign_tie():
    """-0.0 and +0.0 are equal values: their lowest indices first, as any other tie."""
    x = torch.tensor([[-0.0, 0.0, -1.0, -0.0, 0.0]])
    vals, ids = check_topk(x, 4)
    assert ids.tolist() == [[0, 1, 3, 4]]


def test_random_mixes_of_nan_and_infinities():
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, 1.0, -1.0, -0.0, 3e-45, -3e-45])
    for _ in range(200):
        x = specials[torch.randint(0, len(specials), (3, 7), generator=g)]
        for k in (1, 3, 7):
            check_topk(x, k)


def test_gradients_equal_topk():
    x = torch.randn(3, 16, requires_grad=True)
    w = torch.randn(3, 4)
    (topk_by_selection(x, 4)[0] * w).sum().backward()
    got, x.grad = x.grad, None
    (torch.topk(x, 4)[0] * w).sum().backward()
    torch.testing.assert_close(got, x.grad, rtol=0, atol=0)


# -- the graph rewrite --------------------------------------------------------------------------------------

def router(x, w):
    """A Qwen3-MoE / Mixtral router: linear, softmax, top-k, renormalized."""
    probs = torch.nn.functional.linear(x, w).softmax(-1, dtype=torch.float)
    top, ids = torch.topk(probs, 2, dim=-1)
    return top / top.sum(-1, keepdim=True), ids


def method_topk(x):
    return x.topk(3)[1] + x.topk(2, dim=-1, sorted=False)[1].sum()


def rewritten(fn, *args, dynamic=False, devices=("cpu",), rewrite=rewrite_small_topk):
    """(output, graph code before the pass, after) of ``fn(*args)`` compiled as one Dynamo graph, the pass
    ``rewrite`` (default: the top-k pass) rewriting on ``devices``, the graph run as it is (no inner compiler)."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        before = gm.code
        rewrite(gm, example_inputs, devices=devices)
        graphs.append((before, gm.code))
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    assert len(graphs) == 1
    return (out, *graphs[0])


def assert_left_alone(fn, x, call: str, rewrite=rewritten, **kwargs) -> None:
    """The graph of ``fn(x)`` holds ``call``, and ``rewrite`` (a :func:`rewritten`) leaves it unchanged."""
    _, before, after = rewrite(fn, x, **kwargs)
    assert call in before and before == after


def body(code: str) -> str:
    return "\n".join(line.strip() for line in code.strip().splitlines()[1:] if line.strip())


def test_router_graph():
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    out, before, after = rewritten(router, x, w)
    assert_expected_inline(body(after), """\
l_x_ = L_x_
l_w_ = L_w_
linear = torch._C._nn.linear(l_x_, l_w_);  l_x_ = l_w_ = None
probs = linear.softmax(-1, dtype = torch.float32);  linear = None
topk_by_selection = qcompile_passes_topk_topk_by_selection(probs, 2);  probs = None
top = topk_by_selection[0]
ids = topk_by_selection[1];  topk_by_selection = None
sum_1 = top.sum(-1, keepdim = True)
truediv = top / sum_1;  top = sum_1 = None
return (truediv, ids)""")
    for got, want in zip(out, router(x, w)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_method_calls_are_rewritten():
    x = torch.randn(4, 10)
    out, before, after = rewritten(method_topk, x)
    assert before.count(".topk(") == 2 and "topk(" not in after.replace("topk_by_selection(", "")
    torch.testing.assert_close(out, method_topk(x))


LEFT_ALONE = {
    "smallest": (lambda x: torch.topk(x, 2, largest=False), torch.randn(3, 8)),
    "not-the-last-dim": (lambda x: torch.topk(x, 2, dim=0), torch.randn(3, 8)),
    "integers": (lambda x: torch.topk(x, 2), torch.arange(24).reshape(3, 8)),
    "k-too-large": (lambda x: torch.topk(x, MAX_K + 1), torch.randn(2, 64)),
    "row-too-long": (lambda x: torch.topk(x, 2), torch.randn(2, MAX_E + 1)),
    "smallest-method": (lambda x: x.topk(2, largest=False), torch.randn(3, 8)),
    "out": (lambda x: torch.topk(x, 2, out=(torch.empty(3, 2), torch.empty(3, 2, dtype=torch.long))),
            torch.randn(3, 8)),
}


@pytest.mark.parametrize("case", LEFT_ALONE)
def test_left_alone(case):
    assert_left_alone(*LEFT_ALONE[case], "topk")


def test_dynamic_row_length_is_left_alone():
    assert_left_alone(lambda x: torch.topk(x, 2), torch.randn(3, 8), "torch.topk", dynamic=True)


def test_dynamic_token_count_is_rewritten():
    """A router over a dynamic number of tokens and a static number of experts is rewritten."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        rewrite_small_topk(gm, example_inputs, devices=("cpu",))
        graphs.append(gm.code)
        return gm.forward

    fn = torch.compile(lambda x: torch.topk(x, 2), backend=backend, fullgraph=True)
    x = torch.randn(6, 8)
    torch._dynamo.mark_dynamic(x, 0)
    for t in (6, 9, 1):
        y = x if t == 6 else torch.randn(t, 8)
        for got, want in zip(fn(y), torch.topk(y, 2)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # one graph for T = 6 and 9 (dynamo compiles T = 1 on its own: it specializes sizes 0 and 1)
    assert len(graphs) == 4 and "SymInt" in graphs[0]
    assert all("torch.topk" in before and "topk_by_selection" in after
               for before, after in zip(graphs[::2], graphs[1::2]))


def test_backend_runs_the_pass_under_inductor_only():
    assert any(p is rewrite_small_topk for p in qcompile.backend(inner="inductor").passes())
    assert not any(p is rewrite_small_topk for p in qcompile.backend(inner="inductor", small_topk=False).passes())
    assert not any(p is rewrite_small_topk for p in qcompile.backend(inner="aot_eager").passes())


def test_cpu_graphs_are_left_alone_by_default():
    """By default the pass rewrites CUDA graphs only (where the fused kernel was measured faster than ATen's)."""
    _, before, after = rewritten(router, torch.randn(5, 16), torch.randn(8, 16), devices=("cuda",))
    assert "torch.topk" in before and after == before


# inductor's softmax (its own exp) and ATen's round apart by a few fp32 ulps
GPU_TOL = {"rtol": 2e-6, "atol": 0}


@pytest.mark.gpu
@pytest.mark.parametrize("e, k", [(8, 2), (128, 8), (256, 16)])
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_gpu_inductor_kernel_equals_topk(e, k, tokens):
    """Compiled by qcompile under inductor on the GPU (rewritten, fused): the values of ATen's top-k, and
    indices that hold them; a CUDA graph of the compiled call replays on new logits."""
    from tests.gpu_util import graph_replay

    graphs = []
    be = qcompile.backend(inner="inductor", on_graph=lambda before, after: graphs.append(after))
    torch._dynamo.reset()
    fn = torch.compile(lambda x: router_probs(x, k), backend=be, fullgraph=True, dynamic=False)
    x = torch.randn(tokens, e, device="cuda", dtype=torch.bfloat16)
    x[0, :4] = x[0, 4]  # ties
    values, ids = fn(x)
    assert "topk_by_selection" in graphs[0] and "topk(" not in graphs[0].replace("topk_by_selection(", "")
    want, _ = router_probs(x, k)
    torch.testing.assert_close(values, want, **GPU_TOL)
    torch.testing.assert_close(x.softmax(-1, dtype=torch.float).gather(-1, ids), want, **GPU_TOL)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()
    fresh = torch.randn_like(x)
    (values, ids), graph = graph_replay(lambda: fn(x), lambda: x.copy_(fresh))
    torch.testing.assert_close(values, router_probs(fresh, k)[0], **GPU_TOL)


def router_probs(x, k):
    return torch.topk(x.softmax(-1, dtype=torch.float), k, dim=-1)


# -- transformers' routers, as the installed transformers writes them ----------------------------------------

def _router(arch: str):
    """(router module of a tiny ``arch`` config with random weights, top-k calls in its forward)."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as dsv3
    import transformers.models.gpt_oss.modeling_gpt_oss as oss
    import transformers.models.mixtral.modeling_mixtral as mixtral
    import transformers.models.olmoe.modeling_olmoe as olmoe
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen3
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    tiny = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    router, config, calls = {
        "qwen3_moe": (qwen3.Qwen3MoeTopKRouter, Qwen3MoeConfig(num_experts=16, num_experts_per_tok=4,
                                                              norm_topk_prob=True, **tiny), 1),
        "mixtral": (mixtral.MixtralTopKRouter, MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **tiny), 1),
        "olmoe": (olmoe.OlmoeTopKRouter, OlmoeConfig(num_experts=16, num_experts_per_tok=4, **tiny), 1),
        "gpt_oss": (oss.GptOssTopKRouter, GptOssConfig(num_local_experts=8, num_experts_per_tok=4, **tiny), 1),
        "deepseek_v3": (dsv3.DeepseekV3TopkRouter, DeepseekV3Config(n_routed_experts=16, num_experts_per_tok=4,
                                                                    n_group=4, topk_group=2, **tiny), 3),
    }[arch]
    torch.manual_seed(0)
    module = router(config)
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            p.normal_()
    return module, calls


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"])
def test_transformers_routers_are_rewritten_exactly(arch):
    module, calls = _router(arch)
    x = torch.randn(7, 32)
    with torch.no_grad():
        out, before, after = rewritten(module, x)
        want = module(x)
    assert after.count("topk_by_selection(") == calls, before
    assert "topk(" not in after.replace("topk_by_selection(", "")
    (logits, weights, ids), (want_logits, want_weights, want_ids) = out, want
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    # DeepSeek-V3 asks for sorted=False: the same experts and weights in any order, the weights normalized by a
    # sum taken in that order (1 fp32 ulp apart)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    torch.testing.assert_close(ids.gather(-1, order), want_ids.gather(-1, want_order), rtol=0, atol=0)
    torch.testing.assert_close(weights.gather(-1, order), want_weights.gather(-1, want_order), rtol=2.5e-7, atol=0)


def inductor_router(arch: str, rewrite, check) -> tuple:
    """((logits, weights, ids) of ``arch``'s router compiled by inductor's CPU code generation after ``rewrite``
    (a pass on the CPU), the eager router's); ``check(code)`` asserts on the rewritten graph."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        rewrite(gm, example_inputs, devices=("cpu",))
        check(gm.code)
        return compile_fx(gm, example_inputs)

    module, _ = _router(arch)
    x = torch.randn(5, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(module, backend=backend, fullgraph=True)(x), module(x)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_inductor_lowers_the_selection_steps(arch):
    """Inductor (here its CPU code generation) compiles the rewritten routers and returns eager's experts."""
    def check(code):
        assert "topk_by_selection" in code

    (logits, weights, ids), (want_logits, want_weights, want_ids) = inductor_router(arch, rewrite_small_topk, check)
    torch.testing.assert_close(logits, want_logits, rtol=1e-6, atol=1e-6)  # inductor's own linear / sigmoid
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    torch.testing.assert_close(weights.gather(-1, order), want_weights.gather(-1, want_order), rtol=1e-6, atol=0)
