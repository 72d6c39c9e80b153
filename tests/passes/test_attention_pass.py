"""The decode-attention pass: graph before/after (expecttest), numerics against eager, what it leaves alone."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn

import qcompile
from qcompile import synth
from qcompile.kv_cache import cache_kwargs
from tests.passes.graph_util import renumbered

# fp32 on CPU: the grouped attention and the repeated one differ by summation order only: up to 3e-6 on the
# tiny Llama's logits (|logits| < 5) after 3 steps, 2e-7 on the hand-written attention
TOL = {"atol": 1e-5, "rtol": 0}


def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """transformers' repeat_kv: (b, kv_heads, S, d) -> (b, kv_heads * rep, S, d), head j reading j // rep."""
    b, kvh, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kvh, rep, s, d).reshape(b, kvh * rep, s, d)


class RepeatedAttention(nn.Module):
    """Grouped-query attention as transformers' SDPA attention writes it: repeat_kv, then SDPA with ``sdpa``."""

    def __init__(self, rep: int = 2, **sdpa):
        super().__init__()
        self.rep, self.sdpa = rep, sdpa

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, repeat_kv(k, self.rep), repeat_kv(v, self.rep), attn_mask=mask,
                                              **self.sdpa)


def qkv(b=2, heads=4, kv_heads=2, q_len=1, s=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, q_len, d, generator=g), torch.randn(b, kv_heads, s, d, generator=g),
            torch.randn(b, kv_heads, s, d, generator=g))


def compile_graph(fn, *args, **options):
    """(output, code before the passes, code after) of ``fn(*args)`` compiled by qcompile as one graph."""
    torch._dynamo.reset()  # a function of the same code compiled earlier would be reused silently
    graphs = []
    be = qcompile.backend(inner="eager", on_graph=lambda before, after: graphs.append((before, after)), **options)
    with torch.no_grad():
        out = torch.compile(fn, backend=be, fullgraph=True, dynamic=False)(*args)
    assert len(graphs) == 1, "one graph, compiled once"
    return (out, *graphs[0])


# -- reading the graphs -------------------------------------------------------------------------------------

def _statements(code: str) -> dict[str, str]:
    """{name: statement} of the assignments of ``code``, FX's trailing `;  a = b = None` clean-up dropped."""
    out = {}
    for line in code.splitlines():
        stmt = line.strip().split(";  ")[0]
        name, eq, _ = stmt.partition(" = ")
        if eq and name.isidentifier():
            out[name] = stmt
    return out


def _readable(lines: list[str]) -> list[str]:
    """``lines`` with Dynamo's names of the cache (l_kw_cache_layers_0_keys: the cache reached through ``kw``, under
    the keyword of the transformers version) as paths, and the other names :func:`renumbered`."""
    cache = r"\bl_kw_(?:cache|past_key_values)_layers_(\d+)_(keys|values)\b"
    return renumbered([re.sub(cache, r"cache.layers.\1.\2", x) for x in lines])


def graph_diff(before: str, after: str) -> str:
    """The statements the passes removed (-) and added (+): those defining a name only one side has. A statement
    that reads a replaced node keeps its name: see :func:`rewired`."""
    b, a = _statements(before), _statements(after)
    lines = [f"-{s}" for n, s in b.items() if n not in a] + [f"+{s}" for n, s in a.items() if n not in b]
    return "\n".join(_readable(lines))


def rewired(before: str, after: str) -> list[str]:
    """Names whose statement reads something else after the passes (the users of a replaced node)."""
    b, a = _statements(before), _statements(after)
    return [n for n in b if n in a and a[n] != b[n]]


def repeats(code: str) -> int:
    """How many repeat_kv expands (to 5 dimensions: b, kv_heads, rep, S, d) ``code`` has."""
    return len(re.findall(r"\.expand\(\w+, \w+, \w+, \w+, \w+\)", code))


