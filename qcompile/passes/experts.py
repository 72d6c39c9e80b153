"""The Experts pass: lower each ``qcompile::experts_ref`` node (a QuantExperts layer) to the kernel the
registry selects among the ``"experts"`` kernels, and give it an explain row (module, scheme, op,
kernel, why faster kernels were passed over). Where the reference is the best that runs, the node stays.
"""

from __future__ import annotations

from torch import fx

from ..kernels.registry import KernelQuery, cuda_capability
from ..scheme import parse_scheme_key
from .lowering import ExplainRow, bind, example, lower_node, module_of, op_of

REFERENCE = "qcompile::experts_ref"


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


def lower_experts(gm: fx.GraphModule, example_inputs=None, kernels=None) -> list[ExplainRow]:
    """Rewrite ``gm`` in place; one row per MoE layer."""
    rows = []
    ref_op = op_of(REFERENCE)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (ref_op, ref_op.overloadpacket):
            args = bind(node, ref_op)
            row, _ = lower_node(gm.graph, node, args, experts_query(args), module_of(args["w13_weight"]), kernels,
                                REFERENCE)
            rows.append(row)
    gm.graph.lint()
    gm.recompile()
    return rows
