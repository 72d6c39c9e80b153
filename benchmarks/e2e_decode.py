"""End-to-end decode and prefill: a random Llama-3.1-8B-shaped model (``--arch llama``), a Qwen3-MoE-shaped one
(``--arch qwen3_moe``) or a gpt-oss-20B-shaped one (``--arch gpt_oss``) in bf16 under plain
``torch.compile(mode="reduce-overhead")`` vs the same weights in quantized checkpoints run by qcompile with CUDA
graphs.

    python benchmarks/e2e_decode.py --quick                           # 4 layers: a first check (GPU)
    python benchmarks/e2e_decode.py --quick --interleave --batch 1    # batch-1 speed-ups, rounds alternated
    python benchmarks/e2e_decode.py --formats bf16 modelopt-fp8 --json a.json
    python benchmarks/e2e_decode.py --arch qwen3_moe --hf-generate --json moe.json
    python benchmarks/e2e_decode.py --tokens 0 --no-errors --reps 3  # prefill only (no decode step built)
    python benchmarks/e2e_decode.py --tiny --device cpu --hf-generate  # smoke test of every path, anywhere

The bf16 weights are made on the device (seeded); each quantized checkpoint is quantized there by
``qcompile.synth.write_model`` (the producers' on-disk bytes), written to a temporary directory as
safetensors shards and loaded by ``qcompile.load``, so the loader is what runs. Models are measured one after
another, each freed before the next loads; with ``--interleave`` all are built and their decode steps captured
first, then the decode rounds alternate between them (order rotated each round). Per model: weight memory; decode
tokens/s of an own greedy loop (``kv_cache.static_cache``, one compiled step per token with its argmax, CUDA graphs,
no host synchronization between steps) at each ``--batch``, the median of ``--reps`` rounds and their spread,
against the weight-read floor (bytes one step reads / the device-to-device copy bandwidth measured in the same run);
the prefill of ``--prefill`` tokens at batch 1 (compiled without CUDA graphs; printed as each model finishes it);
logits errors on a 32-token probe (compiled vs eager, and vs the dequantized bf16 model; ``--no-errors`` skips
them); with ``--hf-generate``, ``model.generate`` with a static cache and a CompileConfig (qcompile backend, its
CUDA graphs), decode tokens/s next to the own loop's.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # e2e_models, and this checkout's qcompile
import e2e_models as em

from qcompile.errors import QCompileError, UnsupportedError

DENSE_FORMATS = ("bf16", "modelopt-fp8", "modelopt-fp8-pcpt", "ct-w4a16", "ct-nvfp4")
MOE_FORMATS = ("bf16", "online-fp8", "modelopt-fp8", "ct-w4a16", "ct-nvfp4")
GPT_OSS_FORMATS = ("bf16", "online-fp8", "gptoss-mxfp4")  # gptoss-mxfp4: OpenAI's own layout (fused MXFP4 experts)
DEFAULT_FORMATS = {"llama": DENSE_FORMATS, "qwen3_moe": MOE_FORMATS, "gpt_oss": GPT_OSS_FORMATS}
# formats loaded from the bf16 checkpoint, with this online scheme (bf16-qcompile: none, the bf16 weights compiled
# by qcompile, whose passes then change the attention only)
ONLINE = {"online-fp8": "fp8_per_tensor", "online-fp8-block": "fp8_per_block", "bf16-qcompile": None}


def note(interleaved: bool) -> str:
    """The table's legend."""
    order = ("models built together, their decode rounds interleaved (order rotated each round)" if interleaved
             else "models measured one after another")
    return (f"{order}; decode tok/s: median of the rounds, counting the tokens of all sequences; spread: (max - min) "
            "/ median of the rounds' tok/s; floor = weight bytes one decode step reads / copy bandwidth (input "
            "embedding excluded; MoE: experts touched under uniform routing)")