def sdpa_calls(code: str) -> list[tuple[str, str, str]]:
    """(query, key, value) argument names of each attention call of ``code``: SDPA or qcompile::decode_attention."""
    return re.findall(r"(?:scaled_dot_product_attention|decode_attention\.default)\((\w+), (\w+), (\w+)", code)


def assert_rewritten(after: str, b: int, kv_heads: int, rep: int, d: int, kv=("l_k_", "l_v_")):
    """Every SDPA call of ``after`` reads the key / value placeholders ``kv`` themselves and a query grouped to
    (b, kv_heads, rep, d); nothing repeats heads any more."""
    statements, calls = _statements(after), sdpa_calls(after)
    assert calls and not repeats(after), after
    for q, k, v in calls:
        assert (k, v) == kv, after
        assert statements[q].endswith(f".reshape({b}, {kv_heads}, {rep}, {d})"), after


# -- a transformers Llama, decoding with a static cache -------------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    """llama(layers) -> a tiny fp32 Llama (4 query heads, 2 key / value heads, head_dim 16), SDPA attention."""
    models = {}

    def make(layers: int):
        if layers not in models:
            torch.manual_seed(0)
            config = synth.tiny_llama_config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                             head_dim=16, vocab_size=100, initializer_range=0.2)
            models[layers] = llama_model(config)
        return models[layers]

    return make


def llama_model(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def greedy_decode(model, ids: torch.Tensor, steps: int, options: dict | None, make_cache=None):
    """(logits of ``steps`` greedy decode steps after an eager prefill of ``ids``, graphs): each step compiled by
    ``qcompile.backend(**options)`` (fullgraph, static shapes), or eager where ``options`` is None. The cache:
    ``make_cache(max_cache_len)``, or transformers' StaticCache."""
    from transformers import StaticCache

    n = ids.shape[1]
    cache = (make_cache or (lambda length: StaticCache(config=model.config, max_cache_len=length)))(n + steps + 2)
    kw = cache_kwargs(model, cache)

    def step(tok, pos):
        return model(input_ids=tok, cache_position=pos, use_cache=True, **kw).logits

    graphs = []
    if options is not None:
        torch._dynamo.reset()
        be = qcompile.backend(inner="eager", on_graph=lambda before, after: graphs.append((before, after)), **options)
        step = torch.compile(step, backend=be, fullgraph=True, dynamic=False)
    with torch.no_grad():
        logits = model(input_ids=ids, cache_position=torch.arange(n), use_cache=True, **kw).logits
        out = []
        for i in range(steps):
            out.append(step(logits[:, -1:].argmax(-1), torch.tensor([n + i])))
            logits = out[-1]
    assert len(graphs) == (0 if options is None else 1), "one decode graph, no recompile"
    return torch.cat(out, 1), graphs


IDS = torch.tensor([[1, 17, 42, 99, 7], [3, 5, 8, 13, 21]])


def test_llama_decode_graph(llama):
    _, graphs = greedy_decode(llama(1), IDS[:1], 1, {})
    before, after = graphs[0]
    assert_expected_inline(graph_diff(before, after), """\
-getitem = cache.layers.0.keys[(slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None))]
-hidden_states = getitem.expand(1, 2, 2, 8, 16)
-key = hidden_states.reshape(1, 4, 8, 16)
-getitem_1 = cache.layers.0.values[(slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None))]
-hidden_states_1 = getitem_1.expand(1, 2, 2, 8, 16)
-value = hidden_states_1.reshape(1, 4, 8, 16)
-attn_output = torch._C._nn.scaled_dot_product_attention(q_embed, key, value, attn_mask = attention_mask, dropout_p = 0.0, scale = 0.25, is_causal = False)
+reshape = q_embed.reshape(1, 2, 2, 16)
+decode_attention_default = torch.ops.qcompile.decode_attention.default(reshape, cache.layers.0.keys, cache.layers.0.values, attention_mask, 0.25)
+reshape_1 = decode_attention_default.reshape(1, 4, 1, 16)""")
    # the attention output's one user (a reshape or a transpose, by transformers version) reads the new output
    assert len(rewired(before, after)) == 1


@pytest.mark.parametrize("batch", [1, 2])
def test_llama_greedy_decode_matches_eager(llama, batch):
    model, ids = llama(2), IDS[:batch]
    want, _ = greedy_decode(model, ids, 3, None)
    grouped, graphs = greedy_decode(model, ids, 3, {})
    repeated, graphs_off = greedy_decode(model, ids, 3, {"gqa_decode": False, "batch_counters": False})
    torch.testing.assert_close(grouped, want, **TOL)
    torch.testing.assert_close(repeated, want, **TOL)
    assert torch.equal(grouped.argmax(-1), want.argmax(-1))
    before, after = graphs[0]
    assert len(sdpa_calls(after)) == 2 and repeats(before) == 4 and not repeats(after)
    before, after = graphs_off[0]
    assert before == after


def test_llama_prefill_is_left_alone(llama):
    model = llama(1)
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=8)
    kw = cache_kwargs(model, cache)

    def prefill(ids, pos):
        return model(input_ids=ids, cache_position=pos, use_cache=True, **kw).logits

    with torch.no_grad():
        want = prefill(IDS[:1], torch.arange(5))
    cache.reset()
    out, before, after = compile_graph(prefill, IDS[:1], torch.arange(5))
    assert repeats(before) == 2 and before == after
    torch.testing.assert_close(out, want, **TOL)


