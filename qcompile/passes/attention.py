"""The decode-attention pass: grouped-query attention of one query token reads each key / value head once.

transformers' SDPA attention, under torch.compile, expands the keys and values of a grouped-query layer to
every query head before ``scaled_dot_product_attention`` (``repeat_kv``: ``x[:, :, None].expand(b, kv_heads,
rep, S, d).reshape(b, kv_heads * rep, S, d)``); the compiled graph then writes ``rep`` copies of the whole
static cache and the attention kernel reads them back, every layer, every decode step. At decode (one query
token) this pass runs the same attention on the key / value heads themselves: the query's ``rep`` heads of a
group become that group's query rows,

    q (b, kv_heads * rep, 1, d) -> (b, kv_heads, rep, d);   sdpa(q, k, v, mask) -> (b, kv_heads, rep, d)
    -> (b, kv_heads * rep, 1, d)

which is exact (query head ``j`` reads key / value head ``j // rep`` either way; each query row is softmaxed on
its own). The grouped call is ``qcompile::decode_attention`` (``qcompile/kernels/attention.py``: on CUDA a
split-over-the-keys Triton kernel that skips the blocks the mask hides, SDPA elsewhere), or SDPA itself where
query, keys or values need a gradient. Where keys and values are an FP8 cache's dequantized read
(``codes.to(dtype).mul_(scale)``, ``qcompile/kv_cache.py``), the op takes the fp8 codes and the scales instead and
the dequantized copy of the cache is not made. It applies where the mask is absent or shared by all heads
(``(b, 1, 1, S)``, what transformers passes), dropout is 0 and ``is_causal`` is off; anything else is left as it
is. Prefill (more than one query token) is left to SDPA's own kernels. ``backend(gqa_decode=False)`` turns the
pass off.

gpt-oss's attention has a learned logit per query head, a sink, that the softmax spans beside the keys; transformers
writes it out in eager ops (no SDPA call): ``w = q @ repeat_kv(k).transpose(2, 3) * scaling (+ mask)``, ``cat([w,
sinks.reshape(1, -1, 1, 1).expand(...)], -1)``, minus its row maximum, ``softmax``, the sink's column dropped
(``[..., :-1]``), dropout (p = 0 or not training), a cast, ``@ repeat_kv(v)``. At one query token the pass replaces
that chain by one ``qcompile::decode_attention`` call with the sinks (the op's module doc), on the key / value heads
themselves. A mask written as ``torch.where(keep, 0, finfo.min)`` goes to the op as ``keep``: the keys it hides then
add nothing, as ``finfo.min`` added to a score makes them add nothing beside the sink, and the kernel skips blocks it
hides entirely (a sliding window's old keys). The chain is left alone where any of its values is used elsewhere
(attention weights returned), where a value needs a gradient, or where its shapes are not one query token's.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from ..kernels import attention  # noqa: F401  (registers qcompile::decode_attention)
from .lowering import example, finish_rewrites

decode_attention = torch.ops.qcompile.decode_attention.default

SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_FULL = slice(None)


def _repeated(node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the key / value heads, the nodes of the repeat) when ``node`` is ``repeat_kv`` of them."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("reshape", "view")):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    index = expand.args[0]
    if not (isinstance(index, fx.Node) and index.op == "call_function" and index.target is operator.getitem):
        return None
    src, idx = index.args
    if not (isinstance(src, fx.Node) and isinstance(idx, tuple) and len(idx) >= 3 and idx[2] is None
            and all(i == _FULL or i is Ellipsis for i in idx[:2] + idx[3:])):
        return None
    heads, out = example(src), example(node)
    if heads is None or out is None or heads.dim() != 4 or out.dim() != 4:
        return None
    if not all(isinstance(x, int) for x in (*heads.shape, *out.shape)):  # dynamic shapes: left alone
        return None
    b, kvh, s, d = heads.shape
    if (out.shape[0], out.shape[2], out.shape[3]) != (b, s, d) or out.shape[1] % kvh:
        return None
    return src, [node, expand, index]


def _fp8_dequantized(node, dtype) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(the fp8 codes, the scale, the dequantizing nodes) when ``node`` is the FP8 cache's read of a layer,
    ``codes.to(dtype).mul_(scale)`` (``qcompile.kv_cache.dequantize_kv``): float8_e4m3fn codes, an fp32 scale
    of shape (1, heads or 1, 1, 1)."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("mul_", "mul")
            and len(node.args) == 2 and not node.kwargs):
        return None
    cast, scale = node.args
    if not (isinstance(cast, fx.Node) and cast.op == "call_method" and cast.target == "to" and len(cast.args) == 2
            and not cast.kwargs and isinstance(scale, fx.Node) and len(cast.users) == 1):
        return None
    codes, s, out = example(cast.args[0]), example(scale), example(node)
    if codes is None or s is None or out is None or codes.dtype != torch.float8_e4m3fn or out.dtype != dtype:
        return None
    if s.dtype != torch.float32 or s.dim() != 4 or s.shape[0] != 1 or s.shape[2:] != (1, 1) \
            or s.shape[1] not in (1, codes.shape[1]):
        return None
    return cast.args[0], scale, [node, cast]


def _cache_read(k: fx.Node, v: fx.Node, dtype) -> tuple[tuple, list[fx.Node]]:
    """(keys, values, k_scale, v_scale) for decode_attention, and the nodes that read no longer needs: the FP8
    cache's codes and scales where both are its dequantized read (:func:`_fp8_dequantized`), else k and v."""
    fp8 = [_fp8_dequantized(x, dtype) for x in (k, v)]
    if all(fp8):
        return (fp8[0][0], fp8[1][0], fp8[0][1], fp8[1][1]), fp8[0][2] + fp8[1][2]
    return (k, v, None, None), []


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase each of ``nodes`` once nothing reads it (repeated until none goes: a node may read another of them;
    key and value may share one repeat; a mask may serve other layers, which keep it)."""
    pending, erased = list(dict.fromkeys(nodes)), set()
    while gone := [n for n in pending if n not in erased and not n.users]:
        for n in gone:
            graph.erase_node(n)
            erased.add(n)


def _fn(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _method(node, *names) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _last_dim(node: fx.Node, i: int, name: str) -> bool:
    """Whether the dim argument of ``node`` names the last of 4 dimensions."""
    return _arg(node, i, name) in (-1, 3)


def _sink_attention(node) -> tuple | None:
    """(q, the repeats of k and v (:func:`_repeated`), mask, scale, sinks, their expand to the scores' shape, the
    chain's nodes) when ``node`` is the last matmul of gpt-oss's eager attention (module doc), else None."""
    if not (_fn(node, torch.matmul) and len(node.args) == 2 and not node.kwargs):
        return None
    p, v = node.args[0], _repeated(node.args[1])
    chain = [node]
    if _method(p, "to"):
        chain.append(p)
        p = p.args[0]
    if _fn(p, F.dropout):
        if _arg(p, 1, "p", 0.5) != 0.0 and _arg(p, 2, "training", True) is not False:
            return None
        chain.append(p)
        p = p.args[0]
    if not (_fn(p, operator.getitem) and p.args[1] == (Ellipsis, slice(None, -1, None))):
        return None
    softmax = p.args[0]
    if not (_fn(softmax, F.softmax, torch.softmax) and _last_dim(softmax, 1, "dim")):
        return None
    chain += [p, softmax]
    combined = softmax.args[0]
    if _fn(combined, operator.sub):  # minus the row maximum: combined - combined.max(dim=-1, keepdim=True)[0]
        mx = combined.args[1]
        if not (_fn(mx, operator.getitem) and mx.args[1] == 0 and _method(mx.args[0], "max")
                and mx.args[0].args[0] is combined.args[0] and _last_dim(mx.args[0], 1, "dim")):
            return None
        chain += [combined, mx, mx.args[0]]
        combined = combined.args[0]
    if not (_fn(combined, torch.cat) and _last_dim(combined, 1, "dim") and len(combined.args[0]) == 2):
        return None
    w, expanded = combined.args[0]
    if not (_method(expanded, "expand") and _method(expanded.args[0], "reshape", "view")):
        return None
    chain += [combined, expanded, expanded.args[0]]
    sinks, mask = expanded.args[0].args[0], None
    if _fn(w, operator.add):
        chain.append(w)
        w, mask = w.args
    if not (_fn(w, operator.mul) and isinstance(w.args[1], (int, float)) and _fn(w.args[0], torch.matmul)):
        return None
    q, kt = w.args[0].args
    if not (_method(kt, "transpose") and tuple(kt.args[1:]) in ((2, 3), (3, 2), (-2, -1), (-1, -2))):
        return None
    k = _repeated(kt.args[0])
    if k is None or v is None:
        return None
    chain += [w, w.args[0], kt]
    inside = set(chain)
    if any(u not in inside for n in chain[1:] for u in n.users):  # a value of the chain is used elsewhere
        return None
    return q, k, v, mask, float(w.args[1]), sinks, expanded, chain


def _keep_mask(mask) -> fx.Node | None:
    """``keep`` where ``mask`` is ``torch.where(keep, 0, v)`` with v <= -1e38 (transformers' eager masks; the 0 a
    constant or a ``torch.zeros`` node), else None."""
    if not (_fn(mask, torch.where) and len(mask.args) == 3):
        return None
    keep, zero, low = mask.args
    k = example(keep)
    if k is None or k.dtype != torch.bool or not isinstance(low, (int, float)) or low > -1e38:
        return None
    if not (zero == 0 or (_fn(zero, torch.zeros) and not zero.kwargs.get("requires_grad", False))):
        return None
    return keep


def _rewrite_sink_attention(graph: fx.Graph) -> int:
    count = 0
    for node in list(graph.nodes):
        found = _sink_attention(node)
        if found is None:
            continue
        qn, k, v, mask, scale, sinks, expanded, chain = found
        q, out, s = example(qn), example(node), example(sinks)
        heads = [example(k[0]), example(v[0])]
        if any(t is None for t in (q, out, s, *heads)) or q.dim() != 4 or q.shape[2] != 1:
            continue
        b, h, _, d = q.shape
        kvh = heads[0].shape[1]
        if not all(isinstance(x, int) for x in (b, h, d, kvh, *out.shape, *heads[0].shape)):
            continue  # dynamic shapes: left alone
        spread = example(expanded)
        if heads[1].shape[1] != kvh or h % kvh or s.numel() != h or out.dtype != q.dtype \
                or spread is None or tuple(spread.shape[1:]) != (h, 1, 1):  # one sink per query head
            continue
        m = None if mask is None else example(mask)
        if mask is not None and (m is None or m.dim() != 4 or m.shape[1:3] != (1, 1)):
            continue
        if any(getattr(t, "requires_grad", True) for t in (q, *heads)):  # (sinks: a parameter, under no_grad too)
            continue
        keep = None if mask is None else _keep_mask(mask)
        kv, reads = _cache_read(k[0], v[0], q.dtype)
        with graph.inserting_before(node):
            grouped = graph.call_method("reshape", (qn, b, kvh, h // kvh, d))
            flat = graph.call_method("reshape", (sinks, h))
            call = graph.call_function(decode_attention, (grouped, kv[0], kv[1], mask if keep is None else keep, scale,
                                                          kv[2], kv[3], flat))
            back = graph.call_method("reshape", (call, *out.shape))
        node.replace_all_uses_with(back)
        dead = chain + k[1] + v[1] + reads
        if keep is not None:  # the float mask and its zero, once no other layer reads them
            dead += [mask] + [a for a in mask.args[1:2] if isinstance(a, fx.Node)]
        _erase_unused(graph, dead)
        count += 1
    return count


def rewrite_gqa_decode(gm: fx.GraphModule, example_inputs=None) -> list:
    """Rewrite every one-token grouped-query SDPA call of ``gm`` in place (see the module doc). Returns no
    explain rows (the table lists quantized layers); logs each rewrite."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA:
            continue
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        args = dict(zip(names, node.args), **node.kwargs)
        if args.get("dropout_p", 0.0) != 0.0 or args.get("is_causal", False) or args.get("enable_gqa", False):
            continue
        k, v, q = _repeated(args["key"]), _repeated(args["value"]), example(args["query"])
        if k is None or v is None or q is None or q.dim() != 4 or q.shape[2] != 1:
            continue
        b, h, _, d = q.shape
        kvh = example(k[0]).shape[1]
        shape = tuple(example(node).shape)  # the batch broadcast of query, key / value and mask
        if not all(isinstance(x, int) for x in (b, h, d, kvh, *shape)):  # dynamic shapes: left alone
            continue
        if example(v[0]).shape[1] != kvh or h % kvh or h == kvh:
            continue
        mask = args.get("attn_mask")
        if mask is not None:
            m = example(mask)
            if m is None or m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != 1:
                continue
        grad = any(getattr(example(x), "requires_grad", True) for x in (args["query"], k[0], v[0]))
        kv, reads = ((k[0], v[0], None, None), []) if grad else _cache_read(k[0], v[0], q.dtype)
        with graph.inserting_before(node):
            grouped = graph.call_method("reshape", (args["query"], b, kvh, h // kvh, d))
            if grad:  # SDPA's own backward
                kwargs = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False}
                if args.get("scale") is not None:
                    kwargs["scale"] = args["scale"]
                out = graph.call_function(node.target, (grouped, k[0], v[0]), kwargs)
            else:  # an FP8 cache's codes and scales where it reads one: the kernel dequantizes in registers
                scales = kv[2:] if reads else ()
                out = graph.call_function(decode_attention, (grouped, kv[0], kv[1], mask, args.get("scale"), *scales))
            back = graph.call_method("reshape", (out, *shape))
        node.replace_all_uses_with(back)
        _erase_unused(graph, [node] + k[1] + v[1] + reads)
        count += 1
    count += _rewrite_sink_attention(graph)
    return finish_rewrites(gm, count, "one-token grouped-query attention call(s) read their key / value heads once")
