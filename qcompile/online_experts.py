"""Online FP8 for MoE experts: a bf16 / fp16 transformers experts module quantized to FP8 per expert, as
vLLM's online ``Fp8PerTensorOnlineMoEMethod`` / ``Fp8PerBlockOnlineMoEMethod`` do.

The HF experts tensors are first put in the canonical layout of :mod:`qcompile.kernels.experts_ref`
(``w13`` [E, 2I, H] gate rows then up rows, ``w2`` [E, H, I]; gpt-oss's transposed, interleaved
``gate_up_proj`` [E, H, 2I] and Llama-4's transposed [E, H, 2I] / [E, I, H] converted), then each
expert's fused gate + up and its down projection are quantized on their own:

* ``fp8_per_tensor``: one scale per expert and projection, ``w13_weight_scale`` / ``w2_weight_scale`` [E];
* ``fp8_per_block``: one scale per b x b tile, [E, ceil(N/b), ceil(K/b)] (a ragged edge tile is quantized
  as if zero-padded, as vLLM's ``per_block_cast_to_fp8``).

Both online paths use it: :class:`OnlineExperts` at load (the module that replaces the HF experts module
and quantizes each fused tensor the moment transformers sets it), and the Experts pass at compile time
(:mod:`qcompile.passes.experts`, on the parameters the graph reads).
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import CheckpointError, UnsupportedError
from .experts import NAMINGS, ExpertsShape, QuantExperts
from .kernels import quant_math
from .linear import FLOATS, _param, release_memory
from .scheme import Granularity, LayerQuant

HF_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def canonical_expert(t: torch.Tensor, e: int, shape: ExpertsShape, group: str) -> torch.Tensor:
    """Expert ``e``'s weight of ``group`` ("w13" | "w2") from the HF tensor ``t`` (``gate_up_proj`` or
    ``down_proj``), in canonical form: w13 [2I, H] gate rows then up rows, w2 [H, I]."""
    w = t[e].t() if shape.transposed else t[e]
    if group == "w13" and shape.interleaved:
        w = torch.cat((w[0::2], w[1::2]))
    return w


def canonical_bias(t: torch.Tensor, shape: ExpertsShape, group: str) -> torch.Tensor:
    """An HF experts bias ([E, 2I] / [E, H]) in canonical order (gate then up)."""
    if group == "w13" and shape.interleaved:
        t = torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
    return t.contiguous()


def quantize_expert(w: torch.Tensor, lq: LayerQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's [N, K] bf16 weight -> (fp8 codes [N, K], fp32 scale [] or [ceil(N/b), ceil(K/b)])."""
    spec = lq.scheme.weight.scale
    if spec.granularity is not Granularity.BLOCK:
        return quant_math.quantize_weight_fp8(w.contiguous(), spec.granularity)
    b = spec.block[0]
    n, k = w.shape
    pad_n, pad_k = -n % b, -k % b
    if pad_n or pad_k:
        w = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n))
    q, s = quant_math.quantize_weight_fp8(w.contiguous(), spec.granularity, b)
    return q[:n, :k].contiguous(), s


