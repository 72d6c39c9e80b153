"""The Linear pass: lower quantized linears in the graph Dynamo hands the backend.

Two patterns, one replacement:

* ``qcompile::linear_ref(x, weight, <scales>, bias, scheme)`` — what a loaded quantized model's
  ``QuantLinear`` puts in the graph. Lowered to the kernel op the registry selects (left as is when
  the reference is the best that runs).
* ``F.linear(x, weight, bias)`` with a bf16/fp16 parameter weight, when online quantization is on and
  the layer is not ignored (routers never are quantized): the weight is quantized once, here, into
  graph constants, then lowered the same way.

The pass does not know which producer wrote the checkpoint: it reads the scheme key the op carries.
Every matched layer gets an :class:`ExplainRow` (module, scheme, op, kernel, why not faster).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import fx

from ..formats import QuantConfig
from ..kernels import quant_math
from ..kernels.registry import KernelQuery, cuda_capability
from ..modules import is_router
from ..scheme import Granularity, LayerQuant, parse_scheme_key
from .lowering import ExplainRow, bind, example, lower_node, module_of, op_of, source_name  # noqa: F401

LINEAR_TARGETS = (torch._C._nn.linear, F.linear, torch.ops.aten.linear.default)
ADDMM_TARGETS = (torch.addmm, torch.ops.aten.addmm.default)  # transformers' Conv1D: addmm(bias, x, W [in, out])
REFERENCE = "qcompile::linear_ref"


def _query(scheme_key: str, x, weight_shape, compiler: str) -> KernelQuery:
    scheme = parse_scheme_key(scheme_key)
    n, k = weight_shape[0], x.shape[-1]
    return KernelQuery(scheme=scheme, device=x.device.type, capability=cuda_capability(x.device),
                       n=int(n), k=int(k), act_dtype=x.dtype, compiler=compiler)


def _weight_only(op_name: str) -> bool:
    """A kernel op without activation-scale arguments (``input_scale``, ``w13_input_scale``, ...) runs the
    matmul on unquantized activations, unless its kernels quantize them themselves (``Kernel.quantizes_acts``)."""
    from ..kernels.registry import kernels

    return not any(a.name.endswith(("input_scale", "input_global_scale")) for a in op_of(op_name)._schema.arguments) \
        and not any(k.op == op_name and k.quantizes_acts for k in kernels())


_WARNED: set[str] = set()


def _warn_weight_only(query: KernelQuery, kernel: str) -> None:
    """W4A4 / MX-activation schemes on GPUs without their GEMM run weight-only, as vLLM does on
    sm_90: say so once per scheme."""
    if query.scheme.key in _WARNED:
        return
    _WARNED.add(query.scheme.key)
    cap = f"sm_{query.capability[0]}{query.capability[1]}" if query.capability else query.device
    warnings.warn(f"qcompile: {query.scheme.key} runs weight-only on {cap} ({kernel}): activations are not "
                  "quantized, as vLLM does there. For faithful activation quantization compile with "
                  "kernels='reference' (the eager model is always faithful).", stacklevel=2)


def lower_linears(gm: fx.GraphModule, example_inputs, kernels=None, online: QuantConfig | None = None,
                  compiler: str = "inductor") -> list[ExplainRow]:
    """Rewrite ``gm`` in place; return one row per matched layer. ``compiler``: the compiler the graph goes to
    next (kernels that only pay off under inductor need it)."""
    rows: list[ExplainRow] = []
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    real = {n: t for n, t in zip(placeholders, example_inputs)}
    ref_op = op_of(REFERENCE)
    n_online = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (ref_op, ref_op.overloadpacket):
            args = bind(node, ref_op)
            x, w = example(args["x"]), example(args["weight"])
            module = module_of(args["weight"])
        elif online is not None and node.target in LINEAR_TARGETS + ADDMM_TARGETS:
            args = _online_args(gm, node, online, real, rows, n_online)
            if args is None:
                continue
            n_online += 1
            x, w = example(args["x"]), args.pop("_weight_shape")
            module = args.pop("_module")
        else:
            continue
        query = _query(args["scheme"], x, w.shape if hasattr(w, "shape") else w, compiler)
        row, sel = lower_node(graph, node, args, query, module, kernels, REFERENCE)
        if query.scheme.act is not None and _weight_only(sel.kernel.op):
            row.reason = "; ".join(filter(None, [row.reason, "activations not quantized (weight-only kernel)"]))
            _warn_weight_only(query, sel.kernel.name)
        rows.append(row)
    graph.lint()
    gm.recompile()
    return rows


class OnlineLinear(NamedTuple):
    """An ``F.linear`` / Conv1D ``addmm`` node the online config quantizes: its input node, its weight as
    [out, in] (a Conv1D's transposed), its bias node (or None), its module and resolved LayerQuant."""

    x: fx.Node
    weight: torch.Tensor
    bias: fx.Node | None
    module: str
    lq: LayerQuant


def online_linear(node: fx.Node, online: QuantConfig, real: dict, rows: list) -> OnlineLinear | None:
    """For an ``F.linear`` (or a Conv1D's ``addmm(bias, x, W)``, W stored [in, out]) on a parameter that
    online quantization covers: what quantizing it needs; else None (with an explain row when the layer
    was considered)."""
    conv1d = node.target in ADDMM_TARGETS
    if conv1d:
        if len(node.args) != 3 or node.kwargs:  # beta / alpha: not a Conv1D
            return None
        bias, x_node, w_node = node.args
    else:
        x_node, w_node = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if not isinstance(w_node, fx.Node) or w_node.op != "placeholder" or w_node not in real:
        return None
    weight = real[w_node].t() if conv1d else real[w_node]
    module = module_of(w_node)
    if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    if is_router(module):
        rows.append(ExplainRow(module, "bf16", "aten::linear", "bf16", "router: kept in high precision"))
        return None
    shared = [u for u in w_node.users if u.target not in LINEAR_TARGETS + ADDMM_TARGETS]
    if shared:  # e.g. lm_head tied to the embedding: the same tensor also feeds an embedding lookup
        rows.append(ExplainRow(module, "bf16", "aten::linear", "bf16",
                               f"weight shared with {getattr(shared[0].target, '__name__', shared[0].target)} (tied); "
                               "kept in high precision"))
        return None
    lq = online.resolve(module, "linear")
    if lq is None:
        rows.append(ExplainRow(module, "bf16", "aten::linear", "bf16", "excluded by the online config"))
        return None
    n, k = weight.shape
    block = online_block(lq)
    if n % 16 or k % 16 or (block and (n % block or k % block)):
        rows.append(ExplainRow(module, lq.scheme.key, "aten::linear", "bf16",
                               f"[{n}, {k}] does not divide into {max(block, 16)}-element tiles"))
        return None
    return OnlineLinear(x_node, weight, bias, module, lq)


def online_block(lq: LayerQuant) -> int:
    """The online scheme's weight block size (0 unless per block)."""
    spec = lq.scheme.weight.scale
    return spec.block[0] if spec.granularity is Granularity.BLOCK else 0


def quantize_online(weight: torch.Tensor, lq: LayerQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 [N, K] weight quantized by the online scheme: (codes, fp32 scale)."""
    with torch.no_grad():
        q, s = quant_math.quantize_weight_fp8(weight.detach().contiguous(), lq.scheme.weight.scale.granularity,
                                              online_block(lq) or 128)
    return q, s.float()


def _online_args(gm, node: fx.Node, online: QuantConfig, real: dict, rows: list, index: int) -> dict | None:
    """The canonical op arguments of an online-quantized linear (:func:`online_linear`), its weight
    quantized once, here, into graph constants; None when the layer stays as it is."""
    lin = online_linear(node, online, real, rows)
    if lin is None:
        return None
    q, s = quantize_online(lin.weight, lin.lq)
    with gm.graph.inserting_before(node):
        wq = add_constant(gm, f"_qcompile_online_w{index}", q)
        ws = add_constant(gm, f"_qcompile_online_s{index}", s)
    return {"x": lin.x, "weight": wq, "weight_scale": ws, "bias": lin.bias, "scheme": lin.lq.scheme.key,
            "_weight_shape": tuple(lin.weight.shape), "_module": lin.module}


def add_constant(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> fx.Node:
    """A tensor the pass made (a quantized weight, its scale) as a buffer of ``gm`` and a ``get_attr``
    node at the graph's insertion point.

    AOTAutograd (inductor, aot_eager) lifts every parameter and buffer of a Dynamo graph into a graph
    input and looks up the Dynamo source each came from in ``gm._param_name_to_source``, asserting
    that it is there (``_try_get_metadata_from_dynamo``); the sources give the inputs' static indices
    (their addresses are fixed, as CUDA graphs need) and guard duplicated inputs. A buffer Dynamo did
    not install has none, so it gets a ``ConstantSource``: what Dynamo gives a graph attribute that no
    user object holds, and never guards. ``_param_name_to_source`` is Dynamo's own dict; the graph
    gets a copy with the name added."""
    from torch._dynamo.source import ConstantSource

    gm.register_buffer(name, tensor)
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        gm._param_name_to_source = {**sources, name: ConstantSource(source_name=name)}
    node = gm.graph.get_attr(name)
    node.meta["example_value"] = node.meta["val"] = tensor
    return node
