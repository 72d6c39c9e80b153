"""The one normalized description of a layer's quantization.

Every checkpoint format (ModelOpt, compressed-tensors, Quark, online FP8) is only a parser into these
frozen dataclasses; passes, the loader and the kernel registry never look at a producer's config.

Conventions (canonical, whatever the producer wrote on disk):

* A quantized weight is ``W[n, k] ≈ q[n, k] · s[n, k] · g`` where ``q`` is the element code, ``s``
  the scale broadcast from its granularity and ``g`` the optional global scale. The global scale
  always *multiplies* (ModelOpt ``weight_scale_2`` as stored; compressed-tensors
  ``weight_global_scale`` is the reciprocal and is inverted at load, see :class:`TensorSpec`).
  With zero points: ``W = (q - z) · s``.
* Activations are quantized the same way: ``x ≈ q_x · s_x (· g_x)``.
* Shapes of the canonical tensors (``N`` = out_features, ``K`` = in_features) are given by
  :func:`canonical_shape`. A checkpoint tensor is accepted when it has the same number of elements
  and the same shape once size-1 dims are dropped (so ModelOpt's 4-D ``[N/128, 1, K/128, 1]`` block
  scale and compressed-tensors' ``[N, 1]`` channel scale both normalize to ``[N/128, K/128]`` / ``[N]``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace


class QDtype(str, enum.Enum):
    """Element type of a quantized tensor."""

    FP8_E4M3 = "fp8_e4m3"
    INT8 = "int8"
    INT4 = "int4"
    FP4_E2M1 = "fp4_e2m1"
    FP6_E3M2 = "fp6_e3m2"
    FP6_E2M3 = "fp6_e2m3"

    @property
    def bits(self) -> int:
        return {"fp8_e4m3": 8, "int8": 8, "int4": 4, "fp4_e2m1": 4, "fp6_e3m2": 6, "fp6_e2m3": 6}[self.value]

    @property
    def max(self) -> float:
        """Largest representable magnitude (symmetric integer range for ints)."""
        return {"fp8_e4m3": 448.0, "int8": 127.0, "int4": 7.0, "fp4_e2m1": 6.0,
                "fp6_e3m2": 28.0, "fp6_e2m3": 7.5}[self.value]


class ScaleDtype(str, enum.Enum):
    FP32 = "fp32"  # fp32 (compressed-tensors' bf16/fp16 scales are widened to fp32 at load, exactly)
    FP8_E4M3 = "fp8_e4m3"  # NVFP4 per-16 block scales
    E8M0 = "e8m0"  # OCP MX power-of-two scales, stored as uint8 biased exponents


class Granularity(str, enum.Enum):
    TENSOR = "tensor"  # one scale
    CHANNEL = "channel"  # one per output row (weights)
    TOKEN = "token"  # one per row of x (activations, dynamic)
    GROUP = "group"  # one per `group_size` consecutive elements along K
    BLOCK = "block"  # one per (block_n x block_k) tile (weights)


class Packing(str, enum.Enum):
    """How element codes sit in the stored weight tensor (always packed along K)."""

    NONE = "none"  # one code per element, stored in its own dtype (fp8 / int8)
    INT32 = "int32"  # compressed-tensors pack-quantized: 32/bits codes per int32, code j at bits*j, offset q + 2^(bits-1)
    UINT8 = "uint8"  # two e2m1 codes per byte, low nibble = even element (NVFP4 / MXFP4 in every producer)
    UINT8_FP6 = "uint8_fp6"  # four 6-bit codes in three bytes (Quark MXFP6)

    def storage_cols(self, k: int, bits: int) -> int:
        if self is Packing.NONE:
            return k
        if self is Packing.INT32:
            return k * bits // 32
        if self is Packing.UINT8:
            return k // 2
        return k * 6 // 8


@dataclass(frozen=True)
class ScaleSpec:
    granularity: Granularity
    dtype: ScaleDtype = ScaleDtype.FP32
    group_size: int = 0  # GROUP only
    block: tuple[int, int] = (0, 0)  # BLOCK only: (block_n, block_k)

    def key(self) -> str:
        g = self.granularity.value
        if self.granularity is Granularity.GROUP:
            g += str(self.group_size)
        elif self.granularity is Granularity.BLOCK:
            g += f"{self.block[0]}x{self.block[1]}"
        return g if self.dtype is ScaleDtype.FP32 else f"{g}:{self.dtype.value}"


# Elements per chunk of a weight row in the tiled order, by weight bits: the k one warp of wo_mma streams per step.
TILE_K = {4: 128, 8: 64}


@dataclass(frozen=True)
class WeightSpec:
    dtype: QDtype
    scale: ScaleSpec
    packing: Packing = Packing.NONE
    global_scale: bool = False
    zero_point: bool = False  # asymmetric: W = (q - z) * s
    act_order: bool = False  # a g_idx maps each input column to its scale group
    # The weight's words are in wo_mma's streaming order (kernels/quant_math.py: tile_weight): a
    # permutation of the canonical [N, K/EPW] words, made once at load on GPUs. K is stored padded to whole
    # chunks (:meth:`stored_k`): zero words, and for the weight's scales / zero points neutral values (1.0 /
    # 0) up to Kp / group; the pad's products are zero because the kernels read x as zeros there.
    tiled: bool = False
    # An act-order weight whose input columns were sorted by group once at load
    # (quant_math.sort_act_order): stored column j is original column g_idx[j], and column j uses
    # group j // group_size. The op computes x[:, g_idx] @ W_stored^T.
    k_sorted: bool = False

    def stored_k(self, k: int) -> int:
        """The K a weight of ``k`` input features is stored with: ``k``, or for a tiled weight ``k`` rounded up
        to whole chunks of :data:`TILE_K` elements."""
        if not self.tiled:
            return k
        c = TILE_K[self.dtype.bits]
        return -(-k // c) * c

    def key(self) -> str:
        parts = [self.dtype.value, self.scale.key()]
        if self.packing is not Packing.NONE:
            parts.append("pack=" + self.packing.value)
        if self.global_scale:
            parts.append("global")
        if self.zero_point:
            parts.append("zp")
        if self.act_order:
            parts.append("actorder")
        if self.tiled:
            parts.append("tiled")
        if self.k_sorted:
            parts.append("ksorted")
        return "/".join(parts)


@dataclass(frozen=True)
class ActSpec:
    """How activations are quantized before the matmul. ``None`` in a scheme means not at all."""

    dtype: QDtype
    dynamic: bool
    scale: ScaleSpec  # TENSOR (static or dynamic), TOKEN, GROUP (1 x g, dynamic)
    global_scale: bool = False  # NVFP4: a static per-tensor global scale from the checkpoint
    symmetric: bool = True

    def key(self) -> str:
        parts = [self.dtype.value, "dynamic" if self.dynamic else "static", self.scale.key()]
        if self.global_scale:
            parts.append("global")
        if not self.symmetric:
            parts.append("asym")
        return "/".join(parts)


@dataclass(frozen=True)
class QuantScheme:
    """What a kernel needs to know: the weight and activation quantization of one matmul."""

    weight: WeightSpec
    act: ActSpec | None = None

    @property
    def key(self) -> str:
        """Stable, human-readable and parseable (:func:`parse_scheme_key`); carried by custom ops."""
        return f"w={self.weight.key()};a={self.act.key() if self.act else 'none'}"

    def __str__(self) -> str:
        return self.key


# -- canonical tensors ---------------------------------------------------------------------------

ROLES = (
    "weight",  # element codes (packed per WeightSpec.packing)
    "weight_scale",
    "weight_global_scale",
    "weight_zero_point",
    "weight_g_idx",
    "input_scale",  # static activation scale (per tensor)
    "input_global_scale",  # NVFP4 activation global scale
    "weight_shape",  # compressed-tensors pack-quantized: the unpacked [N, K], int64
    # A symmetric scheme's all-zero zero points that a producer stores anyway (Quark): checked to be zero
    # at load, never read, written back as zeros.
    "unused_weight_zero_point",
    "unused_input_zero_point",
)


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor of a layer: its canonical role and its name on disk (the suffix after
    the module name). ``reciprocal``: the file stores 1/x of the canonical value. ``packed_rows``: the
    file stores int codes packed along dim 0 (out_features) like the weight's own words, 32/bits per
    int32 with offset 2^(bits-1), code i of a column at bits bits*(i % (32/bits)) of word i // (32/bits)
    (compressed-tensors' asymmetric pack-quantized zero points); unpacked at load. ``int4_order``: the
    file's int32 words hold two's-complement int4 codes, nibble i holding code ``int4_order[i]`` of its
    eight (Quark); converted to the canonical INT32 word at load and back when saving. ``blocks``: the
    file splits a group-scaled weight's packed row into [K/g, g·bits/8], one row of bytes per scale group
    (gpt-oss ``*_blocks``: [N, K/32, 16]); the same bytes in the same order."""

    role: str
    name: str
    reciprocal: bool = False
    optional: bool = False
    packed_rows: bool = False
    int4_order: tuple[int, ...] = ()
    blocks: bool = False

    def __post_init__(self):
        if self.role not in ROLES:
            raise AssertionError(f"unknown tensor role {self.role!r}")


