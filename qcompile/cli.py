"""The ``qcompile`` command line (also ``python -m qcompile``): ``run``, ``explain`` and ``bench``.

``run`` and ``explain`` take a local checkpoint directory, or with none the built-in tiny Llama
(random weights, written in a producer's format to a temporary directory that is removed afterwards).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time

EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR = 0, 1, 2
DEFAULT_FORMAT = "modelopt-fp8"
ACT_NOISE_FACTOR = 1.5  # see _check: how far re-rounded quantized activations may move the logits

DESCRIPTION = """\
Run quantized HuggingFace checkpoints (ModelOpt, compressed-tensors, Quark, or bf16 quantized to
FP8 online) with torch.compile(model, backend="qcompile")."""

EPILOG = """\
examples:
  qcompile run                                the built-in tiny random model (ModelOpt FP8), on any machine
  qcompile run --format ct-nvfp4              the same in another producer's format
  qcompile run ./Llama-3.1-8B-FP8 --prompt "The capital of France is" --compare-bf16
  qcompile run ./Llama-3.1-8B --online fp8_per_block
  qcompile explain ./Llama-3.1-8B-FP8         which kernel runs each layer, and why no faster one
  qcompile bench --m 1 16 128                 FP8 linear ops against torch's own (CUDA only)

exit status:
  0  done, every check passed
  1  an accuracy check failed (the message names the check, the error and the threshold)
  2  qcompile could not run the input (a bad checkpoint, option or machine; the message says why)

`qcompile COMMAND --help` lists a command's options."""


class _Version(argparse.Action):
    """``--version``: imports torch and transformers only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import torch
        import transformers

        import qcompile
        print(f"qcompile {qcompile.__version__} (torch {torch.__version__}, transformers {transformers.__version__})")
        parser.exit()


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``run`` and ``explain`` share: which model, where, compiled how."""
    from qcompile import synth
    from qcompile.formats.online import SCHEMES

    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="a local HuggingFace checkpoint directory (config.json + safetensors); "
                        "default: the built-in tiny Llama with random weights")
    p.add_argument("--format", metavar="FORMAT", choices=synth.QUANTIZED_FORMATS,
                   help=f"the producer format the built-in tiny model is written in (default: {DEFAULT_FORMAT}); "
                        f"one of: {', '.join(synth.QUANTIZED_FORMATS)}. Not with a CHECKPOINT: it brings its own")
    p.add_argument("--online", choices=SCHEMES, default=None,
                   help="quantize a bf16/fp16 checkpoint to FP8 while loading (with no CHECKPOINT: the built-in "
                        "model in bf16)")
    p.add_argument("--device", default="auto",
                   help="where the weights go and the model runs: auto (cuda when available, else cpu), cpu, "
                        "cuda, cuda:1, ... (default: %(default)s)")
    p.add_argument("--kernel", action="append", metavar="[GLOB=]KERNEL",
                   help="force a kernel instead of the fastest one that runs: KERNEL for every layer, or "
                        "GLOB=KERNEL for the layers whose name matches GLOB (repeatable), e.g. "
                        "'*.down_proj=reference'. `qcompile explain` lists the kernels")


