"""``QuantExperts``: the module that replaces a transformers experts module whose checkpoint is quantized.

transformers 5 holds a MoE layer's experts fused: ``gate_up_proj`` [E, 2I, H] (gate rows then up rows;
gpt-oss: [E, H, 2I] with gate and up interleaved) and ``down_proj`` [E, H, I] ([E, I, H]). Every producer
saves them per expert, ``experts.<e>.{gate,up,down}_proj.*`` (Mixtral ``experts.<e>.w1 / w3 / w2``); gpt-oss's
own checkpoints fused per HF parameter, ``experts.gate_up_proj_blocks`` [E, 2I, ...] in the module's row order
(``QuantConfig.fused_experts``). A QuantExperts keeps the quantized tensors stacked over experts in canonical
form (on-disk dtypes: fp8 stays fp8, packed stays packed), the gate and up projection fused as ``w13_*`` and
the down projection as ``w2_*`` (the layout of :mod:`qcompile.kernels.experts_ref`):

=====================  =====================================================================
weight codes           ``w13_weight`` [E, 2I, K'] (gate rows, then up rows), ``w2_weight`` [E, H, I']
per-tensor scales      [E]: gate and up merged to their max, the other shard requantized (as vLLM;
                       saved so: both shards with the max)
channel / group /      [E, N] / [E, N, K/g] / [E, N/bn, K/bk]: gate's and up's concatenated
block scales
global weight scales   [E] (NVFP4): gate's; a different up one is warned about and not used (as vLLM).
                       W4A8 (fp32 channel scales): the larger; the other shard's channel scales take
                       the ratio (as vLLM)
static input scales    0-d fp32: the max over experts and shards (as vLLM)
act-order g_idx        [E, K]; gate and up must agree
=====================  =====================================================================

Life cycle (driven by :mod:`qcompile.loading`), as :class:`~qcompile.linear.QuantLinear`'s:

1. :meth:`QuantExperts.plan`: each expert's projections are planned from the safetensors headers by
   :meth:`QuantLinear.plan` itself (presence, dtype, shape of every tensor, errors naming the expert and
   tensor), as :class:`ExpertSlot` holders under the per-expert names transformers loads
   (``experts.<e>.gate_proj.weight``); transformers' own gate/up merge is switched off for these modules.
   Fused on disk (:meth:`QuantExperts._plan_fused`): the fused tensors are checked and declared on the module
   itself, and the slots are planned from the same tensors cut per expert and shard.
2. transformers sets each tensor on its slot; the slot hands it over at once
   (:meth:`QuantExperts.receive`): converted by the slot's ``_to_canonical``, copied into its place
   in the stacked tensor (allocated unfilled: it takes memory as it fills) and its file pages released,
   so a load holds the stacked part plus the checkpoint pages not yet stacked, never a second copy of a
   layer (tests/test_moe_memory.py: the peak stays within 1.1x the loaded weights). A fused tensor
   (:meth:`QuantExperts._receive_fused`) is handed to the slots expert by expert, gate and up rows
   de-interleaved (a permutation of rows: the bytes are kept), each expert's pages released once taken.
3. :meth:`QuantExperts.finalize`: every expected tensor arrived; per-shard scalars merged as above.
4. :meth:`QuantExperts.disk_tensors` (``save_pretrained``): the per-expert checkpoint tensors back (bit-equal
   to the checkpoint's, but for experts whose gate and up were requantized to one scale), or the fused ones.
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn

from .errors import CheckpointError, UnsupportedError
from .kernels import experts_ref  # noqa: F401  (registers the op)
from .kernels.experts_ref import ROLES, expert_slice
from .linear import FLOATS, QuantLinear, _param, allowed_dtypes, release_memory
from .kernels import quant_math
from .scheme import (Granularity, LayerQuant, QuantScheme, ScaleDtype, canonical_shape, disk_shape,
                     parse_scheme_key, shape_matches)

log = logging.getLogger("qcompile")

# On-disk projection names of one expert: (gate, up, down).
NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
SHARDS = (("w13", 0), ("w13", 1), ("w2", 0))  # (fused group, shard) of gate, up, down
# transformers' activation modules -> experts_ref activation names
ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu", "GELUTanh": "gelu_tanh",
               "PytorchGELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh", "GELU": "gelu"}


# -- the HF experts module --------------------------------------------------------------------------

def is_experts(module: nn.Module) -> bool:
    """A transformers fused-experts module: 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    params = module._parameters
    return all(isinstance(params.get(p), nn.Parameter) and params[p].dim() == 3 for p in ("gate_up_proj", "down_proj"))


