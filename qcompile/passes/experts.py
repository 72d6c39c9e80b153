"""The Experts pass: lower each ``qcompile::experts_ref`` node (a QuantExperts layer) to the kernel the
registry selects among the ``"experts"`` kernels, and give it an explain row (module, scheme, op,
kernel, why faster kernels were passed over). Where the reference is the best that runs, the node stays.

With online quantization on, it first rewrites the experts of an unmodified bf16 / fp16 HF model
(:func:`rewrite_online_experts`): each transformers experts module's region of the graph, however
transformers computed it (``grouped_mm``, ``batched_mm``, its ``grouped_mm_fallback`` for fp16 / fp32,
Llama-4's dense ``bmm``), becomes one ``experts_ref`` call on the experts quantized into graph constants,
which is then lowered as above.
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..experts import ACTIVATIONS, ExpertsShape, dense_routing, is_experts
from ..formats import QuantConfig
from ..kernels.experts_ref import ROLES
from ..kernels.registry import KernelQuery, cuda_capability
from ..scheme import parse_scheme_key
from .linear import _warn_weight_only, _weight_only
from .lowering import ExplainRow, bind, example, lower_node, module_of, op_of, source_name

REFERENCE = "qcompile::experts_ref"
MODULE = "qcompile_module"  # node meta: the experts module an experts_ref node computes


def _static(n) -> int | None:
    return n if isinstance(n, int) else None


def experts_query(args: dict) -> KernelQuery:
    """The registry query of an experts_ref call: n, k of the fused gate + up [2I, H], E, top-k, tokens."""
    x, w13, index = example(args["hidden_states"]), example(args["w13_weight"]), example(args["top_k_index"])
    h = x.shape[-1]
    tokens = _static(x.numel() // h) if _static(x.numel()) is not None else None
    return KernelQuery(scheme=parse_scheme_key(args["scheme"]), device=x.device.type,
                       capability=cuda_capability(x.device), n=int(w13.shape[1]), k=int(h), act_dtype=x.dtype,
                       kind="experts", num_experts=int(w13.shape[0]), top_k=int(index.shape[-1]), tokens=tokens,
                       activation=args["activation"])


def lower_experts(gm: fx.GraphModule, example_inputs=None, kernels=None, online: QuantConfig | None = None
                  ) -> list[ExplainRow]:
    """Rewrite ``gm`` in place; one row per MoE layer."""
    rows = [] if online is None else rewrite_online_experts(gm, example_inputs, online)
    ref_op = op_of(REFERENCE)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (ref_op, ref_op.overloadpacket):
            args = bind(node, ref_op)
            module = node.meta.get(MODULE) or module_of(args["w13_weight"])
            query = experts_query(args)
            row, sel = lower_node(gm.graph, node, args, query, module, kernels, REFERENCE)
            if query.scheme.act is not None and _weight_only(sel.kernel.op):
                row.reason = "; ".join(filter(None, [row.reason, "activations not quantized (weight-only kernel)"]))
                _warn_weight_only(query, sel.kernel.name)
            rows.append(row)
    gm.graph.lint()
    gm.recompile()
    return rows


# -- online: the experts region of an HF model -------------------------------------------------------

def _matmuls() -> tuple:
    """The grouped / batched matmuls transformers' experts implementations call."""
    ops = [torch.bmm, torch.ops.aten.bmm.default]
    ops += [f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None]
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None and hasattr(fallback, "default"):
        ops += [fallback, fallback.default]
    return tuple(ops)


class NotRecognised(Exception):
    """An experts region the pass does not rewrite: the reason goes into its explain row."""