def build_parser() -> argparse.ArgumentParser:
    from qcompile import bench
    from qcompile.backend import INNER

    parser = argparse.ArgumentParser(prog="qcompile", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version, help="print qcompile's, torch's and transformers' versions")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run", help="load, compile, check accuracy, decode and time a checkpoint",
        description="Load a checkpoint, compile it with the qcompile backend, check the compiled logits "
                    "against the reference they should match, then decode greedily with a static KV cache "
                    "and report tokens/s. Exit status 0: checks passed; 1: a check failed; 2: qcompile error.")
    _model_arguments(run)
    run.add_argument("--prompt", default="Hello, qcompile!", help="the prompt text (default: %(default)r)")
    run.add_argument("--max-new-tokens", type=int, default=16, metavar="N",
                     help="tokens to decode; all but the first 3 are timed (default: %(default)s)")
    run.add_argument("--inner", choices=INNER, default="inductor",
                     help="the compiler that runs after qcompile's passes (default: %(default)s; aot_eager and "
                          "eager compile in seconds, for a quick check)")
    run.add_argument("--max-rel-error", type=float, default=0.1, metavar="X",
                     help="fail (exit 1) when the compiled logits differ from their reference by more than X, "
                          "relative (Frobenius). Where the kernels quantize activations the limit is at least "
                          f"{ACT_NOISE_FACTOR}x the activation quantization's own effect on the logits: the "
                          "compiler's fp32 intermediates round activations differently (default: %(default)s)")
    run.add_argument("--compare-bf16", action="store_true",
                     help="also time decoding with the same weights in bf16 (the dequantized model, or with "
                          "--online the bf16 checkpoint itself) under torch.compile with the same inner compiler "
                          "(inductor: plain torch.compile; on a GPU both with CUDA graphs) and print the ratio")
    run.set_defaults(func=cmd_run)

    explain = sub.add_parser(
        "explain", help="print which kernel runs each quantized layer, and why no faster one",
        description="Load a checkpoint, compile it, run one short forward and print the explain table: "
                    "each quantized layer's scheme, the op and kernel it was lowered to, and why each faster "
                    "kernel was passed over. No generation.")
    _model_arguments(explain)
    explain.add_argument("--inner", choices=INNER, default=None,
                         help="the compiler after qcompile's passes (default: inductor on a GPU, as torch.compile "
                              "uses it: FP8 per-tensor / channel layers run fp8_inductor only there; eager on the "
                              "CPU, where the table does not depend on it and eager compiles fastest)")
    explain.set_defaults(func=cmd_explain)

    bench_parser = sub.add_parser(
        "bench", help="time the FP8 linear ops against bf16 and torch's _scaled_mm (CUDA only)",
        description=bench.__doc__.split("\n\n")[0] + " Needs a CUDA GPU.")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "format", None) and args.checkpoint is not None:
        parser.error("--format chooses the built-in tiny model's format; a CHECKPOINT brings its own")
    if getattr(args, "format", None) and args.online:
        parser.error("--online quantizes the bf16 built-in model; --format picks a pre-quantized one: use one")
    try:
        return args.func(args)
    except Exception as e:  # a QCompileError is a message for the user, not a stack trace
        error = _qcompile_error(e)
        if error is None:
            raise
        print(f"qcompile: error: {error}", file=sys.stderr)
        return EXIT_ERROR


def _qcompile_error(e: BaseException):
    """The QCompileError behind ``e`` (torch.compile wraps a backend's errors), or None."""
    from qcompile.errors import QCompileError

    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, QCompileError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


# -- shared steps ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _checkpoint(args):
    """Yields (checkpoint path, whether its weights are random). With no CHECKPOINT: the built-in tiny
    model, written to a temporary directory that is removed on the way out, errors included."""
    if args.checkpoint is not None:
        yield args.checkpoint, False
        return
    from qcompile import synth

    fmt = "bf16" if args.online else (args.format or DEFAULT_FORMAT)
    with tempfile.TemporaryDirectory(prefix="qcompile-tiny-") as path:
        print(f"no CHECKPOINT given: the built-in tiny Llama with random weights, in {fmt} format")
        synth.write_checkpoint(path, fmt)
        yield path, True


def _load(path: str, args):
    import torch

    import qcompile

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    t0 = time.perf_counter()
    model = qcompile.load(path, device=device, online=args.online).eval()
    size = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    print(f"loaded {path} in {time.perf_counter() - t0:.1f} s: {len(model.qcompile_plan)} quantized layers, "
          f"{size / 2**20:.1f} MiB of weights on {device}")
    return model


def _kernels(args):
    """--kernel's values as qcompile.backend(kernels=...) takes them."""
    if not args.kernel:
        return None
    if len(args.kernel) == 1 and "=" not in args.kernel[0]:
        return args.kernel[0]
    return dict(item.split("=", 1) if "=" in item else ("*", item) for item in args.kernel)