def test_llama_multi_head_attention_is_left_alone():
    torch.manual_seed(0)
    config = synth.tiny_llama_config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, head_dim=16,
                                     vocab_size=100, num_key_value_heads=4)
    _, graphs = greedy_decode(llama_model(config), IDS[:1], 1, {})
    before, after = graphs[0]
    assert len(sdpa_calls(before)) == 1 and before == after


# -- repeat_kv + SDPA written by hand -----------------------------------------------------------------------

def _shared_mask(kind: str, b: int = 2, s: int = 6):
    """A (b, 1, 1, s) mask shared by all heads: None, boolean (some keys hidden) or additive float."""
    g = torch.Generator().manual_seed(1)
    if kind == "none":
        return None
    keep = torch.rand(b, 1, 1, s, generator=g) > 0.3
    keep[..., 0] = True  # every row sees one key at least
    if kind == "bool":
        return keep
    return torch.randn(b, 1, 1, s, generator=g).masked_fill(~keep, float("-inf"))


def test_hand_written_decode_graph():
    _, before, after = compile_graph(RepeatedAttention(), *qkv(), _shared_mask("bool"))
    assert_expected_inline(graph_diff(before, after), """\
-getitem = l_k_[(slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None))]
-expand = getitem.expand(2, 2, 2, 6, 8)
-reshape = expand.reshape(2, 4, 6, 8)
-getitem_1 = l_v_[(slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None))]
-expand_1 = getitem_1.expand(2, 2, 2, 6, 8)
-reshape_1 = expand_1.reshape(2, 4, 6, 8)
-scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention(l_q_, reshape, reshape_1, attn_mask = l_mask_)
+reshape_2 = l_q_.reshape(2, 2, 2, 8)
+decode_attention_default = torch.ops.qcompile.decode_attention.default(reshape_2, l_k_, l_v_, l_mask_, None)
+reshape_3 = decode_attention_default.reshape(2, 4, 1, 8)""")


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_shared_masks_and_scales_are_rewritten_exactly(mask, scale):
    q, k, v = qkv(heads=6, kv_heads=2, d=8)
    module = RepeatedAttention(rep=3, **({} if scale is None else {"scale": scale}))
    m = _shared_mask(mask)
    out, _, after = compile_graph(module, q, k, v, m)
    assert_rewritten(after, b=2, kv_heads=2, rep=3, d=8)
    assert re.search(rf"decode_attention\.default\(\w+, l_k_, l_v_, \w+, {scale}\)", after), after
    torch.testing.assert_close(out, module(q, k, v, m), **TOL)