def parse_args(argv=None):
    from qcompile import synth

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=tuple(DEFAULT_FORMATS), default="llama")
    p.add_argument("--formats", nargs="+", default=None,
                   help=f"models to run, space- or comma-separated (default llama: {' '.join(DENSE_FORMATS)}; "
                        f"qwen3_moe: {' '.join(MOE_FORMATS)}; gpt_oss: {' '.join(GPT_OSS_FORMATS)}); any of bf16, "
                        f"{', '.join(ONLINE)}, and qcompile.synth's quantized formats (gpt_oss: gptoss-mxfp4); "
                        "FORMAT@KERNEL runs FORMAT with that kernel override (e.g. modelopt-fp8@fp8_scaled_mm); "
                        "FORMAT[@KERNEL]~KEY=VALUE[+KEY=VALUE] with qcompile backend options, a dotted KEY an "
                        "inductor config entry, a top-level one written inductor.KEY (e.g. ct-w4a16~small_topk=0, "
                        "ct-w4a16~triton.enable_pdl=0+fuse=0, ct-w4a16~inductor.combo_kernels=0): "
                        "one run can interleave the same checkpoint both ways (HF generate too)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: 32 llama, 4 qwen3_moe and gpt_oss)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="decode batch sizes")
    p.add_argument("--tokens", type=int, default=64, help="decode steps per timed round (0: no decode, e.g. prefill "
                   "only)")
    p.add_argument("--reps", type=int, default=5, help="timed rounds per measurement (median)")
    p.add_argument("--interleave", action="store_true",
                   help="build every model and capture its decode steps first, then alternate the decode rounds "
                        "between the models (order rotated each round), so that all figures and speed-ups come from "
                        "the same conditions; all models must fit in device memory together (four 32-layer Llama "
                        "models in 37 GiB of weights fit an 80 GB GPU)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens before decoding")
    p.add_argument("--prefill", type=int, default=2048, help="prefill length timed at batch 1 (0: skip)")
    p.add_argument("--no-errors", action="store_true",
                   help="skip the logits-error probe (its compile, and for a quantized model a dequantized bf16 "
                        "copy held for a moment): for models too deep to hold twice or compile twice in time")
    p.add_argument("--hf-generate", action="store_true", help="also time model.generate with a CompileConfig")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N GPU kernels with the most time per decode step (torch.profiler)")
    p.add_argument("--quick", action="store_true", help="4 layers, 32 tokens, 3 rounds, prefill 512")
    p.add_argument("--tiny", action="store_true", help="the 256-wide test shapes (smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--inner", choices=("inductor", "aot_eager", "eager"), default="inductor",
                   help="the compiler after Dynamo (bf16) / after qcompile's passes; eager: a fast smoke test")
    p.add_argument("--no-fullgraph", action="store_true", help="let the compiled step have graph breaks")
    p.add_argument("--workdir", default=None,
                   help="where checkpoints are written, one subdirectory per format, replaced "
                   "(default: a temporary dir)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="print one table from the --json files of runs split by --formats (same machine), and exit")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.tokens, args.reps, args.prefill = args.layers or 4, 32, 3, min(args.prefill, 512)
    formats = [f for item in (args.formats or DEFAULT_FORMATS[args.arch]) for f in item.split(",") if f]
    known = ("bf16", *ONLINE, *synth.QUANTIZED_FORMATS, synth.GPTOSS_MXFP4)
    for f in formats:
        try:
            base, kernel, options = split_format(f)
            if base in known and base != "bf16":
                backend_options(f)
        except Exception as e:  # noqa: BLE001 - qcompile's own message names the option
            p.error(f"{f}: {e}")
        if base == "bf16" and (kernel or options):
            p.error(f"{f}: plain bf16 runs under torch.compile, without qcompile's kernels or options")
    unknown = [f for f in formats if split_format(f)[0] not in known]
    if unknown:
        p.error(f"unknown format(s) {unknown}; choose from {known}")
    args.formats = formats
    if args.hf_generate and args.tokens < 2:
        p.error("--hf-generate times the decode steps after the first token: pass --tokens 2 or more")
    if args.tokens < 0:
        p.error("--tokens: 0 or more decode steps")
    if args.tokens == 0:
        args.batch = []  # (no decode step built or timed)
    return args


SET_BY_THE_RUN = ("inner", "cudagraphs", "on_graph")  # backend options the benchmark sets itself


def split_format(fmt: str) -> tuple[str, str | None, dict]:
    """``BASE[@KERNEL][~KEY=VALUE+KEY=VALUE...]`` -> (base format, kernel override or None, {key: value});
    values 0 / 1 / true / false are booleans, digits integers. Raises ValueError for an option without a value."""
    head, _, opts = fmt.partition("~")
    base, _, kernel = head.partition("@")
    options = {}
    for item in filter(None, opts.split("+")):
        key, eq, value = item.partition("=")
        if not (key and eq and value):
            raise ValueError(f"option {item!r}: write KEY=VALUE")
        low = value.lower()
        options[key] = (low in ("1", "true")) if low in ("0", "1", "true", "false") else \
            int(value) if value.isdigit() else value
    return base, kernel or None, options


def backend_options(fmt: str) -> dict:
    """qcompile.backend keyword arguments of ``fmt``'s options (dotted keys go to ``inductor_config``, a top-level
    entry of inductor's config written ``inductor.KEY``), checked by the backend (option names, boolean values,
    inductor's config names)."""
    import qcompile

    _, kernels, options = split_format(fmt)
    out: dict = {"kernels": kernels, "inductor_config": {}}
    for key, value in options.items():
        if key in SET_BY_THE_RUN:
            raise ValueError(f"{key!r} is set by the benchmark (--inner, CUDA graphs on the GPU)")
        if "." in key:
            out["inductor_config"][key.removeprefix("inductor.")] = value
        else:
            out[key] = value
    qcompile.backend(**out)  # qcompile's ConfigError names a bad option
    return out


def model_name(fmt: str) -> str:
    """The model's row in the results."""
    return fmt if fmt.startswith("bf16") else f"{fmt} qcompile"


def write_checkpoints(model, args, root: str) -> dict:
    """Every checkpoint the run loads, written from the bf16 ``model`` where it is (online formats load
    the bf16 checkpoint); format -> (path, seconds to write)."""
    from qcompile import synth

    written: dict = {}
    bases = [split_format(f)[0] for f in args.formats]
    for source in dict.fromkeys("bf16" if f in ONLINE else f for f in bases if f != "bf16"):
        t0 = time.perf_counter()
        shutil.rmtree(os.path.join(root, source), ignore_errors=True)  # another run's, in a --workdir
        synth.write_model(os.path.join(root, source), model, source, max_shard_bytes=4 << 30)
        em.sync(args.device)
        written[source] = (os.path.join(root, source), time.perf_counter() - t0)
        print(f"wrote {source} in {written[source][1]:.1f} s", flush=True)
    return {f: written["bf16" if f in ONLINE else f] for f in bases if f != "bf16"}


@dataclasses.dataclass
class Held:
    """A loaded model, its results so far, and what its decode timing needs."""
    model: torch.nn.Module
    out: dict  # its entry of the results
    compile_fn: Callable  # the decode step's compiler (CUDA graphs on the GPU)
    backend: object | None  # the qcompile backend behind compile_fn (its explain rows); None for bf16
    decoders: dict | None = None  # batch -> em.Decoder, compiled and warm (build_decoders)


def compilers(args, quantized: bool, options: dict) -> tuple:
    """(the qcompile backend or None, the compile function of the decode steps (CUDA graphs)); ``options``: the
    format's qcompile backend options (:func:`backend_options`)."""
    import qcompile

    cuda, fullgraph = args.device == "cuda", not args.no_fullgraph
    be = qcompile.backend(cudagraphs=cuda and args.inner == "inductor", inner=args.inner, **options) \
        if quantized else None

    def compile_fn(f):
        if quantized:
            return torch.compile(f, backend=be, fullgraph=fullgraph, dynamic=False)
        if args.inner != "inductor":
            return torch.compile(f, backend=args.inner, fullgraph=fullgraph, dynamic=False)
        return torch.compile(f, mode="reduce-overhead" if cuda else None, fullgraph=fullgraph, dynamic=False)

    return be, compile_fn


def plain_compiler(args, quantized: bool, options: dict) -> tuple:
    """(the qcompile backend or None, a compile function without CUDA graphs on it): the error probe's and the
    prefill's (a prefill is one long compute-bound step), each with a backend of its own, so that the rows it
    explains are that graph's."""
    import qcompile

    be = qcompile.backend(inner=args.inner, **options) if quantized else None
    return be, lambda f: torch.compile(f, backend=be or args.inner, dynamic=False)


def prepare(name: str, fmt: str, make, args, results: dict) -> Held:
    """Load one model (``make()``) and take its per-model measurements: weight memory, logits errors, prefill,
    HF generate (see the module docstring)."""
    t0 = time.perf_counter()
    model = make()
    em.sync(args.device)
    out = results[name] = {"load_s": time.perf_counter() - t0, "weight_bytes": em.tensor_bytes(model)}
    quantized = fmt != "bf16"
    options = backend_options(fmt) if quantized else {}
    be, compile_fn = compilers(args, quantized, options)
    probe = torch.randint(3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    if not args.no_errors:
        out["errors"] = em.logits_errors(model, plain_compiler(args, quantized, options)[1], probe.to(args.device),
                                         quantized)
    if args.prefill:
        pbe, prefill_compile = plain_compiler(args, quantized, options)
        out["prefill_ms"] = em.prefill_ms(model, prefill_compile, args.device, args.prefill, args.reps)
        print(f"  {name} prefill of {args.prefill} tokens: {out['prefill_ms']:.1f} ms", flush=True)
        if pbe is not None:
            out["prefill_kernels"] = kernel_summary(pbe.rows, model)
            print(f"  {name} prefill kernels: {json.dumps(out['prefill_kernels']['by_op'])}", flush=True)
    if args.hf_generate:
        torch._dynamo.reset()
        out["hf_generate_b1"] = em.generate_tok_s(model, em.compile_config(quantized, args.device == "cuda", args.inner,
                                                                           options if quantized else None),
                                                  args.device, 1, args.prompt, args.tokens, args.reps)
        if quantized:
            # generate() compiles with backend="qcompile" (a copy of the config): the rows explain() reads
            out["hf_generate_kernels"] = kernel_summary(sys.modules["qcompile.backend"]._LAST, model)
    return Held(model, out, compile_fn, be)


def build_decoders(held: Held, args) -> dict:
    """The model's decode step at each ``--batch`` ({batch: Decoder}): compiled, captured (CUDA graphs) and warmed
    up by one round."""
    decoders = {}
    for b in args.batch:
        decoders[b] = em.Decoder(held.model, held.compile_fn, args.device, b, args.prompt, args.tokens * (args.reps + 3))
        decoders[b].run(args.tokens)
    return decoders


def decode_rounds(decoders: dict, args) -> dict:
    """The timed decode rounds of every model ({name: {batch: Decoder}}): in round r, at each batch size, every
    model runs ``--tokens`` steps once, in the models' order rotated by r (no model always runs first).
    {(name, batch): [seconds of each round]}; one model: its ``--reps`` rounds."""
    names = list(decoders)
    times: dict = {(name, b): [] for name in names for b in args.batch}
    for r in range(args.reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for b in args.batch:
            for name in order:
                times[name, b].append(decoders[name][b].run(args.tokens))
    return times


def finish(name: str, held: Held, times: dict, args) -> None:
    """The model's decode figures from its rounds (against the weight-read floor), the kernels it ran and, with
    ``--profile``, the GPU kernels of its decode step."""
    out = held.out
    for b in args.batch:
        d = out[f"decode_b{b}"] = em.decode_figures(b, args.tokens, times[name, b])
        floor_s = em.read_bytes(held.model, b) / args.bandwidth
        d.update(floor_ms_per_step=1e3 * floor_s, pct_of_floor=100 * floor_s * 1e3 / d["ms_per_step"])
        print(f"  {name} batch {b}: {d['tok_s']:.0f} tok/s (spread {d['spread_pct']:.0f} %)", flush=True)
        if args.profile and args.device == "cuda":
            d["kernels"] = em.profile_kernels(held.decoders[b], args.tokens, args.profile)
            for kname, us, count in d["kernels"]:
                print(f"    {us:8.1f} us/step  x{count:<5g} {kname}", flush=True)
    if held.backend is not None and args.batch:  # (--tokens 0 builds no decode step)
        out["kernels"] = kernel_summary(held.backend.rows, held.model)
        # inductor's config patches each decode graph compiled with (PDL, combo kernels, CUDA graphs)
        out["inductor_patches"] = [dict(p) for p in held.backend.compiled_with]
        if out["inductor_patches"]:
            print(f"  {name} decode graphs compiled with: " + "; ".join(
                ", ".join(f"{k}={v}" for k, v in sorted(p.items())) or "inductor's defaults"
                for p in out["inductor_patches"]), flush=True)
        print(held.backend.explain() if args.tiny else "\n".join(held.backend.explain().splitlines()[:4]), flush=True)
    if args.hf_generate:
        out["hf_generate_b1"]["vs_own_loop"] = out["hf_generate_b1"]["tok_s"] / out["decode_b1"]["tok_s"] \
            if "decode_b1" in out else None


def kernel_summary(rows, model) -> dict:
    """{op: {kernel: count}} over the explain rows, and the kernel of every experts layer of ``model``
    (one that no qcompile pass lowered runs transformers' own bf16 experts)."""
    summary: dict = {}
    for r in rows:
        by_op = summary.setdefault(r.op, {})
        by_op[r.kernel] = by_op.get(r.kernel, 0) + 1
    experts = {n: "not lowered (transformers' bf16 experts)" for n, _ in model.named_modules()
               if n.endswith("mlp.experts")}
    experts.update((r.module, r.kernel) for r in rows if r.module in experts)
    return {"by_op": summary, "experts_layers": experts}


def out_of_memory(e: BaseException | None) -> bool:
    """Whether ``e`` is, or was raised from, CUDA running out of memory (torch.compile wraps its backend's errors)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def attempt(names: list[str], results: dict, fn, *fn_args, together: int = 1):
    """``fn(*fn_args)``; a failure is recorded as the result of ``names`` and the run goes on (None returned),
    except CUDA running out of memory while building one of ``together`` > 1 models held at once (``--interleave``):
    an UnsupportedError naming the model."""
    try:
        return fn(*fn_args)
    except Exception as e:  # one model failing must not lose the others' figures
        if together > 1 and out_of_memory(e):
            raise UnsupportedError(
                f"CUDA ran out of memory while building it for --interleave, which holds all {together} models "
                f"and their captured decode steps at once ({str(e).splitlines()[0][:200]})",
                where=f"model {names[0]!r}",
                fix="drop --interleave (the models then run one after another, each freed before the next loads) or "
                    "pass fewer --formats or --layers") from e
        traceback.print_exc()
        for name in names:
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        return None


def run_group(makers: dict, args, results: dict) -> None:
    """Load and measure the models of ``makers`` ({name: (format, make)}), build every decode step of them all,
    time their decode rounds (``decode_rounds``: interleaved when there are several), then free them all.
    One model per group is the sequential mode; all models in one group is ``--interleave``."""
    held: dict = {}
    try:
        for name, (fmt, make) in makers.items():
            held[name] = attempt([name], results, prepare, name, fmt, make, args, results, together=len(makers))
            torch._dynamo.reset()  # the per-model compiles go; the timed steps are compiled next, none reset after
        held = {name: h for name, h in held.items() if h is not None}
        for name, h in list(held.items()):
            h.decoders = attempt([name], results, build_decoders, h, args, together=len(makers))
            if h.decoders is None:
                del held[name]
        times = attempt(list(held), results, decode_rounds, {name: h.decoders for name, h in held.items()}, args) \
            if held else None
        for name, h in held.items() if times is not None else ():
            attempt([name], results, finish, name, h, times, args)
    finally:
        held = h = None
        torch._dynamo.reset()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def table(results: dict, args) -> str:
    batches = args.batch
    errors = any("errors" in r for r in results.values())  # not with --no-errors
    head = (["model", "weight MiB"] + [f"decode b{b} tok/s (ms/step, % floor, vs bf16; spread)" for b in batches]
            + ([f"prefill {args.prefill} ms"] if args.prefill else [])
            + (["generate b1 tok/s (vs own)"] if args.hf_generate else [])
            + (["compiled vs eager", "vs dequant bf16"] if errors else []))
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    base = results.get("bf16", {})
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |")
            continue
        cells = [name, f"{r['weight_bytes'] / 2**20:.0f}"]
        for b in batches:
            d, ref = r[f"decode_b{b}"], base.get(f"decode_b{b}")
            up = f", {d['tok_s'] / ref['tok_s']:.2f}x" if ref and name != "bf16" else ""  # of the medians
            spread = f"; spread {d['spread_pct']:.0f} %" if "spread_pct" in d else ""
            cells.append(f"{d['tok_s']:.0f} ({d['ms_per_step']:.2f}, {d['pct_of_floor']:.0f} %{up}{spread})")
        if args.prefill:
            cells.append(f"{r['prefill_ms']:.1f}")
        if args.hf_generate:
            g = r["hf_generate_b1"]
            cells.append(f"{g['tok_s']:.0f} ({g['vs_own_loop']:.2f})" if g["vs_own_loop"] else f"{g['tok_s']:.0f}")
        if errors:
            e = r.get("errors", {})
            cells += ["–" if e.get(k) is None else f"{e[k]:.3g}"
                      for k in ("compiled_vs_eager", "compiled_vs_dequantized_bf16")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(files: list[str]) -> dict:
    runs = [json.load(open(f)) for f in files]
    results = {name: r for run in runs for name, r in run["results"].items()}
    args = argparse.Namespace(**runs[0]["args"])
    bandwidths = " / ".join(f"{run['bandwidth_bytes_s'] / 1e9:.0f}" for run in runs)
    print(f"GPU: {', '.join(sorted({run['gpu'] for run in runs}))}; copy bandwidth "
          f"{bandwidths} GB/s\n"
          + "\n".join(f"command: `{run['command']}`" for run in runs)
          + f"\n{note(len(runs) == 1 and getattr(args, 'interleave', False))}\n\n{table(results, args)}")
    return results


def main(argv=None):
    import qcompile

    args = parse_args(argv)
    if args.merge:
        return merge(args.merge)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    cuda = args.device == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    config = em.model_config(args.arch, args.tiny, args.layers)
    args.bandwidth = em.copy_bandwidth(args.device, (2 << 30) if cuda else (64 << 20))
    print(f"{gpu}: copy bandwidth {args.bandwidth / 1e9:.0f} GB/s", flush=True)
    root = args.workdir or tempfile.mkdtemp(prefix="qcompile-e2e-")
    results: dict = {}
    bf16 = [em.build_bf16(config, args.device)]
    try:
        paths = write_checkpoints(bf16[0], args, root)
        if "bf16" not in args.formats:
            bf16.clear()

        def maker(fmt: str):
            if fmt == "bf16":
                return bf16.pop  # the model's only reference goes to the run, which frees it
            base = split_format(fmt)[0]
            if base == "bf16-qcompile":  # the bf16 checkpoint as transformers loads it
                from transformers import AutoModelForCausalLM
                return lambda: AutoModelForCausalLM.from_pretrained(paths[base][0], dtype=torch.bfloat16,
                                                                    device_map=args.device).eval()
            return lambda: qcompile.load(paths[base][0], device=args.device, online=ONLINE.get(base)).eval()

        makers = {model_name(fmt): (fmt, maker(fmt)) for fmt in args.formats}
        for group in [makers] if args.interleave else [{name: m} for name, m in makers.items()]:
            run_group(group, args, results)
    finally:
        bf16.clear()
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    for fmt in args.formats:
        if fmt != "bf16":
            results[model_name(fmt)]["write_s"] = paths[split_format(fmt)[0]][1]
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    report = (f"GPU: {gpu}; torch {torch.__version__}; copy bandwidth {args.bandwidth / 1e9:.0f} GB/s\n"
              f"command: `{command}`\n{note(args.interleave)}\n\n{table(results, args)}")
    print("\n" + report)
    for name, r in results.items():
        for what in ("kernels", "prefill_kernels"):
            if what in r:
                print(f"{name} {what.replace('_', ' ')}: {json.dumps(r[what])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "command": command, "note": note(args.interleave),
                       "bandwidth_bytes_s": args.bandwidth, "config": config.to_dict(),
                       "args": {k: v for k, v in vars(args).items() if k != "bandwidth"}, "results": results},
                      f, indent=2, default=str)
    return results


if __name__ == "__main__":
    try:
        main()
    except QCompileError as e:  # a message for the user, not a stack trace
        sys.exit(f"e2e_decode: error: {e}")