def _tokenizer(path: str):
    """The checkpoint's tokenizer, else a byte-level stand-in (said so)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        from qcompile import synth
        print("the checkpoint has no tokenizer: using a byte-level stand-in")
        with tempfile.TemporaryDirectory(prefix="qcompile-tok-") as tmp:
            synth.write_tokenizer(tmp)
            return AutoTokenizer.from_pretrained(tmp)


def _activation_modes(rows) -> tuple[list[str], list[str]]:
    """The quantized layers whose scheme quantizes activations, split: (those compiled weight-only,
    explain's "activations not quantized"; those whose kernels quantize activations)."""
    from qcompile.passes.fuse_linears import shard_names
    from qcompile.passes.linear import _weight_only
    from qcompile.scheme import parse_scheme_key

    act_rows = [r for r in rows if r.op != "aten::linear" and parse_scheme_key(r.scheme).act is not None]
    weight_only = [m for r in act_rows if _weight_only(r.op) for m in shard_names(r.module)]  # fused: each shard
    return weight_only, [m for r in act_rows for m in shard_names(r.module) if m not in weight_only]


def _compile_and_call(model, ids, be):
    """Compile ``model`` with the backend ``be`` and call it on ``ids``; returns ``be`` with the
    logits (float) as ``be.logits``. Refuses a compilation that handed qcompile no quantized layer."""
    import torch

    from qcompile.errors import UnsupportedError

    torch._dynamo.reset()  # a fresh start: earlier compilations in this process count towards its limits
    with torch.no_grad():
        be.logits = torch.compile(model, backend=be, dynamic=False)(ids).logits.float()
    if model.qcompile_plan and not any(r.op != "aten::linear" for r in be.rows):
        raise UnsupportedError(
            f"torch.compile handed none of the model's {len(model.qcompile_plan)} quantized layers to qcompile "
            "(the model ran uncompiled)", where="torch.compile",
            fix="TORCH_LOGS=graph_breaks,recompiles shows why Dynamo did not capture the forward")
    return be


# -- qcompile explain -----------------------------------------------------------------------------

def cmd_explain(args) -> int:
    import torch

    import qcompile
    from qcompile.passes.fuse_linears import shard_names

    with _checkpoint(args) as (path, _):
        model = _load(path, args)
    ids = torch.arange(3, 11, device=model.device)[None] % model.config.vocab_size
    inner = args.inner or ("inductor" if model.device.type == "cuda" else "eager")
    be = _compile_and_call(model, ids, qcompile.backend(inner=inner, kernels=_kernels(args)))
    print("\n" + be.explain() + "\n")
    kernels = sorted({r.kernel for r in be.rows})
    weight_only, _ = _activation_modes(be.rows)
    layers = sum(len(shard_names(r.module)) for r in be.rows)
    matmuls = f" in {len(be.rows)} matmuls" if layers != len(be.rows) else ""
    print(f"{layers} layers{matmuls}: kernels {', '.join(kernels) or 'none'}; "
          f"{len(weight_only)} run weight-only (activations not quantized)")
    return EXIT_OK


# -- qcompile bench -------------------------------------------------------------------------------

def cmd_bench(args) -> int:
    from qcompile import bench

    bench.run(args)
    return EXIT_OK


# -- qcompile run ---------------------------------------------------------------------------------

def cmd_run(args) -> int:
    import torch

    import qcompile
    from qcompile import bench

    if args.max_new_tokens < 1:
        from qcompile.errors import ConfigError
        raise ConfigError(f"--max-new-tokens is {args.max_new_tokens}", where="qcompile run", fix="pass 1 or more")
    with _checkpoint(args) as (path, random_weights):
        model = _load(path, args)
        tok = _tokenizer(path)
        dev = model.device
        ids = tok(args.prompt, return_tensors="pt").input_ids.to(dev)
        with torch.no_grad():
            eager = model(ids).logits.float()
        t0 = time.perf_counter()
        be = _compile_and_call(model, ids, qcompile.backend(inner=args.inner, kernels=_kernels(args)))
        compiled = be.logits
        print(f"compiled in {time.perf_counter() - t0:.1f} s (first call, inner compiler {args.inner})")
        print("\n" + be.explain() + "\n")

        torch._dynamo.reset()
        graphs = dev.type == "cuda" and args.inner == "inductor"
        step = torch.compile(model.forward, dynamic=False,
                             backend=qcompile.backend(inner=args.inner, kernels=_kernels(args), cudagraphs=graphs))
        tokens, rate = bench.greedy_decode(model, step, ids, args.max_new_tokens)
        label = "random weights, so the text means nothing" if random_weights else "greedy"
        print(f"generated {args.max_new_tokens} tokens ({label}): {tok.decode(tokens[0])!r}")
        print(_rate_line(rate, f"qcompile, inner {args.inner}" + (" + CUDA graphs" if graphs else ""), args, dev))

        failed = _check(model, ids, eager, compiled, be.rows, args.max_rel_error)
        if args.compare_bf16:
            del step
            if args.online:  # the bf16 checkpoint itself; the FP8 model goes first
                model = None
                model = _load_bf16(path, dev)
            _compare_bf16(model, args, ids, rate)
    if failed:
        print(f"qcompile: check failed: {failed}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _rate_line(rate, how: str, args, dev) -> str:
    from qcompile import bench

    n = args.max_new_tokens
    if rate is None:
        return f"decode ({how}): not timed: the first 3 tokens compile; ask for more with --max-new-tokens"
    return (f"decode ({how}): {rate:.1f} tokens/s (batch 1, greedy, static KV cache, {n - 3} tokens timed) "
            f"on {bench.device_label(dev)}")


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def _dequantize(model, names=None):
    """In place: the QuantLinear layers ``names`` (default: all) become nn.Linear layers holding their
    dequantized weights. Returns ``model``."""
    import torch

    from qcompile.linear import dequantize_model

    if names is None:
        return dequantize_model(model)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        holder = torch.nn.Module()
        holder.add_module(leaf, model.get_submodule(name))
        dequantize_model(holder)
        setattr(model.get_submodule(parent) if parent else model, leaf, getattr(holder, leaf))
    return model


def _check(model, ids, eager, compiled, rows, max_rel_error: float) -> str | None:
    """Compare the compiled logits with the reference they should match and print the numbers;
    returns what failed, or None. Dequantizes ``model`` in place (it is not needed quantized after).

    The reference: the eager model where the kernels compute what the scheme says, and the weights
    dequantized with unquantized activations where they run weight-only. Where kernels quantize
    activations, a compiler's fp32 intermediates round some activations to the neighbouring code and
    the logits move by about as much as the activation quantization itself does (measured on the
    tiny models: 0.7-1.0x), so the limit is raised to ACT_NOISE_FACTOR times that effect."""
    import torch

    weight_only, act_quantized = _activation_modes(rows)
    with torch.no_grad():
        matched = _dequantize(model, weight_only)(ids).logits.float() if weight_only else eager
        reference = _dequantize(model)(ids).logits.float()
    act_effect = _rel(matched, reference) if act_quantized else 0.0
    limit = max(max_rel_error, ACT_NOISE_FACTOR * act_effect)
    from qcompile.passes.fuse_linears import shard_names

    name, expect = _reference(sum(len(shard_names(r.module)) for r in rows if r.op != "aten::linear"), len(weight_only))
    err = _rel(compiled, matched)
    print("relative error of the logits on the prompt (Frobenius norm):")
    print(f"  compiled vs eager model (the scheme as written)                           {_rel(compiled, eager):.3e}")
    print(f"  compiled vs weight-only reference (dequantized weights, bf16 activations) "
          f"{_rel(compiled, reference):.3e}")
    why = (f"--max-rel-error {max_rel_error:g}" if limit == max_rel_error else
           f"{ACT_NOISE_FACTOR}x the activation quantization's own effect, {act_effect:.3e}")
    print(f"check: {name}: {err:.3e} {'<=' if err <= limit else '>'} {limit:.3e} ({why}): "
          f"{'ok' if err <= limit else 'FAILED'} ({expect})")
    if err <= limit:
        return None
    return (f"{name}: relative logits error {err:.3e} exceeds {limit:.3e} ({why}). {expect}; it does not, "
            "so a kernel computes something else. `qcompile explain` lists each layer's kernel; "
            "--kernel reference runs the reference path.")


def _reference(n_quantized: int, n_weight_only: int) -> tuple[str, str]:
    """The check's name and what it expects, for ``n_weight_only`` of ``n_quantized`` layers
    compiled weight-only."""
    if n_weight_only == 0:
        return "compiled vs eager model", (
            f"all {n_quantized} quantized layers run kernels that compute what the scheme says, so the compiled "
            "model should match the eager one")
    if n_weight_only == n_quantized:
        return "compiled vs weight-only reference", (
            f"all {n_quantized} quantized layers run weight-only kernels (activations not quantized), so the "
            "compiled model should match the dequantized weights with unquantized activations")
    return "compiled vs mixed reference", (
        f"{n_weight_only} of {n_quantized} quantized layers run weight-only kernels, so the compiled model should "
        "match the eager one with those layers' weights dequantized and their activations unquantized")


def _load_bf16(path: str, dev):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map={"": str(dev)}).eval()


def _compare_bf16(model, args, ids, rate) -> None:
    """Time ``model`` (bf16: the dequantized weights, or the checkpoint itself with --online) under
    torch.compile with the same inner compiler qcompile used (inductor: plain torch.compile)."""
    import torch

    from qcompile import bench

    torch._dynamo.reset()
    graphs = model.device.type == "cuda" and args.inner == "inductor"
    if args.inner == "inductor":
        step = torch.compile(model.forward, dynamic=False, mode="reduce-overhead" if graphs else None)
        how = "plain torch.compile" + (" mode=reduce-overhead" if graphs else "")
    else:
        step = torch.compile(model.forward, dynamic=False, backend=args.inner)
        how = f"torch.compile(backend={args.inner!r})"
    _, bf16_rate = bench.greedy_decode(model, step, ids, args.max_new_tokens)
    source = "the bf16 checkpoint" if args.online else "dequantized weights"
    print(_rate_line(bf16_rate, f"bf16 {source}, {how}", args, model.device))
    if rate and bf16_rate:
        note = "" if graphs else " (without CUDA graphs on a GPU; on CPU the quantized ops are emulated)"
        print(f"qcompile / bf16 decode speed: {rate / bf16_rate:.2f}x{note}")


if __name__ == "__main__":
    sys.exit(main())