@torch.no_grad()
def quantize_experts(t: torch.Tensor, shape: ExpertsShape, group: str, lq: LayerQuant, name: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF tensor ``t`` of ``group`` quantized per expert: (codes [E, N, K], scales [E] / [E, N/b, K/b]).
    One expert at a time: besides ``t`` and the result, one expert's canonical copy."""
    scales = []
    n, k = (2 * shape.intermediate, shape.hidden) if group == "w13" else (shape.hidden, shape.intermediate)
    codes = torch.empty((shape.num_experts, n, k), dtype=torch.float8_e4m3fn, device=t.device)
    for e in range(shape.num_experts):
        codes[e], s = quantize_expert(canonical_expert(t, e, shape, group), lq)
        scales.append(s)
    stacked = torch.stack(scales).float()
    if not torch.isfinite(stacked).all():
        raise CheckpointError(f"the {'gate_up_proj' if group == 'w13' else 'down_proj'} weights hold NaN or inf",
                              where=name, fix="the checkpoint is corrupt; re-export it")
    return codes, stacked


class OnlineExperts(QuantExperts):
    """A QuantExperts whose experts are quantized online from the bf16 / fp16 fused HF tensors.

    Planned with the HF module's own parameters (``gate_up_proj``, ``down_proj``, biases) on the meta
    device, so transformers loads them as for the HF module (its per-expert checkpoint tensors merged
    by its own conversions); each is converted and quantized the moment it is set, and its memory given
    back, so a load holds the quantized layers plus the one fused tensor in flight."""

    loads_fused = True  # transformers' gate / up merge stays on for these modules (loading.py)

    @classmethod
    def plan_online(cls, module: nn.Module, name: str, lq: LayerQuant) -> "OnlineExperts":
        shape = ExpertsShape.of(module, name)
        dtype = module.gate_up_proj.dtype if module.gate_up_proj.dtype in FLOATS else torch.bfloat16
        mod = cls(name, lq, shape, name, NAMINGS[0], dtype)
        mod.__dict__["hf_template"] = module
        for p in HF_PARAMS:
            t = getattr(module, p, None)
            if isinstance(t, nn.Parameter):
                nn.Module.__setattr__(mod, p, _param(torch.empty(t.shape, dtype=t.dtype, device="meta")))
        return mod

    def __setattr__(self, name, value):
        if (name in HF_PARAMS and isinstance(value, torch.Tensor) and value.device.type != "meta"
                and "shape" in self.__dict__):
            self._receive_hf(name, value.data)
            return
        super().__setattr__(name, value)

    @torch.no_grad()
    def _receive_hf(self, name: str, t: torch.Tensor) -> None:
        if t.dtype not in FLOATS:
            raise CheckpointError(f"tensor {self.name}.{name} is {t.dtype}; online quantization reads bf16, fp16 or "
                                  "fp32 weights", where=self.name, fix="load an unquantized checkpoint")
        group = "w13" if name.startswith("gate_up") else "w2"
        self._parameters.pop(name, None)
        if name.endswith("_bias"):
            self._set(f"{group}_bias", canonical_bias(t, self.shape, group).to(self.dtype))
        else:
            codes, scales = quantize_experts(t, self.shape, group, self.lq, self.name)
            self._set(f"{group}_weight", codes)
            self._set(f"{group}_weight_scale", scales)
        self.received.add(name)
        release_memory(t)

    def _set(self, name: str, t: torch.Tensor) -> None:
        param = _param(t)
        param._is_hf_initialized = True  # loaded: transformers' weight init must leave it alone
        nn.Module.__setattr__(self, name, param)

    def finalize(self) -> None:
        if self.finalized:
            return
        missing = [p for p in HF_PARAMS if p in self._parameters]
        if missing:
            raise CheckpointError(f"tensor {self.name}.{missing[0]} was not loaded", where=self.name,
                                  fix="the checkpoint index lists it but no shard held it; check the shards")
        self.finalized = True

    @torch.no_grad()
    def disk_tensors(self) -> dict[str, torch.Tensor]:
        """The per-expert FP8 tensors of the compressed-tensors checkpoint the model is saved as:
        ``<e>.{gate,up,down}_proj.{weight,weight_scale}`` (gate and up share the fused per-tensor scale)."""
        if self.shape.transposed or self.shape.interleaved or self.shape.has_bias:
            raise UnsupportedError(
                "an online-quantized experts module with a transposed or interleaved gate/up layout (or biases) "
                "cannot be saved: FP8 checkpoints store experts per expert as gate / up / down projections, which "
                "this model does not load back", where=self.name,
                fix="quantize this model online at each load (qcompile.load(path, online=...)) instead of saving it")
        i, out = self.intermediate_dim, {}
        block = self.lq.scheme.weight.scale.block[0] if self.w13_weight_scale.dim() == 3 else 0
        if block and i % block:
            raise UnsupportedError(f"the experts' intermediate size {i} is not a multiple of the {block}-row block: "
                                   "a scale block spans gate and up rows, which per-expert checkpoints cannot store",
                                   where=self.name, fix="save with online fp8_per_tensor, or quantize at each load")
        for e in range(self.num_experts):
            w13, s13 = self.w13_weight[e], self.w13_weight_scale[e]
            split = (lambda t, half: t[:i // block] if half == 0 else t[i // block:]) if block else \
                (lambda t, half: t)
            for half, leaf in enumerate(("gate_proj", "up_proj")):
                out[f"{e}.{leaf}.weight"] = w13[half * i:(half + 1) * i].clone()
                out[f"{e}.{leaf}.weight_scale"] = split(s13, half).clone()
            out[f"{e}.down_proj.weight"] = self.w2_weight[e].clone()
            out[f"{e}.down_proj.weight_scale"] = self.w2_weight_scale[e].clone()
        return out