@dataclass(frozen=True)
class LayerQuant:
    """A resolved layer: the scheme, how its tensors are named on disk, and where it came from."""

    scheme: QuantScheme
    tensors: tuple[TensorSpec, ...]
    source: str  # e.g. "modelopt FP8", "compressed-tensors config_groups.group_0"
    online: bool = False  # weights arrive in bf16/fp16 and are quantized by qcompile at load / compile

    def tensor(self, role: str) -> TensorSpec | None:
        return next((t for t in self.tensors if t.role == role), None)

    def with_scheme(self, scheme: QuantScheme) -> "LayerQuant":
        return replace(self, scheme=scheme)


def canonical_shape(role: str, scheme: QuantScheme, n: int, k: int) -> tuple[int, ...]:
    """Shape of a canonical tensor for a [n, k] linear weight (see module docstring)."""
    w = scheme.weight
    if role != "weight_g_idx":
        k = w.stored_k(k)
    if role == "weight":
        return (n, w.packing.storage_cols(k, w.dtype.bits))
    if role in ("weight_scale", "weight_zero_point", "unused_weight_zero_point"):
        s = w.scale
        if s.granularity is Granularity.TENSOR:
            return ()
        if s.granularity is Granularity.CHANNEL:
            return (n,)
        if s.granularity is Granularity.GROUP:
            return (n, math.ceil(k / s.group_size))
        if s.granularity is Granularity.BLOCK:
            return (math.ceil(n / s.block[0]), math.ceil(k / s.block[1]))
        raise AssertionError(f"weight scale granularity {s.granularity} has no shape")
    if role in ("weight_global_scale", "input_scale", "input_global_scale", "unused_input_zero_point"):
        return ()
    if role == "weight_g_idx":
        return (k,)
    if role == "weight_shape":
        return (2,)
    raise AssertionError(f"unknown role {role!r}")