def test_query_batch_broadcast_over_the_keys():
    """SDPA broadcasts a query of batch 1 over keys of batch 2; the rewrite keeps its output shape."""
    q, _, _ = qkv(b=1)
    _, k, v = qkv(b=2)
    module = RepeatedAttention()
    out, _, after = compile_graph(module, q, k, v)
    assert_rewritten(after, b=1, kv_heads=2, rep=2, d=8)
    assert out.shape == (2, 4, 1, 8)
    torch.testing.assert_close(out, module(q, k, v), **TOL)


def test_key_and_value_of_one_repeat():
    def attention(q, kv):
        kv = repeat_kv(kv, 2)
        return F.scaled_dot_product_attention(q, kv, kv)

    q, k, _ = qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no erase_node() of a node already erased
        out, _, after = compile_graph(attention, q, k)
    assert_rewritten(after, b=2, kv_heads=2, rep=2, d=8, kv=("l_kv_", "l_kv_"))
    torch.testing.assert_close(out, attention(q, k), **TOL)


LEFT_ALONE = {  # module, qkv() arguments, mask
    "mask-per-head": (RepeatedAttention(), {}, torch.randn(2, 4, 1, 6)),
    "dropout": (RepeatedAttention(dropout_p=0.5), {}, None),
    "is-causal": (RepeatedAttention(is_causal=True), {}, None),
    "as-many-kv-heads-as-query-heads": (RepeatedAttention(rep=1), {"kv_heads": 4}, None),
}


@pytest.mark.parametrize("case", LEFT_ALONE)
def test_left_alone(case):
    module, shapes, mask = LEFT_ALONE[case]
    _, before, after = compile_graph(module, *qkv(**shapes), mask)
    assert repeats(before) == 2 and before == after


def test_more_than_one_query_token_is_left_alone():
    q, k, v = qkv(q_len=3)
    _, before, after = compile_graph(RepeatedAttention(), q, k, v)
    assert repeats(before) == 2 and before == after


def test_dynamic_shapes_are_left_alone():
    module, graphs = RepeatedAttention(), []
    torch._dynamo.reset()
    be = qcompile.backend(inner="eager", on_graph=lambda before, after: graphs.append((before, after)))
    compiled = torch.compile(module, backend=be, fullgraph=True, dynamic=True)
    for s in (6, 7):
        q, k, v = qkv(s=s)
        torch.testing.assert_close(compiled(q, k, v), module(q, k, v), **TOL)
    assert len(graphs) == 1
    before, after = graphs[0]
    assert repeats(before) == 2 and before == after


def test_gqa_decode_off_leaves_the_graph():
    q, k, v = qkv()
    _, before, after = compile_graph(RepeatedAttention(), q, k, v, _shared_mask("bool"), gqa_decode=False)
    assert repeats(before) == 2 and before == after


def test_calls_that_need_a_gradient_keep_sdpa():
    """Where query, keys or values require a gradient the grouped call stays SDPA (its own backward)."""
    q, k, v = qkv()
    q.requires_grad_(True)
    module = RepeatedAttention()
    torch._dynamo.reset()
    graphs = []
    be = qcompile.backend(inner="eager", on_graph=lambda before, after: graphs.append((before, after)))
    out = torch.compile(module, backend=be, fullgraph=True, dynamic=False)(q, k, v, _shared_mask("bool"))
    out.sum().backward()
    after = graphs[0][1]
    assert "decode_attention" not in after and sdpa_calls(after) and not repeats(after), after
    want = q.detach().clone().requires_grad_(True)
    module(want, k, v, _shared_mask("bool")).sum().backward()
    torch.testing.assert_close(q.grad, want.grad, **TOL)