def rewrite_online_experts(gm: fx.GraphModule, example_inputs, online: QuantConfig) -> list[ExplainRow]:
    """Replace each HF experts module's region (the nodes traced inside its forward, found from its
    ``gate_up_proj`` / ``down_proj`` parameters) by one ``experts_ref`` on its quantized experts; one
    explain row for each region left as it is."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = dict(zip(placeholders, example_inputs))
    params = {source_name(n): n for n in placeholders}
    modules = [name.rpartition(".")[0] for name in params
               if name.endswith(".gate_up_proj") and f"{name.rpartition('.')[0]}.down_proj" in params]
    _warn_eager_experts()
    rows = []
    for index, module in enumerate(modules):
        try:
            _rewrite(gm, module, params, real, online, index)
        except NotRecognised as why:
            rows.append(ExplainRow(module, "bf16", "experts", "bf16", str(why)))
    gm.graph.lint()
    return rows


def _rewrite(gm: fx.GraphModule, module: str, params: dict, real: dict, online: QuantConfig, index: int) -> None:
    gate_up, down = params[f"{module}.gate_up_proj"], params[f"{module}.down_proj"]
    region, key = _region(gm, gate_up)
    inputs, output = _boundary(region)
    if not any(n.target in _matmuls() for n in region):
        raise NotRecognised("no grouped or batched matmul of the experts: not an implementation qcompile reads "
                            '(call model.set_experts_implementation("grouped_mm") before torch.compile)')
    lq = online.resolve(module, "moe")
    if lq is None:
        raise NotRecognised("excluded by the online config")
    hidden, top_k_index, top_k_weights = _routing_inputs(inputs, module)
    w13, w2 = real[gate_up], real[down]
    shape = _shape(region, key, w13, w2, example(hidden).shape[-1], top_k_index is None, params, module)
    from ..online_experts import canonical_bias, quantize_experts

    tensors = {}
    for group, t in (("w13", w13), ("w2", w2)):
        tensors[f"{group}_weight"], tensors[f"{group}_weight_scale"] = quantize_experts(
            t.detach(), shape, group, lq, module)
        bias = params.get(f"{module}.{'gate_up_proj' if group == 'w13' else 'down_proj'}_bias")
        if shape.has_bias:
            tensors[f"{group}_bias"] = canonical_bias(real[bias].detach(), shape, group).to(w13.dtype)
    _replace(gm, region, output, hidden, top_k_index, top_k_weights, tensors, shape, lq.scheme.key, module, index)


def _region(gm: fx.GraphModule, gate_up: fx.Node) -> tuple[list[fx.Node], str]:
    """The nodes traced inside the experts module's forward (by Dynamo's module stack), in graph order."""
    users = [u for u in gate_up.users if u.meta.get("nn_module_stack")]
    if not users:
        raise NotRecognised("the experts parameters are read outside a module forward")
    key = list(users[0].meta["nn_module_stack"])[-1]
    return [n for n in gm.graph.nodes if n.op.startswith("call_") and key in n.meta.get("nn_module_stack", {})], key


def _boundary(region: list[fx.Node]) -> tuple[list[fx.Node], fx.Node]:
    """(the nodes the region reads from outside it, the one node of it read outside it)."""
    inside = set(region)
    inputs = list(dict.fromkeys(i for n in region for i in n.all_input_nodes if i not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    if len(outputs) != 1:
        raise NotRecognised(f"the experts region has {len(outputs)} results, not one")
    return inputs, outputs[0]


def _routing_inputs(inputs: list[fx.Node], module: str) -> tuple[fx.Node, fx.Node | None, fx.Node | None]:
    """(hidden_states, top_k_index, top_k_weights) among the region's inputs; no routing for Llama-4's
    experts, whose rows are already every expert's inputs."""
    tensors = [n for n in inputs if isinstance(example(n), torch.Tensor) and not source_name(n).startswith(module)]
    index = [n for n in tensors if not example(n).is_floating_point()]
    floats = [n for n in tensors if example(n).is_floating_point()]
    if not index and len(floats) == 1:
        return floats[0], None, None
    weights = [n for n in floats if index and example(n).shape == example(index[0]).shape]
    hidden = [n for n in floats if n not in weights]
    if len(index) != 1 or len(weights) != 1 or len(hidden) != 1:
        raise NotRecognised("the experts forward does not take (hidden_states, top_k_index, top_k_weights)")
    return hidden[0], index[0], weights[0]


def _shape(region: list[fx.Node], key: str, w13: torch.Tensor, w2: torch.Tensor, h: int, dense: bool,
           params: dict, module: str) -> ExpertsShape:
    """The experts' layout, from the parameter shapes ([E, 2I, H] / [E, H, I], or both transposed), the
    region's ops (gate / up interleaved by a stride-2 slice) and its activation."""
    e = w13.shape[0]
    i = w13.numel() // (2 * e * h) if h else 0
    if tuple(w13.shape) == (e, 2 * i, h) and tuple(w2.shape) == (e, h, i):
        transposed = False
    elif tuple(w13.shape) == (e, h, 2 * i) and tuple(w2.shape) == (e, i, h):
        transposed = True
    else:
        raise NotRecognised(f"gate_up_proj {list(w13.shape)} and down_proj {list(w2.shape)} are not gated experts of "
                            f"hidden size {h}")
    interleaved = any(n.target is operator.getitem and isinstance(n.args[1], tuple)
                      and isinstance(n.args[1][-1], slice) and n.args[1][-1].step == 2 for n in region)
    has_bias = f"{module}.gate_up_proj_bias" in params and f"{module}.down_proj_bias" in params
    return ExpertsShape(e, h, i, transposed, interleaved, has_bias, _activation(region, key), dense)


