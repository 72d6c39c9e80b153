"""What every checkpoint-format parser produces: a :class:`QuantConfig` that resolves module names to
:class:`~qcompile.scheme.LayerQuant` (or ``None`` for "leave this layer in bf16").

A parser is one file in this package with one entry point ``parse(config: dict) -> QuantConfig``. It
validates the config completely at parse time and raises :class:`~qcompile.errors.ConfigError`
naming the key and the fix; it never touches tensors or kernels.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal

try:  # the regex parser (Python 3.11+ / 3.10)
    from re import _constants as sre, _parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants as sre
    import sre_parse

from ..errors import ConfigError
from ..scheme import KVCacheSpec, LayerQuant

ModuleKind = Literal["linear", "moe"]

# Model-side fused modules and the checkpoint shards they hold (vLLM's packed_modules_mapping).
# Used to resolve a fused layer from its shards' entries and to refuse shards that disagree.
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
}


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def shard_names(module_name: str) -> list[str]:
    """``a.b.qkv_proj`` -> ``[a.b.q_proj, a.b.k_proj, a.b.v_proj]``; an unfused name -> ``[]``."""
    base, _, leaf = module_name.rpartition(".")
    shards = FUSED_SHARDS.get(leaf, ())
    return [f"{base}.{s}" if base else s for s in shards]


class QuantConfig(ABC):
    """A parsed checkpoint quantization config.

    ``format`` names the producer format ("modelopt", "compressed-tensors", "quark", "mxfp4", "online").
    ``kv_cache`` is the KV-cache quantization the checkpoint declares, if any.
    ``raw`` is the config dict as read, kept so the model can be saved / reported unchanged.
    ``fused_experts``: the format stores a MoE layer's quantized experts fused, one tensor per parameter of
    the transformers experts module and tensor name, ``<experts>.<gate_up_proj|down_proj>_<name>`` [E, ...]
    (gpt-oss), instead of per expert.
    """

    format: str = ""
    fused_experts: bool = False

    def __init__(self, raw: dict[str, Any], kv_cache: KVCacheSpec | None = None):
        self.raw = raw
        self.kv_cache = kv_cache
        self._cache: dict[tuple[str, str], LayerQuant | None] = {}

    def resolve(self, module_name: str, kind: ModuleKind = "linear",
                projections: tuple[str, str, str] = EXPERT_PROJECTIONS) -> LayerQuant | None:
        """The quantization of ``module_name`` (an HF module path such as
        ``model.layers.0.self_attn.q_proj``), or ``None`` when the layer stays unquantized
        (excluded, ignored, or matched by no rule). ``kind="moe"`` asks about a fused-experts module
        (e.g. ``model.layers.0.mlp.experts``) whose experts the checkpoint names
        ``<module>.<e>.<projection>`` with ``projections`` (gate, up, down): ``gate_proj / up_proj /
        down_proj``, Mixtral's ``w1 / w3 / w2``. Raises ConfigError for contradictions (e.g. the shards
        of a fused layer resolving to different schemes)."""
        key = (module_name, kind, projections if kind == "moe" else None)
        if key not in self._cache:
            self._cache[key] = self._resolve_moe(module_name, projections) if kind == "moe" else \
                self._resolve(module_name, kind)
        return self._cache[key]

    @abstractmethod
    def _resolve(self, module_name: str, kind: ModuleKind) -> LayerQuant | None: ...

    def _resolve_moe(self, module_name: str, projections: tuple[str, str, str]) -> LayerQuant | None:
        """A fused-experts module: by default as its expert 0's projections resolve (:func:`resolve_experts`)."""
        return resolve_experts(module_name, lambda n: self.resolve(n, "linear"), projections)

    def describe(self) -> str:
        return self.format

    def resolve_fused(self, module_name: str, kind: ModuleKind, resolve_one) -> LayerQuant | None:
        """Shared fused-layer rule: a fused module resolves through its shards when it has no entry of
        its own; all shards must agree. ``resolve_one(name)`` resolves a single name."""
        own = resolve_one(module_name)
        if own is not None:
            return own
        shards = shard_names(module_name)
        if not shards:
            return None
        found = {s: resolve_one(s) for s in shards}
        schemes = {lq.scheme.key if lq else None for lq in found.values()}
        if len(schemes) > 1:
            detail = ", ".join(f"{s}: {lq.scheme.key if lq else 'unquantized'}" for s, lq in found.items())
            raise ConfigError(
                f"the shards of the fused layer resolve to different quantization ({detail})",
                where=module_name,
                fix="all shards of a fused layer must share one scheme; fix the config's per-layer entries",
            )
        return next(iter(found.values()))


def require_type(value: Any, types, where: str, what: str, fix: str):
    """Raise ConfigError unless ``value`` is an instance of ``types`` (bool is not an int here)."""
    tlist = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in tlist:
        ok = False
    else:
        ok = isinstance(value, tlist)
    if not ok:
        names = " or ".join(t.__name__ for t in tlist)
        raise ConfigError(f"{what} must be {names}, got {type(value).__name__} {value!r:.80}", where=where, fix=fix)
    return value


def need(ok: bool, where: str, what: str, fix: str, error: type = ConfigError) -> None:
    """Raise ``error`` (ConfigError: malformed; UnsupportedError: well-formed, not representable)."""
    if not ok:
        raise error(what, where=where, fix=fix)


