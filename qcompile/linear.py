"""``QuantLinear``: the module that replaces an ``nn.Linear`` whose checkpoint weight is quantized.

Life cycle (driven by :mod:`qcompile.loading`):

1. :meth:`QuantLinear.plan` — before any tensor is read: from the safetensors *headers*, check that
   every tensor the layer's :class:`~qcompile.scheme.LayerQuant` names is present with an allowed
   dtype and a shape that holds the canonical tensor; declare empty parameters with the on-disk
   names, dtypes and shapes, so the loader copies each tensor once, as stored (fp8 stays fp8).
2. transformers' loader fills them, shard by shard.
3. :meth:`QuantLinear.finalize` — reshape to the canonical shapes, invert reciprocal conventions,
   widen bf16 scales to fp32, reject NaN / inf / non-positive scales, quantize online layers, and
   re-register everything under the canonical role names.
4. :meth:`QuantLinear.disk_tensors` — for ``save_pretrained``: the exact inverse of 3. (and of the
   GPU tiling / act-order sort), the checkpoint's tensors with their names, dtypes, shapes and bytes.

``forward`` calls the reference op ``qcompile::linear_ref``, so an uncompiled model is correct on any
device; the backend's Linear pass lowers that op to a kernel.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from .errors import CheckpointError, UnsupportedError
from .kernels import quant_math
from .modules import linear_shape
from .kernels.reference import linear_ref, reference_supports  # noqa: F401  (registers the op)
from .scheme import (Granularity, LayerQuant, Packing, QDtype, ScaleDtype, TensorSpec, canonical_shape,
                     disk_shape, parse_scheme_key, shape_matches)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64)

UNUSED_ROLES = ("unused_weight_zero_point", "unused_input_zero_point")  # checked zero, never read

# The tensors QuantLinear.forward passes to the op, in the op's argument order.
OP_ROLES = ("weight", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_g_idx",
            "input_scale", "input_global_scale")


def allowed_dtypes(role: str, lq: LayerQuant) -> tuple[torch.dtype, ...]:
    w = lq.scheme.weight
    if role == "weight":
        if lq.online:
            return FLOATS
        if w.packing is Packing.INT32:
            return (torch.int32,)
        if w.packing in (Packing.UINT8, Packing.UINT8_FP6):
            return (torch.uint8,)
        return (torch.float8_e4m3fn,) if w.dtype is QDtype.FP8_E4M3 else (torch.int8,)
    if role == "weight_scale":
        if w.scale.dtype is ScaleDtype.FP8_E4M3:
            return (torch.float8_e4m3fn,)
        if w.scale.dtype is ScaleDtype.E8M0:
            return (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
        return FLOATS
    if role in ("weight_global_scale", "input_scale", "input_global_scale"):
        return FLOATS
    if role in ("weight_zero_point", "weight_g_idx", "weight_shape") or role in UNUSED_ROLES:
        return INTS + (torch.int8, torch.uint8)
    raise AssertionError(role)


class DiskTensor(NamedTuple):
    """One checkpoint tensor of a layer as the file stores it (its suffix after the module name)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, has_bias: bool, lq: LayerQuant, name: str,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.lq = lq
        self.name = name
        self.scheme_key = lq.scheme.key
        self.dtype = dtype
        self.finalized = False
        self.disk: dict[str, DiskTensor] = {}  # role -> the tensor as the checkpoint stores it (plan)
        self._stored_reciprocals: dict[str, torch.Tensor] = {}  # role -> the stored value, fp32 (_to_canonical)
        self.bias = _param(torch.empty(out_features, dtype=dtype, device="meta")) if has_bias else None
        self.transposed = False  # online from a Conv1D: the bf16 weight arrives [in, out]

    # -- 1. plan ---------------------------------------------------------------------------------
    @classmethod
    def plan(cls, linear: nn.Module, name: str, lq: LayerQuant, header: dict[str, tuple[torch.dtype, tuple]]
             ) -> "QuantLinear":
        """Build the replacement for ``linear`` (named ``name``; an ``nn.Linear`` or what
        :func:`qcompile.modules.linear_shape` calls a linear) from ``header``: the checkpoint's
        ``{tensor name: (dtype, shape)}``. Raises CheckpointError / UnsupportedError naming the
        layer, the tensor and the fix. A Conv1D (weight stored [in, out]) is planned only for online
        quantization, which quantizes the transposed weight."""
        shape = linear_shape(linear)
        n, k = shape.out_features, shape.in_features
        if shape.transposed and not lq.online:
            raise UnsupportedError(f"{type(linear).__name__} layers (weight stored [in, out]) are quantized online only",
                                   where=name, fix="exclude this layer in the quantization config")
        why = reference_supports(lq.scheme)
        if why:
            raise UnsupportedError(f"{lq.source} layer uses {lq.scheme.key}: {why}", where=name,
                                   fix="load a checkpoint in a runnable format (docs/formats.md lists them)")
        _check_divisible(lq, name, n, k)
        dtype = linear.weight.dtype if linear.weight.dtype in FLOATS else torch.bfloat16
        mod = cls(k, n, shape.bias, lq, name, dtype)
        mod.transposed = shape.transposed
        for spec in lq.tensors:
            full = f"{name}.{spec.name}"
            if full not in header:
                if spec.optional:
                    continue
                raise CheckpointError(
                    f"tensor {full!r} ({spec.role}) is missing from the checkpoint", where=name,
                    fix=f"the {lq.source} scheme {lq.scheme.key} stores {[t.name for t in lq.tensors if not t.optional]} "
                        "for every quantized layer; re-export the checkpoint or exclude this layer in the config")
            disk_dtype, stored = header[full]
            ok_dtypes = (torch.int32,) if spec.packed_rows else allowed_dtypes(spec.role, lq)
            if disk_dtype not in ok_dtypes:
                raise CheckpointError(
                    f"tensor {full!r} has dtype {disk_dtype}, expected one of {list(ok_dtypes)}", where=name,
                    fix=f"the config says {lq.scheme.key}; the checkpoint and its config disagree")
            want = disk_shape(spec, lq.scheme, n, k)
            if shape.transposed and spec.role == "weight":
                want = want[::-1]
            if not shape_matches(stored, want):
                packed = f" ({32 // lq.scheme.weight.dtype.bits} codes per int32 along out_features)" \
                    if spec.packed_rows else ""
                raise CheckpointError(
                    f"tensor {full!r} has shape {list(stored)}, expected {list(want)}{packed} for a [{n}, {k}] "
                    f"layer under {lq.scheme.key}", where=name,
                    fix="the checkpoint does not match the model config or the quantization config")
            # Scales are kept in fp32; everything else as stored.
            keep = torch.float32 if disk_dtype in FLOATS and spec.role != "weight" else disk_dtype
            if lq.online and spec.role == "weight":
                keep = disk_dtype
            setattr(mod, spec.name, _param(torch.empty(stored, dtype=keep, device="meta")))
            mod.disk[spec.role] = DiskTensor(spec.name, disk_dtype, tuple(stored))
        return mod

    # -- 2. loading ------------------------------------------------------------------------------
    def __setattr__(self, name, value):
        # Online layers quantize the moment transformers hands over their bf16 weight, so loading
        # never holds more than one layer's bf16 copy; release_memory then gives its pages back.
        lq = self.__dict__.get("lq")
        if (lq is not None and lq.online and name == "weight" and isinstance(value, torch.Tensor)
                and value.device.type != "meta" and value.dtype in FLOATS):
            with torch.no_grad():
                weight = value.data.t().contiguous() if self.transposed else value.data
                for role, t in self._quantize_online(weight).items():
                    param = _param(t)
                    param._is_hf_initialized = True  # loaded: transformers' weight init must leave it alone
                    super().__setattr__(role, param)
            release_memory(value.data)
            return
        super().__setattr__(name, value)

    # -- 3. finalize -----------------------------------------------------------------------------
    @torch.no_grad()
    def finalize(self) -> None:
        if self.finalized:
            return
        if self.lq.online:  # quantized when loaded (__setattr__)
            if self.weight.device.type == "meta":
                raise CheckpointError(f"tensor {self.name}.weight was not loaded", where=self.name,
                                      fix="the checkpoint index lists it but no shard held it; check the shards")
            self.finalized = True
            return
        canonical: dict[str, torch.Tensor] = {}
        for spec in self.lq.tensors:
            disk = self.disk.get(spec.role)
            if disk is None:
                continue
            t = getattr(self, disk.name).data
            if t.device.type == "meta":
                raise CheckpointError(f"tensor {self.name}.{spec.name} was not loaded", where=self.name,
                                      fix="the checkpoint index lists it but no shard held it; check the shards")
            delattr(self, disk.name)
            t = self._to_canonical(spec, t)
            if t is not None:
                canonical[spec.role] = t
        for role, t in canonical.items():
            setattr(self, role, _param(t))
        self.finalized = True
        self._tile_for_kernel()

    def _to_canonical(self, spec: TensorSpec, t: torch.Tensor) -> torch.Tensor | None:
        """One checkpoint tensor as loaded -> its canonical form (scheme.py's conventions), checked; None for
        ``weight_shape`` and the unused zero points, which are only checked. :meth:`_to_disk` is its exact
        inverse."""
        n, k, scheme = self.out_features, self.in_features, self.lq.scheme
        if spec.role in UNUSED_ROLES:  # all-zero words, whatever the packing
            if bool((t != 0).any()):
                raise CheckpointError(f"tensor {self.name}.{spec.name} holds nonzero zero points but the config "
                                      "quantizes this layer symmetrically", where=self.name,
                                      fix="set symmetric false in the quantization config, or re-export the layer")
            return None
        if spec.packed_rows:
            t = quant_math.unpack_int32(t.reshape(disk_shape(spec, scheme, n, k)).t(), scheme.weight.dtype.bits, n).t()
            t = t.to(torch.int8)
        if spec.int4_order:
            t = quant_math.permute_int4_words(t, tuple(spec.int4_order.index(j) for j in range(8)))
        t = t.reshape(canonical_shape(spec.role, scheme, n, k))
        if spec.role == "weight_shape":  # compressed-tensors' record of the unpacked shape
            if t.tolist() != [n, k]:
                raise CheckpointError(f"tensor {self.name}.{spec.name} says {t.tolist()}, the layer is [{n}, {k}]",
                                      where=self.name, fix="the checkpoint does not match the model config")
            return None
        if t.dtype == torch.float8_e4m3fn:  # NVFP4 block scales: zero is legal (an all-zero block)
            _check_finite(t, self.name, spec.name)
        if t.dtype in FLOATS:
            t = t.float()  # bf16 / fp16 scales widen exactly
            _check_finite_positive(t, self.name, spec.name)
            if spec.reciprocal:
                # 1 / (1 / x) is not x for ~17% of fp32 x (every bf16 x comes back): keep the stored value
                self._stored_reciprocals[spec.role] = t
                t = 1.0 / t
        return t.contiguous()

    def _to_disk(self, spec: TensorSpec, t: torch.Tensor | None) -> torch.Tensor:
        """The inverse of :meth:`_to_canonical`: canonical ``t`` -> the tensor the checkpoint stored, in its
        dtype and shape. A reciprocal is written from the stored value while ``t`` is still its inverse."""
        n, k, disk = self.out_features, self.in_features, self.disk[spec.role]
        if spec.role in UNUSED_ROLES:
            return torch.zeros(disk.shape, dtype=disk.dtype)
        if spec.role == "weight_shape":
            t = torch.tensor([n, k])
        if spec.reciprocal:
            stored = self._stored_reciprocals.get(spec.role)
            same = stored is not None and torch.equal(1.0 / stored.to(t.device), t)
            t = stored.to(t.device) if same else 1.0 / t
        if spec.packed_rows:
            t = quant_math.pack_int32(t.reshape(n, -1).t(), self.lq.scheme.weight.dtype.bits).t()
        if spec.int4_order:
            t = quant_math.permute_int4_words(t, spec.int4_order)
        return t.to(disk.dtype).reshape(disk.shape).contiguous()

    def _tile_for_kernel(self) -> None:
        """On a GPU, make the weight layouts that the kernel the registry picks for this layer declares
        (``Kernel.layouts``: :meth:`apply_layouts`). The old tensor is freed at once: one layer of extra memory.
        :meth:`disk_tensors` undoes them."""
        from .kernels.registry import KernelQuery, cuda_capability, select

        w = self.weight
        if w.device.type != "cuda":
            return
        dtype = self.bias.dtype if self.bias is not None else self.dtype
        self.apply_layouts(lambda s: select(KernelQuery(s, "cuda", cuda_capability(w.device), self.out_features,
                                                        self.in_features, dtype)).kernel)

    def apply_layouts(self, kernel_for) -> None:
        """The layouts ``kernel_for(scheme)`` (the registry's kernel for a scheme) declares: an act-order weight is
        sorted by group (quant_math.sort_act_order; the op then gathers x's columns per call) where the kernel for
        the sorted scheme wants ``ksorted`` and the g_idx allows it; then the weight is permuted into wo_mma's
        streaming order (quant_math.tile_weight) where the kernel wants ``tiled``."""
        scheme = parse_scheme_key(self.scheme_key)
        if scheme.weight.tiled:
            return
        if scheme.weight.act_order:
            kernel = kernel_for(replace(scheme, weight=replace(scheme.weight, act_order=False, k_sorted=True)))
            if "ksorted" not in kernel.layouts or not self._sort_act_order():
                return
        else:
            kernel = kernel_for(scheme)
        if "tiled" in kernel.layouts:
            self._tile()

    def _sort_act_order(self) -> bool:
        """Sort an act-order weight's input columns by group (scheme ``k_sorted``); False, and nothing
        changed, when its g_idx does not allow it."""
        scheme = parse_scheme_key(self.scheme_key)
        done = quant_math.sort_act_order(self.weight.data, self.weight_g_idx.data, scheme.weight, self.in_features)
        if done is None:
            return False
        self.weight, self.weight_g_idx = _param(done[0]), _param(done[1])
        self.scheme_key = replace(scheme, weight=replace(scheme.weight, act_order=False, k_sorted=True)).key
        return True

    def _tile(self) -> None:
        """Permute the weight into wo_mma's streaming order (scheme ``tiled``)."""
        scheme = parse_scheme_key(self.scheme_key)
        self.weight = _param(quant_math.tile_weight(self.weight.data, scheme.weight))
        self.scheme_key = replace(scheme, weight=replace(scheme.weight, tiled=True)).key

    # -- 4. saving -------------------------------------------------------------------------------
    @torch.no_grad()
    def disk_tensors(self) -> dict[str, torch.Tensor]:
        """``{on-disk name: tensor}``: the layer's checkpoint tensors exactly as the checkpoint stored them
        (names, dtypes, shapes, bytes), from the current canonical tensors: the inverse of :meth:`finalize`
        and of :meth:`_tile_for_kernel`. An online layer has no checkpoint of its own: its canonical FP8
        tensors under their role names, which are compressed-tensors' float-quantized names."""
        canonical = {role: getattr(self, role).data for role in OP_ROLES if getattr(self, role, None) is not None}
        w = parse_scheme_key(self.scheme_key).weight
        if w.tiled:
            canonical["weight"] = quant_math.untile_weight(canonical["weight"], w)
        if w.k_sorted:
            canonical["weight"], canonical["weight_g_idx"] = quant_math.unsort_act_order(
                canonical["weight"], canonical["weight_g_idx"], w, self.in_features)
        if self.lq.online:
            return {role: t.contiguous() for role, t in canonical.items()}
        return {self.disk[spec.role].name: self._to_disk(spec, canonical.get(spec.role))
                for spec in self.lq.tensors if spec.role in self.disk}

    def _quantize_online(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = self.lq.scheme.weight
        q, s = quant_math.quantize_weight_fp8(weight, w.scale.granularity,
                                              w.scale.block[0] if w.scale.granularity is Granularity.BLOCK else 128)
        _check_finite(s, self.name, "weight")  # a NaN / inf weight makes its scale NaN / inf
        return {"weight": q, "weight_scale": s}

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = [getattr(self, role, None) for role in OP_ROLES]
        return torch.ops.qcompile.linear_ref(x, *args, self.bias, self.scheme_key)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme_key}"


