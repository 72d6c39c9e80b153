"""The Fuse pass: quantized linears that read the same input run as one matmul.

A decoder layer's q / k / v projections read the same normed hidden states, and so do its gate / up
projections. This pass, which runs before the Linear pass, finds every group of ``qcompile::linear_ref``
calls on the same input node (and, with online quantization, of ``F.linear`` calls on bf16 parameters)
with the same scheme, and replaces the group by one ``linear_ref`` on tensors concatenated along N once,
here, into graph constants, followed by a split of its output. The Linear pass then lowers the fused call
like any other, and the explain table names it after its shards: ``model.layers.0.self_attn.{q,k,v}_proj``.

How the shards' tensors become one (the reference's fused-shard loading, ``QKVParallelLinear`` /
``MergedColumnParallelLinear``):

======================  ===========================================================================
weight codes            concatenated along N (a weight tiled for ``wo_mma`` too: its tiles are 16
                        rows, so the concatenation of tiled shards is the tiled concatenation)
per-tensor scales       equal: kept; different: every shard requantized to the largest (FP8 / INT8
                        codes; other codes keep the shards separate)
channel / group /       concatenated along N (block scales: when every shard's N is a multiple of
block scales, zero pts  the block)
global weight scales    must be equal (NVFP4), else the shards stay separate: the reference takes the
                        largest and warns of lost accuracy; running the shards apart loses none
static input scales     the largest (FP8 ``input_scale``, NVFP4 ``input_global_scale``)
act-order ``g_idx``     must be equal, else the shards stay separate
bias                    concatenated; zeros for a shard without one when another has one
online (bf16) weights   concatenated, then quantized once by the online scheme
======================  ===========================================================================

Shards of different schemes stay separate, as do shards a ``{module glob: kernel}`` override tells apart.
Experts (``qcompile::experts_ref``) and routers (never quantized) are not linears here.

Memory: the model and the compiled graph hold the fused layers' tensors once. A fused tensor that is the
shards' tensors one after another (weight codes, channel / group / block scales, zero points, biases when
every shard has one) becomes the shards' storage: each shard's tensor is made its rows of it, in place, and
its own storage freed, so the eager model, ``state_dict`` and ``save_pretrained`` (which writes each shard's
tensors, as before) read the same bytes the fused matmul does. Requantized per-tensor shards take the
requantized codes and the largest scale: once compiled, the eager model runs them as the compiled one
does (as the reference keeps only the fused layer), and ``save_pretrained`` writes them so. The shards'
placeholders, which nothing in the graph reads any more, are removed before the inner compiler runs
(:func:`drop_shared_inputs`). A shard tensor that another call in the graph reads too keeps its own
storage (the fused constant is then a copy). Compiling again finds the shards back to back and fuses them
as a view, without a copy. Scalars (the largest input scale) and online shards' FP8 (from bf16 weights)
are new. ``backend(fuse=False)`` turns the pass off.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from ..formats import QuantConfig
from ..kernels import quant_math
from ..kernels.registry import _override_for
from ..scheme import Granularity, LayerQuant, Packing, QDtype, parse_scheme_key
from .linear import ADDMM_TARGETS, LINEAR_TARGETS, REFERENCE, add_constant, online_linear, quantize_online
from .lowering import ExplainRow, bind, module_of, op_of

log = logging.getLogger("qcompile")

_UNKNOWN = object()  # an argument whose value is not known at compile time
SHARED = "qcompile_shared"  # placeholder meta: its tensor is now a view of a fused constant (_share)


@dataclass
class Shard:
    """One linear of a group: its call node, input node, module, scheme key, canonical tensors by role
    (``weight``, ``weight_scale``, ...; an online shard: only its bf16 ``weight``), bias, and the call's
    argument nodes by role (``bias`` too)."""

    node: fx.Node
    x: fx.Node
    module: str
    scheme: str
    tensors: dict[str, torch.Tensor | None]
    bias: torch.Tensor | None
    online: LayerQuant | None = None
    args: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.tensors["weight"].shape[0]


def _roles() -> list[str]:
    """The tensor arguments of ``linear_ref`` other than x and bias, in order."""
    return [a.name for a in op_of(REFERENCE)._schema.arguments if a.name not in ("x", "bias", "scheme")]


def fuse_linears(gm: fx.GraphModule, example_inputs, kernels=None, online: QuantConfig | None = None
                 ) -> list[ExplainRow]:
    """Rewrite ``gm`` in place. The fused calls get their explain rows from the Linear pass: none here."""
    real = {n: t for n, t in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs)}
    groups: dict[tuple, list[Shard]] = {}
    for node in list(gm.graph.nodes):
        shard = _shard(gm, node, real, online)
        if shard is not None:
            groups.setdefault((shard.x, shard.scheme, shard.online is not None), []).append(shard)
    fused = extra = 0
    for shards in groups.values():
        if len(shards) < 2:
            continue
        why = _why_separate(shards, kernels)
        if why:
            log.info("qcompile: %s stay separate: %s", fused_name([s.module for s in shards]), why)
            continue
        extra += _fuse(gm, shards, fused)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
        log.info("qcompile: fused %d groups of linears (%.1f MiB of fused constants beside the model's tensors)",
                 fused, extra / 2**20)
    return []


def _shard(gm: fx.GraphModule, node: fx.Node, real: dict, online: QuantConfig | None) -> Shard | None:
    if node.op != "call_function":
        return None
    ref = op_of(REFERENCE)
    if node.target in (ref, ref.overloadpacket):
        args = bind(node, ref)
        tensors = {role: _value(gm, args.get(role), real) for role in _roles()}
        bias = _value(gm, args.get("bias"), real)
        if _UNKNOWN in (*tensors.values(), bias) or not isinstance(args["x"], fx.Node):
            return None
        return Shard(node, args["x"], module_of(args["weight"]), args["scheme"], tensors, bias, args=args)
    if online is not None and node.target in LINEAR_TARGETS + ADDMM_TARGETS:
        lin = online_linear(node, online, real, rows=[])  # the Linear pass reports what stays bf16
        bias = _value(gm, lin.bias, real) if lin is not None else _UNKNOWN
        if lin is None or bias is _UNKNOWN or not isinstance(lin.x, fx.Node):
            return None
        return Shard(node, lin.x, lin.module, lin.lq.scheme.key, {"weight": lin.weight}, bias, lin.lq)
    return None


def _value(gm: fx.GraphModule, arg, real: dict):
    """The tensor behind a call argument: None, a parameter / buffer placeholder, or a graph attribute."""
    if arg is None:
        return None
    if isinstance(arg, fx.Node) and arg.op == "placeholder" and isinstance(real.get(arg), torch.Tensor):
        return real[arg]
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        return functools.reduce(getattr, arg.target.split("."), gm)
    return _UNKNOWN


def _why_separate(shards: list[Shard], kernels) -> str | None:
    """Why the group cannot run as one matmul, or None."""
    if isinstance(kernels, dict):
        name = fused_name([s.module for s in shards])
        if {_override_for(kernels, m, "linear") for m in [name] + [s.module for s in shards]} != \
                {_override_for(kernels, name, "linear")}:
            return "the kernel override names some of them only"
    if shards[0].online is not None:
        return None
    w = parse_scheme_key(shards[0].scheme).weight
    for role in shards[0].tensors:
        present = {s.tensors[role] is not None for s in shards}
        if len(present) > 1:
            return f"{role} is missing from some of them"
    if len({s.tensors["weight"].shape[1:] for s in shards}) > 1:
        return "their weights differ in width"
    per_tensor = w.scale.granularity is Granularity.TENSOR
    if per_tensor and not _all_equal(shards, "weight_scale") and not _requantizable(w):
        return f"their per-tensor scales differ and {w.dtype.value} codes cannot be requantized"
    if w.scale.granularity is Granularity.BLOCK and any(s.n % w.scale.block[0] for s in shards):
        return f"an out_features is not a multiple of the {w.scale.block[0]}-row scale block"
    if per_tensor and not _all_equal(shards, "weight_zero_point"):
        return "their per-tensor zero points differ"
    if not _all_equal(shards, "weight_global_scale"):
        return "their global weight scales differ (running them as one would lose accuracy)"
    if not _all_equal(shards, "weight_g_idx"):
        return "their act-order g_idx differ"
    return None


def _requantizable(w) -> bool:
    return w.packing is Packing.NONE and w.dtype in (QDtype.FP8_E4M3, QDtype.INT8) and not w.zero_point


def _all_equal(shards: list[Shard], role: str) -> bool:
    first = shards[0].tensors.get(role)
    return first is None or all(torch.equal(s.tensors[role], first) for s in shards[1:])


def _merge(shards: list[Shard]) -> tuple[dict[str, torch.Tensor | None], set[str]]:
    """The fused canonical tensors by role (module docstring), and the roles whose fused tensor is the
    shards' tensors one after another along dim 0 (their storage, :func:`_share`)."""
    if shards[0].online is not None:
        q, s = quantize_online(torch.cat([s.tensors["weight"] for s in shards]), shards[0].online)
        return {"weight": q, "weight_scale": s}, set()
    w = parse_scheme_key(shards[0].scheme).weight
    per_tensor = w.scale.granularity is Granularity.TENSOR
    joined = {"weight"}
    out = {role: shards[0].tensors[role] for role in shards[0].tensors}  # per-tensor, equal: the first's
    if per_tensor and not _all_equal(shards, "weight_scale"):
        out["weight"], out["weight_scale"] = quant_math.requantize_to_max_scale(
            [s.tensors["weight"] for s in shards], [s.tensors["weight_scale"] for s in shards])
        log.info("qcompile: %s requantized to their largest per-tensor scale", fused_name([s.module for s in shards]))
    else:
        out["weight"] = _concat([s.tensors["weight"] for s in shards])
        if not per_tensor:
            joined.add("weight_scale")
    if out.get("weight_zero_point") is not None and not per_tensor:
        joined.add("weight_zero_point")
    for role in joined - {"weight"}:
        out[role] = _concat([s.tensors[role] for s in shards])
    for role in ("input_scale", "input_global_scale"):
        if out.get(role) is not None:
            out[role] = torch.stack([s.tensors[role].float().reshape(()) for s in shards]).amax()
    return out, joined


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``; a view, and no copy, when the parts already lie back to back in one storage (the
    shards of a group fused before, compiled again)."""
    first, offset = parts[0], parts[0].storage_offset()
    for part in parts:
        if not (part.is_contiguous() and part.dtype == first.dtype and part.shape[1:] == first.shape[1:]
                and part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and part.storage_offset() == offset):
            return torch.cat(parts)
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def _bias(shards: list[Shard]) -> tuple[torch.Tensor | None, bool]:
    """The fused bias, and whether it is the shards' biases joined (every shard has one, of one dtype)."""
    given = [s.bias for s in shards if s.bias is not None]
    if not given:
        return None, False
    if len(given) == len(shards) and len({b.dtype for b in given}) == 1:
        return _concat(given), True
    return torch.cat([s.bias.to(given[0].dtype) if s.bias is not None else given[0].new_zeros(s.n)
                      for s in shards]), False