def _activation(region: list[fx.Node], key: str) -> str:
    """experts_ref's name of the gated activation the region computes: its activation module's class
    (ACTIVATIONS), or gpt-oss's clamped swiglu (clamp, ``sigmoid(gate * alpha)``)."""
    nested = set()
    for n in region:
        stack = list(n.meta["nn_module_stack"].values())
        nested.update(v[1].__name__ for v in stack[list(n.meta["nn_module_stack"]).index(key) + 1:])
    unknown = sorted(c for c in nested if c not in ACTIVATIONS)
    if unknown:
        raise NotRecognised(f"the experts forward runs a {unknown[0]} module qcompile does not fold into its experts op")
    if nested:
        kind = ACTIVATIONS[nested.pop()]
        tanh = any(n.target in (F.gelu, torch.ops.aten.gelu.default) and n.kwargs.get("approximate") == "tanh"
                   for n in region)
        return "gelu_tanh" if kind == "gelu" and tanh else kind
    sigmoid = [n for n in region if n.target in (torch.sigmoid, torch.ops.aten.sigmoid.default)]
    scaled = sigmoid[0].args[0] if len(sigmoid) == 1 else None  # sigmoid(gate.clamp(max=limit) * alpha)
    alpha = [a for a in getattr(scaled, "args", ()) if isinstance(a, float)]
    gate = [a for a in getattr(scaled, "args", ()) if isinstance(a, fx.Node) and a.target == "clamp"]
    limit = gate[0].kwargs.get("max", gate[0].args[2] if len(gate[0].args) > 2 else None) if gate else None
    if len(alpha) == 1 and isinstance(limit, (int, float)):
        return f"swigluoai:{alpha[0]}:{float(limit)}"
    raise NotRecognised("the experts' activation is not one experts_ref computes")


def _replace(gm, region, output, hidden, top_k_index, top_k_weights, tensors, shape, scheme, module, index) -> None:
    from .linear import add_constant

    graph = gm.graph
    with graph.inserting_before(output):
        consts = {name: add_constant(gm, f"_qcompile_online_experts{index}_{name}", t) for name, t in tensors.items()}
        if top_k_index is None:  # Llama-4: every expert on its block of rows
            routing = graph.call_function(dense_routing, (hidden, shape.num_experts))
            top_k_index, top_k_weights = (graph.call_function(operator.getitem, (routing, i))
                                          for i in range(2))
            x = example(hidden)
            top_k_index.meta["example_value"] = x.new_empty((x.shape[0], 1), dtype=torch.long)
            top_k_weights.meta["example_value"] = x.new_empty((x.shape[0], 1))
        args = [hidden, top_k_index, top_k_weights]
        args += [consts.get(f"{group}_{role}") for group in ("w13", "w2") for role in ROLES]
        args += [consts.get("w13_bias"), consts.get("w2_bias"), shape.activation, scheme]
        new = graph.call_function(op_of(REFERENCE), tuple(args))
    new.meta.update(output.meta)
    new.meta[MODULE] = module
    output.replace_all_uses_with(new)
    for node in reversed(region):
        graph.erase_node(node)


_WARNED: set[type] = set()


def _warn_eager_experts() -> None:
    """Warn (once per class) when the frame Dynamo compiles is an experts module running transformers'
    eager implementation: its loop over experts breaks the graph, so its parameters never reach a graph
    this pass sees and the experts stay unquantized."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        frame = InstructionTranslator.current_tx().f_locals
    except Exception:  # noqa: BLE001 - not inside Dynamo (a graph handed over directly): nothing to check
        return
    for value in list(frame.values()):
        config = getattr(value, "config", None)
        if (isinstance(value, nn.Module) and is_experts(value) and type(value) not in _WARNED
                and getattr(config, "_experts_implementation", None) == "eager"):
            _WARNED.add(type(value))
            warnings.warn(f"qcompile: {type(value).__name__} runs transformers' eager experts implementation, a loop "
                          "over experts that torch.compile cannot trace as one graph: online quantization leaves these "
                          'experts unquantized. Call model.set_experts_implementation("grouped_mm") (or load with '
                          'experts_implementation="grouped_mm") before torch.compile', stacklevel=2)