def test_fp8_cache_reads_its_codes(llama):
    """Over an FP8 cache the op takes the fp8 codes and the scales, the dequantized copy of the cache is gone,
    and the logits are the eager model's (dequantized read, repeat_kv, SDPA)."""
    from qcompile.kv_cache import FP8Cache

    model = llama(1)

    def fp8(length):
        return FP8Cache(model, max_cache_len=length, scales="dynamic")

    want, _ = greedy_decode(model, IDS[:1], 2, None, fp8)
    got, graphs = greedy_decode(model, IDS[:1], 2, {}, fp8)
    torch.testing.assert_close(got, want, **TOL)
    before, after = graphs[0]
    diff = graph_diff(before, after)
    layer = r"\w*(?:cache|past_key_values)_layers_0_"  # the cache argument's name: transformers 5.24 / 5.17
    codes = {kind: re.search(rf"(\w+) = {layer}{kind}_bytes\.view\(torch\.float8_e4m3fn\)", after).group(1)
             for kind in ("key", "value")}  # the fp8 views of the cache's byte buffers
    assert re.search(rf"decode_attention\.default\(\w+, {codes['key']}, {codes['value']}, \w+, 0\.25, "
                     rf"{layer}k_scale, {layer}v_scale\)", after), after
    dequantized = rf"\.mul_\({layer}[kv]_scale\)"
    assert len(re.findall(dequantized, before)) == 2 and not re.findall(dequantized, after), diff
    assert not re.search(rf"\b(?:{codes['key']}|{codes['value']})\.to\(", after), diff  # no dequantized copy


# -- attention with sinks (gpt-oss), written out in eager ops --------------------------------------------------