@dataclass(frozen=True)
class NamePattern:
    """A module-name pattern: ``re:<regex>`` (``re.match``), an fnmatch glob (only where the format
    has them and the text holds ``*?[``), else an exact name."""

    text: str
    regex: re.Pattern | None = None

    @classmethod
    def compile(cls, text: Any, where: str, globs: bool = False) -> "NamePattern":
        fix = 'write a module name, "re:<regex>"' + (' or an fnmatch glob' if globs else '')
        require_type(text, str, where, "a module name pattern", fix)
        if not text:
            raise ConfigError("the pattern is empty", where=where, fix=fix)
        try:
            if text.startswith("re:"):
                risk = backtracking_risk(text[3:])
                if risk:
                    raise ConfigError(f"the pattern {text!r:.80} can backtrack for hours on one name: {risk}",
                                      where=where, fix="simplify it: no repeat inside a repeat, no alternatives "
                                      f"starting alike under a repeat, at most {MAX_UNBOUNDED_REPEATS} unbounded "
                                      "repeats (e.g. 're:.*mlp' for 're:(.*)*mlp')")
                return cls(text, re.compile(text[3:]))
            if globs and any(c in text for c in "*?["):  # fnmatch's translation cannot backtrack badly
                return cls(text, re.compile(fnmatch.translate(text)))
        except (re.error, RecursionError, OverflowError) as e:
            raise ConfigError(f"invalid pattern {text!r:.80} ({e})", where=where, fix=fix) from None
        return cls(text)

    def matches(self, name: str) -> bool:
        return self.regex.match(name) is not None if self.regex else self.text == name


MAX_UNBOUNDED_REPEATS = 4  # k unbounded repeats in a row cost up to n**k steps on an n-character name
_REPEATS = tuple(getattr(sre, op) for op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(sre, op))
_NESTED = "an unbounded repeat inside an unbounded repeat"
_ALIKE = "alternatives that may start alike inside an unbounded repeat"


def backtracking_risk(regex: str) -> str | None:
    """Why ``regex`` can backtrack catastrophically, or None, judged on its parse tree: an unbounded
    repeat holding another one (``(.*)*``, ``(a+)+``: exponential), an alternation whose branches may
    start alike inside an unbounded repeat (``(a|ab)*``: exponential), or more than
    MAX_UNBOUNDED_REPEATS unbounded repeats in all, a bounded repeat multiplying those inside it
    (``.*.*.*.*.*x``, ``(.*){9}``: polynomial of that degree)."""
    found = list(_walk(sre_parse.parse(regex), 1, False))
    risk = next((f for f in found if isinstance(f, str)), None)
    if risk is None and sum(f for f in found if isinstance(f, int)) > MAX_UNBOUNDED_REPEATS:
        risk = f"more than {MAX_UNBOUNDED_REPEATS} unbounded repeats"
    return risk


def _walk(items, times: int, inside: bool):
    """Yield ``times`` for each unbounded repeat in ``items`` (run up to ``times`` times by bounded
    repeats around them) and a reason string for each risky shape (``inside``: under an unbounded repeat)."""
    for op, av in items:
        if op in _REPEATS and av[1] > 1:
            unbounded = av[1] == sre.MAXREPEAT
            if unbounded:
                yield _NESTED if inside else times
            yield from _walk(av[2], times if unbounded else times * av[1], inside or unbounded)
        elif op in _REPEATS:
            yield from _walk(av[2], times, inside)
        elif op is sre.BRANCH:
            firsts = [_first_chars(branch) for branch in av[1]]
            if inside and (None in firsts or len(set().union(*firsts)) < sum(map(len, firsts))):
                yield _ALIKE
            for branch in av[1]:
                yield from _walk(branch, times, inside)
        else:
            for sub in _subpatterns(op, av):
                yield from _walk(sub, times, inside)


def _subpatterns(op, av) -> list:
    if op is sre.SUBPATTERN:
        return [av[-1]]
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return [av[1]]
    if op is getattr(sre, "ATOMIC_GROUP", None):
        return [av]
    if op is sre.GROUPREF_EXISTS:
        return [p for p in av[1:] if p is not None]
    return []


def _first_chars(items) -> set[str] | None:
    """The characters (case folded) a match of ``items`` can start with, or None when any (or none) can."""
    if not items:
        return None
    op, av = items[0]
    if op is sre.LITERAL:
        return {chr(av).lower()}
    if op is sre.IN and all(o is sre.LITERAL for o, _ in av):
        return {chr(v).lower() for _, v in av}
    if op is sre.SUBPATTERN:
        return _first_chars(av[-1])
    if op in _REPEATS and av[0] > 0:
        return _first_chars(av[2])
    return None


def resolve_experts(name: str, resolve_linear: Callable[[str], LayerQuant | None],
                    projections: tuple[str, str, str] = EXPERT_PROJECTIONS) -> LayerQuant | None:
    """``kind="moe"`` through the experts' Linears: every producer saves MoE experts per expert
    (``experts.<e>.{gate,up,down}_proj``, Mixtral ``experts.<e>.{w1,w3,w2}``: ``projections``), so
    ``name`` resolves as expert 0's three projections do (vLLM's ``get_moe_method``). They must agree,
    as one fused kernel runs them all."""
    found = {p: resolve_linear(f"{name}.0.{p}") for p in projections}
    if len({lq.scheme.key if lq else None for lq in found.values()}) > 1:
        detail = ", ".join(f"{p}: {lq.scheme.key if lq else 'unquantized'}" for p, lq in found.items())
        raise ConfigError(f"the expert projections resolve to different quantization ({detail})", where=name,
                          fix=f"give {', '.join(projections)} of the experts one scheme (targets / ignore)")
    return found[projections[0]]
