"""``qcompile`` command line.

    qcompile run [CHECKPOINT] --prompt "..."   load, compile, generate; explain table; compiled-vs-eager error
    qcompile bench [--m 1 16 128 4096] ...      time the FP8 linear ops against the peers (CUDA)

With no CHECKPOINT, ``run`` writes a tiny random Llama in a producer's format (``--format``, default
ModelOpt FP8) to a temporary directory and uses it, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def cmd_run(args) -> int:
    import torch

    import qcompile
    from qcompile import synth

    device = _device(args.device)
    path = args.checkpoint
    if path is None:
        path = tempfile.mkdtemp(prefix="qcompile-tiny-")
        print(f"no checkpoint given: writing a tiny random Llama in {args.format} format to {path}")
        synth.write_checkpoint(path, args.format)
    online = args.online if args.online != "none" else None
    t0 = time.perf_counter()
    model = qcompile.load(path, device=device, online=online)
    model.eval()
    print(f"loaded in {time.perf_counter() - t0:.1f} s; quantized layers: {len(model.qcompile_plan)}; "
          f"weights {sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20:.1f} MiB")
    tok = _tokenizer(path)
    ids = tok(args.prompt, return_tensors="pt").input_ids.to(device)

    be = qcompile.backend(inner=args.inner, kernels=args.kernel)
    compiled = torch.compile(model, backend=be, dynamic=True)
    with torch.no_grad():
        eager_logits = model(ids).logits.float()
        t0 = time.perf_counter()
        comp_logits = compiled(ids).logits.float()
        t_compile = time.perf_counter() - t0
    print("\n" + be.explain() + "\n")
    err = (comp_logits - eager_logits).abs().max().item()
    rel = ((comp_logits - eager_logits).norm() / eager_logits.norm()).item()
    print(f"compiled vs eager logits: max abs error {err:.3e}, relative (Frobenius) {rel:.3e} "
          f"(first call incl. compile {t_compile:.1f} s)")

    out = ids
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(args.max_new_tokens):  # greedy, no cache: short and shape-dynamic on purpose
            nxt = compiled(out).logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
    dt = time.perf_counter() - t0
    print(f"generated {args.max_new_tokens} tokens in {dt:.2f} s: {tok.decode(out[0, ids.shape[1]:])!r}")
    return 0 if rel < args.max_rel_error else 1


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        from qcompile import synth
        tmp = tempfile.mkdtemp(prefix="qcompile-tok-")
        synth.write_tokenizer(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def main(argv: list[str] | None = None) -> int:
    from qcompile import synth

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # all further arguments belong to the benchmark's own parser
        from qcompile import bench
        return bench.main(argv[1:])
    parser = argparse.ArgumentParser(prog="qcompile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="load, compile and generate")
    run.add_argument("checkpoint", nargs="?", help="a local HF checkpoint directory (default: a built-in tiny model)")
    run.add_argument("--prompt", default="Hello, qcompile!")
    run.add_argument("--max-new-tokens", type=int, default=8)
    run.add_argument("--device", default="auto", help="auto | cpu | cuda")
    run.add_argument("--format", default="modelopt-fp8", choices=synth.FORMATS,
                     help="format of the built-in tiny model (ignored with a checkpoint)")
    run.add_argument("--online", default="none", choices=["none", "fp8_per_tensor", "fp8_per_block"],
                     help="quantize a bf16 checkpoint to FP8 at load")
    run.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager", "eager"])
    run.add_argument("--kernel", default=None, help="force one kernel for every layer (see the explain table)")
    run.add_argument("--max-rel-error", type=float, default=0.1,
                     help="exit 1 when compiled and eager logits differ more than this (inductor's fp32 "
                          "intermediates move values across FP8 rounding boundaries: a few %% is normal)")
    run.set_defaults(func=cmd_run)
    sub.add_parser("bench", help="time the quantized linear ops (CUDA); `qcompile bench --help` for options")
    args = parser.parse_args(argv)
    if args.cmd == "run" and args.online != "none" and args.checkpoint is None:
        args.format = "bf16"
    try:
        return args.func(args)
    except Exception as e:  # a QCompileError is a message for the user, not a stack trace
        from qcompile.errors import QCompileError
        if isinstance(e, QCompileError):
            print(f"qcompile: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