class SinkAttention(nn.Module):
    """gpt-oss's eager attention as transformers writes it: repeat_kv, scaled scores plus the mask, each head's sink
    logit as one more column, minus the row maximum, softmax, the sink's column dropped, dropout, P @ V. ``keep``
    (bool) becomes the additive mask ``torch.where(keep, 0, finfo.min)``, as transformers' eager masks are made."""

    def __init__(self, heads: int = 4, rep: int = 2, returns_weights: bool = False, dropout: float = 0.0):
        super().__init__()
        self.rep, self.returns_weights, self.dropout = rep, returns_weights, dropout
        self.sinks = nn.Parameter(torch.randn(heads, generator=torch.Generator().manual_seed(3)))

    def forward(self, q, k, v, keep=None, mask=None):
        k, v = repeat_kv(k, self.rep), repeat_kv(v, self.rep)
        w = torch.matmul(q, k.transpose(2, 3)) * 0.3
        if keep is not None:
            mask = torch.where(keep, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
        if mask is not None:
            w = w + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        combined = torch.cat([w, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
        weights = F.dropout(probs[..., :-1], p=self.dropout, training=self.training)
        out = torch.matmul(weights, v)
        return (out, weights) if self.returns_weights else out


def test_sink_attention_graph():
    module = SinkAttention()
    _, before, after = compile_graph(module, *qkv(), _shared_mask("bool"))
    assert_expected_inline(graph_diff(before, after), """\
-getitem = l_k_[(slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None))]
-expand = getitem.expand(2, 2, 2, 6, 8)
-k = expand.reshape(2, 4, 6, 8)
-getitem_1 = l_v_[(slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None))]
-expand_1 = getitem_1.expand(2, 2, 2, 6, 8)
-v = expand_1.reshape(2, 4, 6, 8)
-transpose = k.transpose(2, 3)
-matmul = torch.matmul(l_q_, transpose)
-w = matmul * 0.3
-zeros = torch.zeros((), dtype = torch.float32)
-mask = torch.where(l_keep_, zeros, -3.4028234663852886e+38)
-w_1 = w + mask
-reshape = l_self_parameters_sinks_.reshape(1, -1, 1, 1)
-sinks = reshape.expand(2, -1, 1, -1)
-combined = torch.cat([w_1, sinks], dim = -1)
-max = combined.max(dim = -1, keepdim = True)
-getitem_2 = max[0]
-combined_1 = combined - getitem_2
-probs = torch.nn.functional.softmax(combined_1, dim = -1, dtype = torch.float32)
-getitem_3 = probs[(Ellipsis, slice(None, -1, None))]
-weights = torch.nn.functional.dropout(getitem_3, p = 0.0, training = True)
-out = torch.matmul(weights, v)
+reshape_1 = l_q_.reshape(2, 2, 2, 8)
+reshape_2 = l_self_parameters_sinks_.reshape(4)
+decode_attention_default = torch.ops.qcompile.decode_attention.default(reshape_1, l_k_, l_v_, l_keep_, 0.3, None, None, reshape_2)
+reshape_3 = decode_attention_default.reshape(2, 4, 1, 8)""")


@pytest.mark.parametrize("mask", ["none", "keep", "float"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (4, 4)])
def test_sink_attention_is_rewritten_exactly(mask, heads, kv_heads):
    q, k, v = qkv(heads=heads, kv_heads=kv_heads)
    module = SinkAttention(heads, heads // kv_heads)
    args = (q, k, v, _shared_mask("bool") if mask == "keep" else None,
            _shared_mask("float") if mask == "float" else None)
    out, _, after = compile_graph(module, *args)
    assert_rewritten(after, b=2, kv_heads=kv_heads, rep=heads // kv_heads, d=8)
    assert "softmax" not in after and "where" not in after, after
    torch.testing.assert_close(out, module(*args), **TOL)


SINK_LEFT_ALONE = {  # module, qkv() arguments
    "weights-returned": (SinkAttention(returns_weights=True), {}),
    "three-query-tokens": (SinkAttention(), {"q_len": 3}),
}


@pytest.mark.parametrize("case", SINK_LEFT_ALONE)
def test_sink_attention_left_alone(case):
    module, shapes = SINK_LEFT_ALONE[case]
    _, before, after = compile_graph(module, *qkv(**shapes), _shared_mask("bool"))
    assert repeats(before) == 2 and before == after


def test_sink_attention_with_dropout_in_training_is_left_alone():
    module = SinkAttention(dropout=0.5).train()
    torch._dynamo.reset()
    graphs = []
    be = qcompile.backend(inner="eager", on_graph=lambda before, after: graphs.append((before, after)))
    with torch.no_grad():
        torch.compile(module, backend=be, fullgraph=True, dynamic=False)(*qkv(), _shared_mask("bool"))
    before, after = graphs[0]
    assert repeats(before) == 2 and before == after


@pytest.mark.parametrize("batch", [1, 2])
def test_gpt_oss_greedy_decode_matches_eager(batch):
    """A tiny transformers gpt-oss (a sliding-window layer and a full one, sinks; qcompile's static cache, which
    compiles one decode step): each layer's eager attention chain becomes one decode_attention call with the sinks,
    the logits are the eager model's."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    from qcompile.kv_cache import static_cache

    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          vocab_size=100, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 17, 42, 99, 7, 8, 9], [3, 5, 8, 13, 21, 34, 55]])[:batch]
    want, _ = greedy_decode(model, ids, 3, None, lambda n: static_cache(model, n))
    got, graphs = greedy_decode(model, ids, 3, {}, lambda n: static_cache(model, n))
    torch.testing.assert_close(got, want, **TOL)
    before, after = graphs[0]
    assert after.count("softmax(") == before.count("softmax(") - 2, after  # the routers' stay
    assert len(re.findall(r"decode_attention\.default\(\w+, \w+, \w+, \w+, 0\.25, None, None, \w+\)", after)) == 2
    assert not repeats(after), after