@dataclass(frozen=True)
class ExpertsShape:
    """An HF experts module's dimensions and layout. ``transposed``: gate_up_proj is [E, H, 2I] and
    down_proj [E, I, H] (gpt-oss); ``interleaved``: gate and up alternate along 2I (gpt-oss)."""

    num_experts: int
    hidden: int
    intermediate: int
    transposed: bool
    interleaved: bool
    has_bias: bool
    activation: str
    dense: bool = False  # forward(hidden_states) alone: every expert on its block of rows (Llama-4)

    @classmethod
    def of(cls, module: nn.Module, name: str) -> "ExpertsShape":
        gate_up, down = module.gate_up_proj, module.down_proj
        transposed = bool(getattr(module, "is_transposed", gate_up.shape[2] == down.shape[1] * 2
                                  and gate_up.shape[1] == down.shape[2] and gate_up.shape[2] != down.shape[1]))
        e, h, two_i = (gate_up.shape[0], gate_up.shape[1], gate_up.shape[2]) if transposed else \
            (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1])
        want_down = (e, two_i // 2, h) if transposed else (e, h, two_i // 2)
        if two_i % 2 or tuple(down.shape) != want_down:
            raise UnsupportedError(f"experts module with gate_up_proj {list(gate_up.shape)} and down_proj "
                                   f"{list(down.shape)}: not a gated [E, 2I, H] / [E, H, I] pair", where=name,
                                   fix="only gated experts (gate and up fused) are supported")
        interleaved = not getattr(module, "is_concatenated", True)
        has_bias = isinstance(getattr(module, "gate_up_proj_bias", None), nn.Parameter)
        dense = len(inspect.signature(type(module).forward).parameters) == 2  # (self, hidden_states)
        return cls(e, h, two_i // 2, transposed, interleaved, has_bias, _activation(module, name), dense)


def _activation(module: nn.Module, name: str) -> str:
    if hasattr(module, "alpha") and hasattr(module, "limit"):  # gpt-oss's clamped swiglu (_apply_gate)
        return f"swigluoai:{float(module.alpha)}:{float(module.limit)}"
    act = getattr(module, "act_fn", None)
    kind = ACTIVATIONS.get(type(act).__name__)
    if kind == "gelu" and getattr(act, "approximate", "none") == "tanh":
        kind = "gelu_tanh"
    if kind is None:
        raise UnsupportedError(f"experts activation {type(act).__name__} is not supported", where=name,
                               fix=f"quantized experts run {sorted(set(ACTIVATIONS.values()))} gated activations")
    return kind


# -- the per-expert holders -------------------------------------------------------------------------

class ExpertSlot(QuantLinear):
    """One projection of one expert while loading: planned and converted by QuantLinear's own code; a
    tensor transformers sets on it goes straight to its QuantExperts (:meth:`QuantExperts.receive`)."""

    owner = None  # the QuantExperts (a plain attribute: not a submodule)
    expert, group, shard = 0, "w13", 0

    def __setattr__(self, name, value):
        owner = self.__dict__.get("owner")
        if owner is not None and isinstance(value, torch.Tensor) and value.device.type != "meta":
            owner.receive(self, name, value.data)
            return
        super().__setattr__(name, value)


def _meta_linear(n: int, k: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(k, n, bias=bias, device="meta", dtype=dtype)


# -- the module -------------------------------------------------------------------------------------

class QuantExperts(nn.Module):
    def __init__(self, name: str, lq: LayerQuant, shape: ExpertsShape, disk_prefix: str, naming: tuple[str, ...],
                 dtype: torch.dtype):
        super().__init__()
        self.name, self.lq, self.shape, self.disk_prefix, self.naming = name, lq, shape, disk_prefix, naming
        self.scheme_key = lq.scheme.key
        self.activation = shape.activation
        self.dtype = dtype
        self.num_experts, self.hidden_dim, self.intermediate_dim = shape.num_experts, shape.hidden, shape.intermediate
        self.finalized = False
        self.block_split = 1  # row blocks of the block scales cut in this many (_split_partial_row_blocks)
        self.requantized: list[int] = []  # experts whose gate / up shard was requantized to a shared scale
        self.__dict__["slots"] = []  # every ExpertSlot, kept after loading for saving
        self.__dict__["per_shard"] = {}  # (group, role) -> [E, shards, ...] scalars / g_idx as loaded
        self.__dict__["stored_scales"] = {}  # (expert, shard) -> w13 channel scales as loaded, where rescaled
        self.__dict__["stack"] = {}  # (group, role) -> the stacked tensor being filled
        self.__dict__["received"] = set()
        self.__dict__["hf_template"] = None  # the replaced HF module (meta), for dequantize_model
        self.__dict__["fused"] = {}  # fused checkpoint tensor -> (HF parameter, name, dtype, shape, shape read as)
        self.w13_bias = self.w2_bias = None

    # -- 1. plan ---------------------------------------------------------------------------------
    @classmethod
    def plan(cls, module: nn.Module, name: str, lq: LayerQuant, header: dict, disk_prefix: str,
             naming: tuple[str, ...] = NAMINGS[0], fused: bool = False) -> "QuantExperts":
        """``fused``: the checkpoint stores the experts fused per HF parameter (:meth:`_plan_fused`), else per
        expert under ``<disk_prefix>.<e>.<naming>``."""
        shape = ExpertsShape.of(module, name)
        dtype = module.gate_up_proj.dtype if module.gate_up_proj.dtype in FLOATS else torch.bfloat16
        mod = cls(name, lq, shape, disk_prefix, naming, dtype)
        mod.__dict__["hf_template"] = module
        if fused:
            header = mod._plan_fused(header)
        else:
            _check_expert_count(header, disk_prefix, shape.num_experts, naming)
            if shape.interleaved or shape.transposed:
                raise UnsupportedError("per-expert checkpoint tensors for an experts module whose gate and up are "
                                       "interleaved (gpt-oss layout) are not supported", where=name,
                                       fix="store the experts fused (gate_up_proj) or use a gate-then-up model")
        dims = ((shape.intermediate, shape.hidden),) * 2 + ((shape.hidden, shape.intermediate),)
        for e in range(shape.num_experts):
            holder = nn.Module()
            for leaf, (n, k), (group, shard) in zip(naming, dims, SHARDS):
                linear = _meta_linear(n, k, f"{disk_prefix}.{e}.{leaf}.bias" in header, dtype)
                slot = ExpertSlot.plan(linear, f"{disk_prefix}.{e}.{leaf}", lq, header)
                slot.expert, slot.group, slot.shard = e, group, shard
                slot.__dict__["owner"] = mod
                holder.register_module(leaf, slot)
                mod.slots.append(slot)
            if not fused:  # fused: transformers sets the fused tensors on this module itself
                mod.register_module(str(e), holder)
        mod._check_uniform_dtypes()
        return mod

    def _plan_fused(self, header: dict) -> dict:
        """Experts stored fused (``QuantConfig.fused_experts``): ``<prefix>.<gate_up_proj|down_proj>_<name>``
        [E, ...] for each tensor of the scheme and the bias, in the HF module's row order (gpt-oss: gate and up
        interleaved), not transposed. Checks each (presence, dtype, shape: errors name the tensor), declares it
        on this module on the meta device, where transformers loads it (:meth:`_receive_fused`), and returns the
        header the per-expert slots are planned from: those tensors cut per expert and shard, as
        :meth:`_receive_fused` hands them to the slots."""
        s, lq, scheme = self.shape, self.lq, self.lq.scheme
        per_expert = {}
        for param, (n, k), leaves in (("gate_up_proj", (2 * s.intermediate, s.hidden), self.naming[:2]),
                                      ("down_proj", (s.hidden, s.intermediate), self.naming[2:])):
            entries = [(t.name, disk_shape(t, scheme, n, k), allowed_dtypes(t.role, lq), not t.optional)
                       for t in lq.tensors] + [("bias", (n,), FLOATS, s.has_bias)]
            for leaf, want, ok, required in entries:
                full = f"{self.disk_prefix}.{param}_{leaf}"
                if full not in header:
                    if required:
                        raise CheckpointError(
                            f"tensor {full!r} is missing from the checkpoint", where=self.name,
                            fix=f"the {lq.source} experts store {param}_{{{', '.join(e[0] for e in entries)}}}; "
                                "re-export the checkpoint or leave this layer unquantized in the config")
                    continue
                dtype, stored = header[full]
                want = (s.num_experts, *want)
                if dtype not in ok:
                    raise CheckpointError(f"tensor {full!r} has dtype {dtype}, expected one of {list(ok)}",
                                          where=self.name, fix=f"the config says {scheme.key}; the checkpoint and its "
                                          "config disagree")
                if not shape_matches(stored, want):
                    raise CheckpointError(f"tensor {full!r} has shape {list(stored)}, expected {list(want)} for "
                                          f"{s.num_experts} experts of [{n}, {k}] under {scheme.key}", where=self.name,
                                          fix="the checkpoint does not match the model config or the quantization "
                                              "config")
                if len(want) < 2 or want[1] != n:
                    raise UnsupportedError(f"tensor {full!r} ({list(want)}) has no row per output: fused experts "
                                           "tensors are cut per row", where=self.name,
                                           fix="store these experts per expert")
                self.register_parameter(f"{param}_{leaf}", _param(torch.empty(stored, dtype=dtype, device="meta")))
                self.fused[f"{param}_{leaf}"] = (param, leaf, dtype, tuple(stored), want)
                for e in range(s.num_experts):
                    for name in leaves:
                        per_expert[f"{self.disk_prefix}.{e}.{name}.{leaf}"] = (dtype, (n // len(leaves), *want[2:]))
        return per_expert

    def _check_uniform_dtypes(self) -> None:
        """One stacked tensor per role: every expert must store it in one dtype."""
        seen: dict[tuple[str, str], tuple[torch.dtype, str]] = {}
        for slot in self.slots:
            for role, disk in slot.disk.items():
                first = seen.setdefault((slot.group, role), (disk.dtype, f"{slot.name}.{disk.name}"))
                if disk.dtype != first[0] and not (disk.dtype in FLOATS and first[0] in FLOATS):
                    raise CheckpointError(f"tensor {slot.name}.{disk.name} is {disk.dtype} but {first[1]} is "
                                          f"{first[0]}", where=slot.name,
                                          fix="every expert stores a tensor in the same dtype; re-export the checkpoint")

    # -- 2. loading ------------------------------------------------------------------------------
    @torch.no_grad()
    def receive(self, slot: ExpertSlot, name: str, t: torch.Tensor) -> None:
        """Take the checkpoint tensor ``name`` of ``slot`` as transformers loaded it: canonical form, into
        its place in the stacked tensor; the source is released."""
        self._take(slot, name, t)
        release_memory(t)

    def _take(self, slot: ExpertSlot, name: str, t: torch.Tensor) -> None:
        if name == "bias":
            self._place(slot, "bias", t.to(self.dtype))
        else:
            spec = next((s for s in self.lq.tensors if slot.disk.get(s.role) and slot.disk[s.role].name == name), None)
            if spec is None:
                raise CheckpointError(f"unexpected tensor {slot.name}.{name}", where=slot.name,
                                      fix="the checkpoint does not match its quantization config")
            c = slot._to_canonical(spec, t)
            if c is not None:
                self._place(slot, spec.role, c)
        self.received.add((slot.expert, slot.group, slot.shard, name))

    def __setattr__(self, name, value):
        fused = self.__dict__.get("fused")
        if fused and name in fused and isinstance(value, torch.Tensor) and value.device.type != "meta":
            self._receive_fused(name, value.data)
            return
        super().__setattr__(name, value)

    @torch.no_grad()
    def _receive_fused(self, name: str, t: torch.Tensor) -> None:
        """A fused checkpoint tensor (:meth:`_plan_fused`): each expert's rows go to its slots as a per-expert
        checkpoint's tensors would (gate and up de-interleaved where the HF layout interleaves them: a permutation
        of the rows, the bytes kept), and that expert's pages are released once taken."""
        param, leaf, _, _, want = self.fused[name]
        del self._parameters[name]
        group = "w13" if param == "gate_up_proj" else "w2"
        slots = {(slot.expert, slot.shard): slot for slot in self.slots if slot.group == group}
        t = t.reshape(want)
        for e in range(self.num_experts):
            rows = t[e]
            parts = (rows,) if group == "w2" else (rows[0::2], rows[1::2]) if self.shape.interleaved else rows.chunk(2)
            for shard, part in enumerate(parts):
                self._take(slots[e, shard], leaf, part)
            release_memory(rows)
        release_memory(t)  # the pages the experts' ranges did not cover whole

    def _place(self, slot: ExpertSlot, role: str, c: torch.Tensor) -> None:
        e, group, shard = slot.expert, slot.group, slot.shard
        shards = 2 if group == "w13" else 1
        if c.dim() == 0 or role == "weight_g_idx":  # per shard: merged in finalize
            buf = self._buffer("per_shard", group, role, (self.num_experts, shards, *c.shape), c)
            buf[e, shard] = c
            return
        rows = c.shape[0]
        buf = self._buffer("stack", group, role, (self.num_experts, shards * rows, *c.shape[1:]), c)
        buf[e, shard * rows:(shard + 1) * rows] = c

    def _buffer(self, kind: str, group: str, role: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        store = self.__dict__[kind]
        if (group, role) not in store:
            # Not zero-filled: the OS then backs a page only once an expert's tensor is written there, while
            # the pages of the experts still to come are already resident in the file mapping (transformers
            # reads ahead). Every block is written before finalize (_check_all_received).
            store[group, role] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return store[group, role]

    # -- 3. finalize -----------------------------------------------------------------------------
    @torch.no_grad()
    def finalize(self) -> None:
        if self.finalized:
            return
        missing = [name for name in self.fused if name in self._parameters]
        if missing:
            raise CheckpointError(f"tensor {self.disk_prefix}.{missing[0]} was not loaded", where=self.name,
                                  fix="the checkpoint index lists it but no shard held it; check the shards")
        self._check_all_received()
        stack, per_shard = self.stack, self.per_shard
        for (group, role), t in per_shard.items():
            stack[group, role] = self._merge(group, role, t)
        self._split_partial_row_blocks()
        for e in range(self.num_experts):
            if str(e) in self._modules:
                delattr(self, str(e))
        for (group, role), t in stack.items():
            setattr(self, f"{group}_{role}", _param(t))
        self.__dict__["stack"] = {}
        self.finalized = True
        self._tile_for_kernel()

    def _tile_for_kernel(self) -> None:
        """On a GPU where the kernel the registry picks for this layer declares the ``tiled`` layout
        (``Kernel.layouts``) and wo_mma's grouped build takes both projections, permute every expert's weight once
        into the order that build streams (moe_wo.tile_for_mma: scheme ``tiled``; decode up to 1.33x faster than
        the checkpoint order, docs/kernels-moe.md). :meth:`disk_tensors` undoes it."""
        from .kernels.registry import KernelQuery, cuda_capability, select

        w13 = self.w13_weight
        scheme = parse_scheme_key(self.scheme_key)
        if w13.device.type != "cuda" or scheme.weight.tiled:
            return
        query = KernelQuery(scheme, "cuda", cuda_capability(w13.device), w13.shape[1], self.hidden_dim, self.dtype,
                            kind="experts", num_experts=self.num_experts, top_k=1, activation=self.activation)
        if "tiled" in select(query).kernel.layouts:
            self._tile()

    def _tile(self) -> bool:
        """Permute the experts' weights into wo_mma's grouped streaming order (scheme ``tiled``, K padded to whole
        chunks with the scales and zero points); False, and nothing changed, where that build does not take
        them."""
        from .kernels.moe_wo import tile_for_mma

        roles = ROLES[:5]
        held = {g: tuple(None if (t := getattr(self, f"{g}_{r}", None)) is None else t.data for r in roles)
                for g in ("w13", "w2")}
        tiled = tile_for_mma(parse_scheme_key(self.scheme_key), held["w13"], held["w2"], self.hidden_dim,
                             self.intermediate_dim, self.dtype)
        if tiled is None:
            return False
        scheme, w13, w2 = tiled
        for group, tensors in (("w13", w13), ("w2", w2)):
            for role, t, old in zip(roles, tensors, held[group]):
                if t is not old:  # (tiled or padded)
                    setattr(self, f"{group}_{role}", _param(t))
        self.scheme_key = scheme.key
        return True

    def _check_all_received(self) -> None:
        for slot in self.slots:
            names = [d.name for d in slot.disk.values()] + (["bias"] if slot.bias is not None else [])
            for name in names:
                if (slot.expert, slot.group, slot.shard, name) not in self.received:
                    raise CheckpointError(f"tensor {slot.name}.{name} was not loaded", where=slot.name,
                                          fix="the checkpoint index lists it but no shard held it; check the shards")

    def _merge(self, group: str, role: str, t: torch.Tensor) -> torch.Tensor:
        """Per-shard ``t`` [E, shards, ...] -> the stacked canonical tensor (module docstring)."""
        if role in ("input_scale", "input_global_scale"):
            return t.amax()
        if group == "w2":
            return t[:, 0].contiguous()
        gate, up = t[:, 0], t[:, 1]
        if role == "weight_g_idx":
            differ = (gate != up).any(-1).nonzero().flatten().tolist()
            if differ:
                raise CheckpointError(f"the gate and up projections of expert {differ[0]} have different g_idx "
                                      f"({self.disk_prefix}.{differ[0]}.{self.naming[0]}.weight_g_idx)",
                                      where=self.name, fix="the fused gate/up runs one column order; re-export")
            return gate.contiguous()
        if role == "weight_global_scale" and self.lq.scheme.weight.scale.dtype is ScaleDtype.FP32:
            return self._fold_global_scales(gate, up)
        if role == "weight_global_scale":
            differ = (~torch.isclose(gate, up)).nonzero().flatten().tolist()
            if differ:
                warnings.warn(f"qcompile: {self.name}: the NVFP4 global scales of gate and up differ for "
                              f"{len(differ)} experts (expert {differ[0]}: {gate[differ[0]]:.6g} vs "
                              f"{up[differ[0]]:.6g}); the gate's is used for both, as vLLM does. Accuracy may be "
                              "affected", stacklevel=4)
            return gate.contiguous()
        if role == "weight_scale":  # per-tensor: requantize the other shard to the larger scale
            return self._merge_tensor_scales(gate, up)
        if not torch.equal(gate, up):
            raise UnsupportedError(f"per-tensor {role} differs between gate and up", where=self.name,
                                   fix="quantize gate and up with one per-tensor parameter")
        return gate.contiguous()

    def _fold_global_scales(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """W4A8 (fp32 channel scales under a global one): the larger of gate's and up's global scales is
        shared, the other shard's channel scales take the ratio (as vLLM); their stored values are kept
        for saving."""
        biggest = torch.maximum(gate, up)
        scales = self.stack["w13", "weight_scale"]
        rows = self.intermediate
        for shard, own in enumerate((gate, up)):
            for e in (own != biggest).nonzero().flatten().tolist():
                part = scales[e, shard * rows:(shard + 1) * rows]
                self.stored_scales[e, shard] = part.clone()
                part.mul_(own[e] / biggest[e])
        return biggest.contiguous()

    def _merge_tensor_scales(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        codes = self.stack["w13", "weight"]
        w = parse_scheme_key(self.scheme_key).weight
        rows = self.intermediate
        for e in (gate != up).nonzero().flatten().tolist():
            if w.packing.value != "none" or w.dtype.value not in ("fp8_e4m3", "int8"):
                raise UnsupportedError(f"expert {e}'s gate and up have different per-tensor scales and "
                                       f"{w.dtype.value} codes cannot be requantized", where=self.name,
                                       fix="quantize gate and up with one scale")
            fused, biggest = quant_math.requantize_to_max_scale([codes[e, :rows], codes[e, rows:]], [gate[e], up[e]])
            codes[e] = fused
            gate[e] = up[e] = biggest  # the per-shard scales saved: the shared one (disk_tensors)
            self.requantized.append(e)
        if self.requantized:
            log.info("qcompile: %s: gate and up requantized to their larger scale for %d experts", self.name,
                     len(self.requantized))
        return torch.maximum(gate, up).contiguous()

    def _split_partial_row_blocks(self) -> None:
        """Block scales whose gate / up shards end in a partial row block (I not a multiple of block_n):
        stacked, the up rows would fall under the gate's blocks. Each bn-row block is cut into bn/r blocks
        of r = gcd(I, bn) rows holding the same scale, for w13 and w2 alike (one scheme), so that the
        stacked grid is exact; kernels that need whole 128-row blocks then decline (``block_split``
        undoes it when saving)."""
        scheme = parse_scheme_key(self.scheme_key)
        w = scheme.weight
        bn, bk = w.scale.block
        if w.scale.granularity is not Granularity.BLOCK or self.intermediate % bn == 0:
            return
        rows = math.gcd(self.intermediate, bn)
        split = bn // rows
        for group, n, shards in (("w13", self.intermediate, 2), ("w2", self.hidden_dim, 1)):
            t = self.stack[group, "weight_scale"]
            t = t.view(t.shape[0], shards, -1, t.shape[-1]).repeat_interleave(split, dim=2)[:, :, :-(-n // rows)]
            self.stack[group, "weight_scale"] = t.reshape(t.shape[0], -1, t.shape[-1]).contiguous()
        self.block_split = split
        self.scheme_key = replace(scheme, weight=replace(w, scale=replace(w.scale, block=(rows, bk)))).key

    @property
    def intermediate(self) -> int:
        return self.intermediate_dim

    # -- 4. saving -------------------------------------------------------------------------------
    @torch.no_grad()
    def disk_tensors(self) -> dict[str, torch.Tensor]:
        """``{<e>.<projection>.<name>: tensor}`` relative to this module: every expert's checkpoint tensors as
        the checkpoint stored them (the inverse of :meth:`receive` and :meth:`finalize`). Experts whose gate and
        up were requantized to one per-tensor scale at load are written as the model holds them: the
        requantized codes, the shared scale for both (a checkpoint that loads back to the same tensors)."""
        out, untiled = {}, {}
        for slot in self.slots:
            leaf = self.naming[(0, 1, 2)[SHARDS.index((slot.group, slot.shard))]]
            for spec in self.lq.tensors:
                if spec.role in slot.disk:
                    t = self._canonical_of(slot, spec.role, untiled)
                    if spec.role == "weight_scale" and self.block_split > 1:
                        t = t[::self.block_split]
                    out[f"{slot.expert}.{leaf}.{slot.disk[spec.role].name}"] = slot._to_disk(spec, t)
            if slot.bias is not None:
                out[f"{slot.expert}.{leaf}.bias"] = self._rows(self.w13_bias if slot.group == "w13" else self.w2_bias,
                                                              slot).to(slot.bias.dtype).clone()
        return self._fused_disk_tensors(out) if self.fused else out

    def _fused_disk_tensors(self, per_expert: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The per-expert tensors of :meth:`disk_tensors` put back together as the fused checkpoint stored them
        (the inverse of :meth:`_receive_fused`)."""
        out = {}
        for name, (param, leaf, dtype, stored, _) in self.fused.items():
            leaves = self.naming[:2] if param == "gate_up_proj" else self.naming[2:]
            experts = []
            for e in range(self.num_experts):
                parts = [per_expert[f"{e}.{projection}.{leaf}"] for projection in leaves]
                interleave = len(parts) == 2 and self.shape.interleaved
                experts.append(torch.stack(parts, 1).flatten(0, 1) if interleave else torch.cat(parts))
            out[name] = torch.stack(experts).to(dtype).reshape(stored).contiguous()
        return out

    def _canonical_of(self, slot: ExpertSlot, role: str, untiled: dict) -> torch.Tensor | None:
        """Expert ``slot.expert``'s canonical tensor of ``role`` for ``slot``'s shard, as loaded; ``untiled`` keeps
        each expert's untiled weight for its other shard."""
        if role == "weight_scale" and slot.group == "w13" and (slot.expert, slot.shard) in self.stored_scales:
            return self.stored_scales[slot.expert, slot.shard]
        if (slot.group, role) in self.per_shard:
            return self.per_shard[slot.group, role][slot.expert, slot.shard]
        t = getattr(self, f"{slot.group}_{role}", None)
        w = parse_scheme_key(self.scheme_key).weight
        if t is not None and role == "weight" and w.tiled:  # (tiles of 16 rows: untile the expert first)
            key = (slot.group, slot.expert)
            if key not in untiled:  # [the untiled expert, shards still to serve]
                untiled[key] = [quant_math.untile_weight(t[slot.expert], w), 2 if slot.group == "w13" else 1]
            entry = untiled[key]
            t, entry[1] = entry[0], entry[1] - 1
            if not entry[1]:
                del untiled[key]
            rows = t.shape[0] // (2 if slot.group == "w13" else 1)
            return self._unpadded(t[slot.shard * rows:(slot.shard + 1) * rows], role, slot.group)
        return None if t is None else self._unpadded(self._rows(t, slot), role, slot.group)

    def _unpadded(self, t: torch.Tensor, role: str, group: str) -> torch.Tensor:
        """A tiled weight's canonical ``role`` tensor of one expert's shard without the padding of K to whole
        chunks (scheme.canonical_shape)."""
        w = parse_scheme_key(self.scheme_key).weight
        if not w.tiled or role not in ("weight", "weight_scale", "weight_zero_point") or t.dim() < 2:
            return t
        k = self.hidden_dim if group == "w13" else self.intermediate_dim
        cols = canonical_shape(role, QuantScheme(replace(w, tiled=False)), t.shape[0], k)[-1]
        return t[:, :cols]

    def _rows(self, t: torch.Tensor, slot: ExpertSlot) -> torch.Tensor:
        rows = t.shape[1] // (2 if slot.group == "w13" else 1)
        return t[slot.expert, slot.shard * rows:(slot.shard + 1) * rows]

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.shape.dense:
            top_k_index, top_k_weights = dense_routing(hidden_states, self.num_experts)
        w13 = [getattr(self, f"w13_{role}", None) for role in ROLES]
        w2 = [getattr(self, f"w2_{role}", None) for role in ROLES]
        return torch.ops.qcompile.experts_ref(hidden_states, top_k_index, top_k_weights, *w13, *w2, self.w13_bias,
                                              self.w2_bias, self.activation, self.scheme_key)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"activation={self.activation}, scheme={self.scheme_key}")

    # -- dequantized -----------------------------------------------------------------------------
    @torch.no_grad()
    def dequantized(self, dtype: torch.dtype) -> nn.Module:
        """The replaced HF experts module, holding the dequantized weights in ``dtype``."""
        import copy

        spec = parse_scheme_key(self.scheme_key).weight
        fused = []
        for group, k in (("w13", self.hidden_dim), ("w2", self.intermediate_dim)):
            tensors = tuple(getattr(self, f"{group}_{role}", None) for role in ROLES[:5])
            per = []
            for e in range(self.num_experts):
                w, s, g, z, idx = expert_slice(tensors, e)
                per.append(quant_math.dequantize_weight(w, s, spec, g, z, idx, k=k))
            fused.append(torch.stack(per).to(dtype))
        out = copy.deepcopy(self.hf_template)
        out.gate_up_proj, out.down_proj = (nn.Parameter(t, requires_grad=False) for t in self.to_hf_layout(*fused))
        if self.shape.has_bias:
            out.gate_up_proj_bias, out.down_proj_bias = (nn.Parameter(t.to(dtype), requires_grad=False) for t in
                                                         self.to_hf_layout(self.w13_bias, self.w2_bias, bias=True))
        return out

    def to_hf_layout(self, gate_up: torch.Tensor, down: torch.Tensor, bias: bool = False):
        """Canonical [E, 2I, ...] (gate rows then up rows) / [E, H, ...] -> the HF module's layout."""
        if self.shape.interleaved:
            i = self.intermediate_dim
            gate_up = torch.stack((gate_up[:, :i], gate_up[:, i:]), dim=2).flatten(1, 2)
        if self.shape.transposed and not bias:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        return gate_up.contiguous(), down.contiguous()


def dense_routing(hidden_states: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of an experts module whose input is every expert's block of rows, expert-major (Llama-4:
    [E * T, H], the router weight already applied to the rows): row r goes to expert r // T, weight 1."""
    rows = hidden_states.shape[0]
    index = torch.arange(num_experts, device=hidden_states.device).repeat_interleave(rows // num_experts)
    return index.unsqueeze(-1), hidden_states.new_ones(rows, 1)


def experts_on_disk(header: dict) -> dict[str, set[str]]:
    """``{prefix: projection leaves}`` of the per-expert tensors ``<prefix>.<e>.<leaf>.<name>`` in ``header``
    whose leaves include a full :data:`NAMINGS` triple."""
    found: dict[str, set[str]] = {}
    for key in header:
        parts = key.split(".")
        for i in range(len(parts) - 3, 0, -1):
            if parts[i].isdigit():
                found.setdefault(".".join(parts[:i]), set()).add(parts[i + 1])
                break
    return {p: leaves for p, leaves in found.items() if any(set(n) <= leaves for n in NAMINGS)}


def locate_experts(name: str, on_disk: dict[str, set[str]]) -> tuple[str, tuple[str, ...]] | None:
    """Where the checkpoint stores the per-expert tensors of the experts module ``name``: (prefix, naming).
    The prefix is ``name`` itself or ``name`` with the MoE block renamed, as transformers renames Mixtral's
    ``block_sparse_moe`` to ``mlp`` (``model.layers.0.block_sparse_moe.experts`` for
    ``model.layers.0.mlp.experts``); None when the checkpoint has no per-expert tensors for it."""
    block_parent = name.rpartition(".")[0].rpartition(".")[0]
    leaf = name.rpartition(".")[2]
    renamed = [p for p in on_disk if p.rpartition(".")[2] == leaf and p.rpartition(".")[0].rpartition(".")[0] ==
               block_parent]
    prefix = name if name in on_disk else renamed[0] if len(renamed) == 1 else None
    if prefix is None:
        return None
    return prefix, next(n for n in NAMINGS if set(n) <= on_disk[prefix])


def _check_expert_count(header: dict, prefix: str, num_experts: int, naming: tuple[str, ...]) -> None:
    """The checkpoint's experts are exactly 0 .. E-1 of the model config."""
    stored = set()
    for key in header:
        if key.startswith(prefix + "."):
            index = key[len(prefix) + 1:].partition(".")[0]
            if index.isdigit():
                stored.add(int(index))
    extra = sorted(i for i in stored if i >= num_experts)
    if extra:
        raise CheckpointError(f"the checkpoint stores expert {extra[0]} ({prefix}.{extra[0]}.{naming[0]}...) but the "
                              f"model config has {num_experts} experts (0 .. {num_experts - 1})", where=prefix,
                              fix="the checkpoint does not match its config.json (num_experts / num_local_experts)")