def disk_shape(spec: TensorSpec, scheme: QuantScheme, n: int, k: int) -> tuple[int, ...]:
    """Shape of ``spec``'s tensor in the checkpoint: the canonical one, or for ``packed_rows`` its rows
    packed 32/bits per int32 (a per-channel [N] tensor is stored [N, 1] before packing), or for ``blocks``
    its rows split per scale group."""
    shape = canonical_shape(spec.role, scheme, n, k)
    if spec.blocks:
        g = scheme.weight.scale.group_size
        return (*shape[:-1], math.ceil(k / g), g * scheme.weight.dtype.bits // 8)
    if not spec.packed_rows:
        return shape
    per = 32 // scheme.weight.dtype.bits
    return (math.ceil(n / per), *(shape[1:] if len(shape) == 2 else (1,)))


def squeezed(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def shape_matches(disk_shape, canonical) -> bool:
    """True when a checkpoint tensor of ``disk_shape`` holds a canonical tensor of ``canonical``."""
    return math.prod(disk_shape) == math.prod(canonical) and squeezed(disk_shape) == squeezed(canonical)


# -- KV cache ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVCacheSpec:
    """The KV-cache quantization a checkpoint declares. ``scale_names``: where the producer stores a
    layer's key and value scales, relative to its attention module (ModelOpt ``k_proj.k_scale`` /
    ``v_proj.v_scale``, compressed-tensors ``k_scale`` / ``v_scale``, Quark ``k_proj.output_scale`` /
    ``v_proj.output_scale``). A scale *multiplies*: ``K ≈ q_k · k_scale`` (amax / 448 for fp8).
    ``per_head``: one scale per KV head (compressed-tensors ``attn_head``) instead of one per layer."""

    dtype: QDtype
    scale_names: tuple[str, str] = ("k_scale", "v_scale")
    source: str = ""
    per_head: bool = False


# -- parsing scheme keys back (custom ops carry the key string) ---------------------------------

def _parse_scale(text: str) -> ScaleSpec:
    gran, _, dt = text.partition(":")
    dtype = ScaleDtype(dt) if dt else ScaleDtype.FP32
    if gran.startswith("group"):
        return ScaleSpec(Granularity.GROUP, dtype, group_size=int(gran[5:]))
    if gran.startswith("block"):
        bn, bk = gran[5:].split("x")
        return ScaleSpec(Granularity.BLOCK, dtype, block=(int(bn), int(bk)))
    return ScaleSpec(Granularity(gran), dtype)


_KEY_CACHE: dict[str, QuantScheme] = {}


def parse_scheme_key(key: str) -> QuantScheme:
    """Inverse of :attr:`QuantScheme.key`."""
    if key in _KEY_CACHE:
        return _KEY_CACHE[key]
    w_text, a_text = key.split(";")
    assert w_text.startswith("w=") and a_text.startswith("a=")
    wparts = w_text[2:].split("/")
    flags = set(wparts[2:])
    packing = next((Packing(f[5:]) for f in flags if f.startswith("pack=")), Packing.NONE)
    weight = WeightSpec(QDtype(wparts[0]), _parse_scale(wparts[1]), packing,
                        global_scale="global" in flags, zero_point="zp" in flags,
                        act_order="actorder" in flags, tiled="tiled" in flags, k_sorted="ksorted" in flags)
    act = None
    if a_text != "a=none":
        aparts = a_text[2:].split("/")
        aflags = set(aparts[3:])
        act = ActSpec(QDtype(aparts[0]), aparts[1] == "dynamic", _parse_scale(aparts[2]),
                      global_scale="global" in aflags, symmetric="asym" not in aflags)
    scheme = QuantScheme(weight, act)
    _KEY_CACHE[key] = scheme
    return scheme


# -- the schemes of the reference, by name (parsers and tests use these) -----------------------

FP8_TENSOR = ScaleSpec(Granularity.TENSOR)


def fp8_scheme(weight: str, act: str | None, block: int = 128) -> QuantScheme:
    """FP8 W8A8 schemes. weight: tensor | channel | block; act: static_tensor | dynamic_tensor |
    dynamic_token | dynamic_group | None (weight-only)."""
    wscale = {"tensor": FP8_TENSOR, "channel": ScaleSpec(Granularity.CHANNEL),
              "block": ScaleSpec(Granularity.BLOCK, block=(block, block))}[weight]
    acts = {
        None: None,
        "static_tensor": ActSpec(QDtype.FP8_E4M3, False, FP8_TENSOR),
        "dynamic_tensor": ActSpec(QDtype.FP8_E4M3, True, FP8_TENSOR),
        "dynamic_token": ActSpec(QDtype.FP8_E4M3, True, ScaleSpec(Granularity.TOKEN)),
        "dynamic_group": ActSpec(QDtype.FP8_E4M3, True, ScaleSpec(Granularity.GROUP, group_size=block)),
    }
    return QuantScheme(WeightSpec(QDtype.FP8_E4M3, wscale), acts[act])


NVFP4_WEIGHT = WeightSpec(QDtype.FP4_E2M1, ScaleSpec(Granularity.GROUP, ScaleDtype.FP8_E4M3, group_size=16),
                          Packing.UINT8, global_scale=True)
NVFP4_ACT = ActSpec(QDtype.FP4_E2M1, True, ScaleSpec(Granularity.GROUP, ScaleDtype.FP8_E4M3, group_size=16),
                    global_scale=True)
MXFP4_WEIGHT = WeightSpec(QDtype.FP4_E2M1, ScaleSpec(Granularity.GROUP, ScaleDtype.E8M0, group_size=32),
                          Packing.UINT8)
MXFP8_WEIGHT = WeightSpec(QDtype.FP8_E4M3, ScaleSpec(Granularity.GROUP, ScaleDtype.E8M0, group_size=32))


def mx_act(dtype: QDtype) -> ActSpec:
    return ActSpec(dtype, True, ScaleSpec(Granularity.GROUP, ScaleDtype.E8M0, group_size=32))


__all__ = [
    "QDtype", "ScaleDtype", "Granularity", "Packing", "ScaleSpec", "WeightSpec", "ActSpec",
    "QuantScheme", "TensorSpec", "LayerQuant", "KVCacheSpec", "ROLES", "canonical_shape",
    "shape_matches", "disk_shape", "parse_scheme_key", "fp8_scheme", "NVFP4_WEIGHT", "NVFP4_ACT", "MXFP4_WEIGHT",
    "MXFP8_WEIGHT", "mx_act", "field",
]