MADV_DONTNEED = 4  # Linux


def release_memory(source: torch.Tensor) -> None:
    """After an online layer is quantized, give its memory back to the OS, so that loading a bf16
    checkpoint peaks near the quantized size (tests/test_online_memory.py): drop the resident pages of
    ``source`` (the bf16 weight) where it is a view of a mapped ``.safetensors`` file — transformers
    loads through mmap, and every page read stays resident, and counted in the RSS, as long as anything
    views the file — and return glibc's free heap (``malloc_trim``; the quantization's buffer and the
    loader's temporaries otherwise leave free holes between the results that are never returned). Only
    pages wholly inside ``source`` are dropped; a later read faults the file's bytes in again, so
    nothing changes but the RSS. Linux / glibc only; elsewhere a no-op."""
    if source.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    libc = _libc()
    page = mmap.PAGESIZE
    start, end = source.data_ptr(), source.data_ptr() + source.numel() * source.element_size()
    first, last = -(-start // page) * page, end // page * page
    if first < last and _in_safetensors_mapping(start, end):
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)
    if hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL:
    # one handle: each CDLL builds its own function-pointer class, garbage that lingers until the next gc
    return ctypes.CDLL(None)


def _in_safetensors_mapping(start: int, end: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= start and end <= hi:
                return len(fields) == 6 and fields[5].rstrip("\n").endswith(".safetensors")
    return False


def _check_divisible(lq: LayerQuant, name: str, n: int, k: int) -> None:
    """Online block quantization needs whole blocks. A checkpoint's block scales may end in partial
    blocks (producers write ceil(N/bn) x ceil(K/bk) grids, e.g. DeepSeek-V3's 576-row kv_a_proj_with_mqa):
    the reference runs them, kernels that need whole blocks decline."""
    w = lq.scheme.weight.scale
    if lq.online and w.granularity is Granularity.BLOCK and (n % w.block[0] or k % w.block[1]):
        raise CheckpointError(
            f"block-quantized layer has out_features={n}, in_features={k}, not multiples of the "
            f"{w.block[0]}x{w.block[1]} block", where=name,
            fix="exclude this layer from quantization (config ignore / exclude_modules) or use a per-channel scheme")


def _check_finite(t: torch.Tensor, layer: str, tensor: str) -> None:
    # fp8 e4m3fn has no inf and one NaN pattern, S.1111.111: a test of the bits needs no fp32 copy (4x the
    # tensor, per tensor while loading) and no fp8 comparison kernel
    if t.dtype == torch.float8_e4m3fn:
        bad = bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    else:
        bad = not bool(torch.isfinite(t).all())
    if bad:
        raise CheckpointError(f"tensor {layer}.{tensor} holds NaN or inf", where=layer,
                              fix="the checkpoint is corrupt; re-export it")


def _check_finite_positive(t: torch.Tensor, layer: str, tensor: str) -> None:
    _check_finite(t, layer, tensor)
    if (t <= 0).any():
        bad = int((t <= 0).sum())
        raise CheckpointError(f"tensor {layer}.{tensor} holds {bad} zero or negative scale(s)", where=layer,
                              fix="scales must be positive; the checkpoint is corrupt or the layer was never calibrated")


@torch.no_grad()
def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """In place: replace every QuantLinear by an ``nn.Linear`` holding its dequantized weight, and every
    QuantExperts by the HF experts module it replaced, holding the dequantized experts (the "dequantized
    bf16 reference" compiled outputs are compared with). Activations are not quantized in the result.
    Returns ``model``."""
    for name, mod in list(model.named_modules()):
        parent, _, leaf = name.rpartition(".")
        if hasattr(mod, "dequantized"):  # a QuantExperts
            setattr(model.get_submodule(parent) if parent else model, leaf, mod.dequantized(dtype))
            continue
        if not isinstance(mod, QuantLinear):
            continue
        w = quant_math.dequantize_weight(mod.weight, mod.weight_scale, parse_scheme_key(mod.scheme_key).weight,
                                         getattr(mod, "weight_global_scale", None),
                                         getattr(mod, "weight_zero_point", None), getattr(mod, "weight_g_idx", None),
                                         k=mod.in_features)
        lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device=w.device, dtype=dtype)
        lin.weight.copy_(w.to(dtype))
        if mod.bias is not None:
            lin.bias.copy_(mod.bias)
        setattr(model.get_submodule(parent) if parent else model, leaf, lin)
    return model