def _share(shards: list[Shard], fused: dict[str, torch.Tensor | None], joined: set[str]) -> int:
    """Make each shard's tensor of the ``joined`` roles its rows of the fused tensor, in place (``.data``), so
    that the model and the graph hold one copy of the fused layers' tensors and the shards' own storage is
    freed. A requantized weight (per-tensor scales that differed) gives the shards its codes, so they take
    its scale too. Only tensors that reach the graph as placeholders nothing reads any more: the backend
    drops those placeholders before the inner compiler fakes the inputs (:func:`drop_shared_inputs`), which
    would find a tensor's layout changed since Dynamo traced it. Returns the bytes shared."""
    shared = 0
    for role in joined:
        nodes = [s.args.get(role) for s in shards]
        if not all(isinstance(n, fx.Node) and n.op == "placeholder" and not n.users for n in nodes):
            continue  # read elsewhere too: the shards keep their own
        start = 0
        for shard, node in zip(shards, nodes):
            own = shard.bias if role == "bias" else shard.tensors[role]
            own.data = fused[role][start:start + own.shape[0]]
            start += own.shape[0]
            node.meta[SHARED] = True
        shared += fused[role].numel() * fused[role].element_size()
        if role == "weight" and "weight_scale" not in joined and fused.get("weight_scale") is not None:
            # one per-tensor scale: the fused weight's
            for shard in shards:
                shard.tensors["weight_scale"].copy_(fused["weight_scale"])
    return shared


