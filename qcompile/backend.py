"""The ``qcompile`` torch.compile backend.

``torch.compile(model, backend="qcompile")`` works right after ``pip install`` (the package registers
the ``torch_dynamo_backends`` entry point) and, from a source checkout too, once qcompile is imported
(:func:`register_dynamo_backend`). Options, either way::

    torch.compile(model, backend="qcompile", options={"inner": "aot_eager"})
    torch.compile(model, backend=qcompile.backend(inner="inductor", kernels={"*.down_proj": "reference"},
                                                  online="fp8_per_block", cudagraphs=True))

Pipeline on the graph Dynamo hands over: the passes in order (:meth:`QCompileBackend.passes`: the Fuse
pass ``qcompile.passes.fuse_linears`` (off with ``fuse=False``), the Linear pass ``qcompile.passes.linear``,
the Experts pass ``qcompile.passes.experts``, then the decode-attention pass ``qcompile.passes.attention`` (off
with ``gqa_decode=False``), the counter pass ``qcompile.passes.counters`` (off with ``batch_counters=False``),
and under inductor the top-k pass ``qcompile.passes.topk`` (off with
``small_topk=False``) and the small-linear pass ``qcompile.passes.small_linear`` (off with ``small_linear=False``)),
then the inner compiler, on the graph less the inputs whose
tensors the Fuse pass made views of its fused constants (nothing reads them any more). ``qcompile.explain()``
(or ``backend_instance.explain()``) prints what matched.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ConfigError, QCompileError

log = logging.getLogger("qcompile")

INNER = ("inductor", "aot_eager", "eager")
NAME = "qcompile"  # torch.compile(model, backend=NAME)


@dataclass
class Options:
    inner: str = "inductor"  # the compiler that runs after qcompile's passes
    kernels: str | dict[str, str] | None = None  # kernel override: a name, or {module glob: name}
    online: str | None = None  # "fp8_per_tensor" | "fp8_per_block": quantize bf16 linears at compile time
    ignore: list[str] = field(default_factory=list)  # online: modules to leave alone
    fuse: bool = True  # run linears that share an input (q/k/v, gate/up) as one matmul
    gqa_decode: bool = True  # one-token grouped-query attention reads each key / value head once
    batch_counters: bool = True  # the cache layers' length-counter increments as one add at the graph's end
    small_topk: bool = True  # inductor on CUDA: a router's top-k as selection steps fused into one kernel
    small_linear: bool = True  # inductor on CUDA: a decode-size linear with few outputs (a router) as a reduction
    fp8_gemv: bool = True  # inductor: fp8_inductor's matmul on qcompile::fp8_gemv where its tuning table chose it
    cudagraphs: bool = False  # inductor: capture CUDA graphs (like mode="reduce-overhead")
    inductor_config: dict[str, Any] = field(default_factory=dict)
    on_graph: Callable | None = None  # test hook: called with (gm before the pass as code, gm after)

    @classmethod
    def make(cls, options: dict | None) -> "Options":
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown qcompile option(s) {unknown}", where="torch.compile(options=...)",
                              fix=f"qcompile takes {sorted(known)}")
        flags = [f.name for f in dataclasses.fields(cls) if isinstance(f.default, bool)]
        for name in flags:
            if name in options and not isinstance(options[name], bool):
                raise ConfigError(f"option {name} must be True or False, got {options[name]!r}",
                                  where=f"options.{name}", fix=f"pass {name}=True or {name}=False")
        opts = cls(**options)
        if opts.inner not in INNER:
            raise ConfigError(f"unknown inner compiler {opts.inner!r}", where="options.inner", fix=f"use one of {INNER}")
        if opts.inductor_config:
            import torch._inductor.config as inductor_config
            for key in opts.inductor_config:
                try:
                    inductor_config._is_default(key)
                except KeyError:
                    raise ConfigError(f"inductor has no config entry {key!r}", where="options.inductor_config",
                                      fix="use a name of torch._inductor.config, e.g. 'triton.enable_pdl'") from None
        return opts


class QCompileBackend:
    """A configured backend; callable as a torch.compile backend. ``rows`` collects the explain rows
    of every graph it compiled."""

    def __init__(self, **options):
        self.options = Options.make(options)
        self._rows: dict = {}  # module -> ExplainRow (a recompile of the same graph replaces its rows)
        self._online = None
        self._by_options: dict[str, QCompileBackend] = {}
        self.compiled_with: list[dict] = []  # inductor's config patches of each graph compiled under inductor
        if self.options.online is not None:
            from .formats import parse_quant_config
            from .formats.online import online_config
            self._online = parse_quant_config(online_config(self.options.online, ignore=self.options.ignore))

    def __call__(self, gm, example_inputs, options: dict | None = None, **kwargs):
        from .passes.fuse_linears import drop_shared_inputs

        if options:  # torch.compile(..., backend="qcompile", options={...}): one instance per options
            key = repr(sorted(options.items()))
            if key not in self._by_options:
                self._by_options[key] = QCompileBackend(**{**self._given(), **options})
            return self._by_options[key](gm, example_inputs)
        before = gm.code if self.options.on_graph else None
        for lower in self.passes():
            self._rows.update((r.module, r) for r in lower(gm, example_inputs))
        _LAST.clear()
        _LAST.extend(self.rows)
        inputs, keep = drop_shared_inputs(gm, example_inputs)
        if self.options.on_graph:
            self.options.on_graph(before, gm.code)
        compiled = self._inner(gm, inputs)
        return compiled if keep is None else _KeptInputs(compiled, keep, len(example_inputs))

    def passes(self) -> list:
        """The lowering passes, in the order they run: each rewrites the graph in place and returns its
        explain rows."""
        from .passes.attention import rewrite_gqa_decode
        from .passes.counters import batch_counter_increments
        from .passes.experts import lower_experts
        from .passes.fuse_linears import fuse_linears
        from .passes.linear import lower_linears
        from .passes.small_linear import rewrite_small_linears
        from .passes.topk import rewrite_small_topk

        kernels = self.options.kernels
        fuse = [lambda gm, ex: fuse_linears(gm, ex, kernels=kernels, online=self._online)] if self.options.fuse else []
        gqa = [rewrite_gqa_decode] if self.options.gqa_decode else []
        gqa += [batch_counter_increments] if self.options.batch_counters else []
        inner = self.options.inner
        topk = [rewrite_small_topk] if self.options.small_topk and inner == "inductor" else []
        small = [rewrite_small_linears] if self.options.small_linear and inner == "inductor" else []
        return fuse + [lambda gm, ex: lower_linears(gm, ex, kernels=kernels, online=self._online, compiler=inner),
                       lambda gm, ex: lower_experts(gm, ex, kernels=kernels, online=self._online)] + gqa + topk + small

    @property
    def rows(self) -> list:
        return list(self._rows.values())

    def _given(self) -> dict:
        return {f.name: getattr(self.options, f.name) for f in dataclasses.fields(Options)}

    def _inner(self, gm, example_inputs):
        inner = self.options.inner
        if inner == "eager":
            return gm.forward
        if inner == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend
            return lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.decomposition import select_decomp_table

        from .kernels import fp8
        patches = inductor_patches(self.options, example_inputs)
        # kernels whose op inductor replaces by graph ops (fp8_inductor), so they fuse with their neighbours
        decompositions = {**select_decomp_table(), **fp8.decompositions(self.options.fp8_gemv)}
        keyed = _with_decisions_keyed(patches, self.options, example_inputs)
        compiled = None
        if patches.get("combo_kernels") and "combo_kernels" not in self.options.inductor_config:
            try:
                compiled = compile_fx(gm, example_inputs, config_patches=keyed, decompositions=decompositions)
            except QCompileError:
                raise
            except Exception as e:  # combo kernels, which the backend chose, fail on some graphs in some versions
                log.warning("inductor failed with combo kernels on (%s: %s); compiling this graph without them",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                patches = {**patches, "combo_kernels": False}
                keyed = {**keyed, "combo_kernels": False}
        if compiled is None:
            compiled = compile_fx(gm, example_inputs, config_patches=keyed, decompositions=decompositions)
        self.compiled_with.append(patches)
        return compiled

    def explain(self) -> str:
        return format_explain(self.rows)


def inductor_patches(options: Options, example_inputs) -> dict:
    """Inductor's config patches for a graph: the user's ``inductor_config``, CUDA graphs on request, and on
    CUDA:

    * programmatic dependent launch for inductor's Triton kernels on sm_90+ GPUs (each kernel waits for
      the previous one only before its first dependent read, so its launch overlaps the previous kernel's
      tail; the weight-only kernel does the same). ``QCOMPILE_PDL=0``, ``TORCHINDUCTOR_ENABLE_PDL`` or an
      ``inductor_config`` entry ``triton.enable_pdl`` decides instead;
    * with CUDA graphs (a decode step), combo kernels (``combo_kernels``): independent small kernels launched
      as one, such as a decoder layer's rotary embedding of q and k, its cache writes and its attention mask.
      An ``inductor_config`` entry ``combo_kernels`` decides instead.

    Where inductor's config has a setting on already, it is left as it is. Whether the caller set inductor's
    config is not asked: every compile with config patches (this backend's, ``mode="max-autotune"``'s...)
    leaves its entries marked as set once it ends, so that after the first graph of a process every later
    graph would look as if the caller had decided."""
    import os

    import torch
    import torch._inductor.config as inductor_config

    from .kernels.wo_policy import pdl_default

    patches = dict(options.inductor_config)
    if options.cudagraphs:
        patches["triton.cudagraphs"] = True
    cuda = [t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
    if not cuda:
        return patches
    decided = ("triton.enable_pdl" in patches or "TORCHINDUCTOR_ENABLE_PDL" in os.environ
               or inductor_config.triton.enable_pdl)
    if not decided and pdl_default(torch.cuda.get_device_capability(cuda[0])):
        patches["triton.enable_pdl"] = True
    if options.cudagraphs and "combo_kernels" not in patches and not inductor_config.combo_kernels:
        patches["combo_kernels"] = True
    return patches


def _with_decisions_keyed(patches: dict, options: Options, example_inputs) -> dict:
    """``patches`` plus a post-grad pass that changes nothing and whose uuid names what the decompositions decide
    from outside the graph (the ``fp8_gemv`` option, the GEMV's tuning-table entries for the GPU): inductor's
    and AOTAutograd's caches key on the graph and the config, not on the decompositions, and would otherwise
    hand a graph compiled under other choices back. Not where the config has such a pass already."""
    import torch
    import torch._inductor.config as inductor_config

    from .kernels import fp8_gemv

    if "post_grad_custom_post_pass" in patches or inductor_config.post_grad_custom_post_pass is not None:
        return patches
    cuda = [t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
    key = f"qcompile fp8_gemv={options.fp8_gemv} tables={fp8_gemv.fingerprint(cuda[0]) if cuda else '-'}"
    return {**patches, "post_grad_custom_post_pass": _decision_key_class()(key)}


@functools.lru_cache(maxsize=None)
def _decision_key_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass  # (inductor is imported late)

    class DecisionKey(CustomGraphPass):
        def __init__(self, key: str):
            self.key = key

        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return self.key

    return DecisionKey


class _KeptInputs:
    """A compiled graph some of whose ``n`` inputs the passes removed (``drop_shared_inputs``). Dynamo calls it
    with the inputs of the graph as the passes left it (it reads the placeholders after compiling); a caller
    that passes all ``n`` has those removed left out."""

    def __init__(self, compiled, keep: list[int], n: int):
        self.compiled, self.keep, self.n = compiled, keep, n

    def __call__(self, *args):
        return self.compiled(*([args[i] for i in self.keep] if len(args) == self.n else args))


_LAST: list = []
_DEFAULT = None


def qcompile_backend(gm, example_inputs, options: dict | None = None, **kwargs):
    """The entry point torch.compile finds by name."""
    global _DEFAULT
    if _DEFAULT is None:
        import qcompile  # noqa: F401  (registers the ops and the transformers integration)
        _DEFAULT = QCompileBackend()
    return _DEFAULT(gm, example_inputs, options=options, **kwargs)


def register_dynamo_backend() -> None:
    """Register ``qcompile_backend`` under the name "qcompile" with Dynamo (at ``import qcompile``), for
    when the entry point is not installed. Not when torch already has the name, or knows the entry
    point: then torch loads it (which imports qcompile, so comes here) and registers it itself, and a
    second registration would be refused as a duplicate."""
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry

    if NAME in registry._COMPILER_FNS or isinstance(registry._BACKENDS.get(NAME), EntryPoint):
        return
    registry.register_backend(qcompile_backend, name=NAME)


def backend(**options) -> QCompileBackend:
    """A configured backend: ``torch.compile(model, backend=qcompile.backend(inner="aot_eager"))``."""
    return QCompileBackend(**options)


def format_explain(rows) -> str:
    headers = ("module", "scheme", "op", "kernel", "why not faster")
    table = [headers] + [(r.module, r.scheme, r.op, r.kernel, r.reason) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(headers))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def explain() -> str:
    """The explain table of the most recent qcompile compilation in this process."""
    return format_explain(_LAST)