def drop_shared_inputs(gm: fx.GraphModule, example_inputs: list) -> tuple[list, list[int] | None]:
    """After the passes: remove from ``gm`` the placeholders whose tensors :func:`_share` made views of a
    fused constant. Returns the example inputs left, and the positions of those kept among
    ``example_inputs`` (None when none was removed)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    drop = {i for i, n in enumerate(placeholders) if n.meta.get(SHARED) and not n.users}
    if not drop:
        return example_inputs, None
    for i in drop:
        gm.graph.erase_node(placeholders[i])
    gm.recompile()
    keep = [i for i in range(len(placeholders)) if i not in drop]
    return [example_inputs[i] for i in keep], keep


def _fuse(gm: fx.GraphModule, shards: list[Shard], index: int) -> int:
    """Replace ``shards`` by one ``linear_ref`` on fused constants and a split; returns the bytes of the
    constants that are not the shards' tensors (:func:`_share`)."""
    with torch.no_grad():
        tensors, joined = _merge(shards)
        tensors["bias"], bias_joined = _bias(shards)
        joined |= {"bias"} if bias_joined else set()
    graph, first, name = gm.graph, shards[0].node, fused_name([s.module for s in shards])
    with graph.inserting_before(first):
        consts = {role: add_constant(gm, f"_qcompile_fused{index}_{role}", t.contiguous()) if t is not None else None
                  for role, t in tensors.items()}
        consts["weight"].meta["qcompile_source"] = f"{name}.weight"
        args = (shards[0].x, *[consts.get(role) for role in _roles()], consts["bias"],
                shards[0].online.scheme.key if shards[0].online else shards[0].scheme)
        fused = graph.call_function(op_of(REFERENCE), args)
        _set_example(fused, first, sum(s.n for s in shards))
        split = graph.call_function(torch.ops.aten.split_with_sizes.default, (fused, [s.n for s in shards], -1))
        for i, shard in enumerate(shards):
            piece = graph.call_function(operator.getitem, (split, i))
            out = graph.call_method("contiguous", (piece,))  # the model may view it as if it were its own
            for node in (piece, out):
                node.meta.update(shard.node.meta)
            shard.node.replace_all_uses_with(out)
    for shard in shards:  # after the inserts: they go before the first of them
        graph.erase_node(shard.node)
    with torch.no_grad():
        shared = _share(shards, tensors, joined)
    log.info("qcompile: %s -> one linear, N = %s", name, "+".join(str(s.n) for s in shards))
    return sum(t.numel() * t.element_size() for t in tensors.values() if t is not None) - shared


def _set_example(node: fx.Node, like: fx.Node, n: int) -> None:
    """``node``'s example value: ``like``'s with the last dimension ``n``."""
    node.meta.update(like.meta)
    for key in ("example_value", "val"):
        v = like.meta.get(key)
        if isinstance(v, torch.Tensor):
            node.meta[key] = v.new_empty((*v.shape[:-1], n))


def fused_name(modules: list[str]) -> str:
    """``model.layers.0.self_attn.{q,k,v}_proj`` for the shards ``...q_proj``, ``...k_proj``, ``...v_proj``:
    the shared prefix (up to a dot) and suffix around the parts that differ."""
    if len(set(modules)) == 1:
        return modules[0]
    first = modules[0]
    start = 0
    while all(len(m) > start and m[start] == first[start] for m in modules):
        start += 1
    start = first.rfind(".", 0, start) + 1
    end = 0
    while all(len(m) - start > end and m[-1 - end] == first[-1 - end] for m in modules):
        end += 1
    parts = [m[start:len(m) - end] for m in modules]
    return f"{first[:start]}{{{','.join(parts)}}}{first[len(first) - end:]}"


def shard_names(name: str) -> list[str]:
    """The inverse of :func:`fused_name`: an explain row's module as the modules it runs."""
    head, brace, rest = name.partition("{")
    if not brace:
        return [name]
    parts, _, tail = rest.partition("}")
    return [f"{head}{p}{tail}" for p in parts.split(",")]
