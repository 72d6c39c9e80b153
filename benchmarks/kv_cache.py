"""KV-cache memory and decode speed at long context: transformers' bf16 ``StaticCache`` vs qcompile's
static ``FP8Cache``, on a Llama-shaped model with random bf16 weights (the weights are not what is
measured). Own decode loop: batch ``--batch``, one compiled step (``torch.compile`` with
``--compile-mode``, by default ``reduce-overhead``: CUDA graphs on a GPU), greedy tokens.

    python benchmarks/kv_cache.py --out kv_cache.json                 # GPU: hidden 4096, 32/8 heads, 8k and 32k
    python benchmarks/kv_cache.py --tiny --out /tmp/kv.json           # CPU smoke test (256 wide, 64 / 128 context)

For each context length both caches are sized ``context + tokens * (reps + 2)``, prefilled for real with
``--prefill`` tokens (this lazily allocates them and measures the FP8 cache's dynamic scales), then
filled up to the context by repeating those positions in place (a 32k prefill is not what is
measured; both caches then hold the same keys and values, up to fp8 rounding, so their first
decode step's logits are compared: ``first_step_logits_rel_err``). Reported per cache: its bytes
(``cache_MiB``; ``cache_MiB_allocated`` is what the allocator handed out for it on a GPU), the peak
memory of setting it up and compiling the step over the weights (``setup_peak_over_weights_MiB``,
GPU), and decode tokens/s (median of ``--reps`` rounds of ``--tokens`` tokens; the two caches'
rounds interleaved so that a slow spell hits both alike), plus dynamo's graph-break and
CUDA-graph-skip counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch


def build_model(args, device: str):
    from transformers import AutoModelForCausalLM

    from qcompile import synth

    cfg = synth.tiny_llama_config() if args.tiny else synth.tiny_llama_config(
        hidden_size=args.hidden, intermediate_size=args.inter, num_hidden_layers=args.layers, vocab_size=args.vocab,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        tie_word_embeddings=False, max_position_embeddings=max(args.contexts) + 4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fill(cache, prefill: int, context: int) -> None:
    """Repeat the first ``prefill`` cached positions up to ``context``, in place (fp8 through uint8)."""
    index = torch.arange(context) % prefill
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            raw[:, :, :context] = raw[:, :, :prefill].clone()[:, :, index.to(raw.device)]
        layer.cumulative_length.fill_(context)


class Decoder:
    """One cache at one context: set up, compiled and warmed; ``run()`` times ``tokens`` decode steps."""

    def __init__(self, model, kind: str, context: int, args, device: str):
        from transformers import StaticCache

        from qcompile.kv_cache import FP8Cache, cache_kwargs, cache_nbytes

        self.model, self.device, self.tokens = model, device, args.tokens
        cuda = device == "cuda"
        sync(device)
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        max_len = context + args.tokens * (args.reps + 2)
        self.cache = (StaticCache(config=model.config, max_cache_len=max_len) if kind == "bf16" else
                      FP8Cache(model, max_cache_len=max_len, scales="dynamic"))
        kw = cache_kwargs(model, self.cache)
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prefill), device=device,
                            generator=torch.Generator(device).manual_seed(1))
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **kw)
            fill(self.cache, args.prefill, context)
        sync(device)
        self.stats = {"cache_MiB": cache_nbytes(self.cache) / 2**20,
                      "cache_dtype": str(self.cache.layers[0].keys.dtype).replace("torch.", ""),
                      "cache_MiB_allocated": (torch.cuda.memory_allocated() - base) / 2**20 if cuda else None}

        def step(tok, pos):
            return model(input_ids=tok, position_ids=pos, use_cache=True, **kw).logits

        # dynamic=False: the two caches' steps share one code object; no shape may turn symbolic
        backend = args.backend
        if backend == "qcompile":  # its passes (one-token attention reads the fp8 codes), CUDA graphs on a GPU
            import qcompile
            backend = qcompile.backend(cudagraphs=cuda)
        self.step = torch.compile(step, mode=args.compile_mode, backend=backend, fullgraph=args.fullgraph,
                                  dynamic=False)
        # the same first step for both caches; a contiguous token, as argmax's later ones are (no recompile)
        self.tok, self.pos = ids[:, -1:].clone(memory_format=torch.contiguous_format), context
        self.first_logits = self._call().float()  # compiles; the logits of the same first step for both caches
        for _ in range(2):  # warm-up: CUDA-graph recording and replay
            self._call()
        sync(device)
        if cuda:
            self.stats["setup_peak_over_weights_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20

    def _call(self) -> torch.Tensor:
        if self.device == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        pos = torch.full((self.tok.shape[0], 1), self.pos, device=self.device, dtype=torch.long)
        with torch.no_grad():
            out = self.step(self.tok, pos)
        logits = out[:, -1].clone()
        self.tok, self.pos = logits.argmax(-1, keepdim=True), self.pos + 1
        return logits

    def run(self) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(self.tokens):
            self._call()
        sync(self.device)
        return time.perf_counter() - t0


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))}


def bench_context(model, context: int, args, device: str) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    decoders = {kind: Decoder(model, kind, context, args, device) for kind in ("bf16", "fp8")}
    times = {kind: [] for kind in decoders}
    for _ in range(args.reps):
        for kind, dec in decoders.items():
            times[kind].append(dec.run())
    out = {"context": context, **dynamo_counts()}
    for kind, dec in decoders.items():
        med = statistics.median(times[kind])
        out[kind] = {**dec.stats, "tok_s": args.tokens * args.batch / med, "ms_per_step": 1e3 * med / args.tokens,
                     "tok_s_rounds": [round(args.tokens * args.batch / t, 1) for t in times[kind]]}
    a, b = decoders["bf16"].first_logits, decoders["fp8"].first_logits
    out["first_step_logits_rel_err"] = ((b - a).norm() / a.norm()).item()
    out["fp8_over_bf16_memory"] = out["fp8"]["cache_MiB"] / out["bf16"]["cache_MiB"]
    out["fp8_over_bf16_tok_s"] = out["fp8"]["tok_s"] / out["bf16"]["tok_s"]
    del decoders
    gc.collect()
    return out


def markdown(results: list[dict]) -> str:
    rows = ["| context | cache | MiB | tok/s (median) | ms/step | rounds |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for kind in ("bf16", "fp8"):
            v = r[kind]
            rows.append(f"| {r['context']} | {kind} ({v['cache_dtype']}) | {v['cache_MiB']:.1f} | {v['tok_s']:.1f} | "
                        f"{v['ms_per_step']:.3f} | {' / '.join(map(str, v['tok_s_rounds']))} |")
    return "\n".join(rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--contexts", default="8192,32768", help="comma-separated context lengths")
    p.add_argument("--prefill", type=int, default=64, help="tokens really prefilled before the fill")
    p.add_argument("--tokens", type=int, default=64, help="decode steps per timed round")
    p.add_argument("--reps", type=int, default=5, help="timed rounds per cache (interleaved; median)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend; qcompile: qcompile.backend(cudagraphs=True) on a GPU")
    p.add_argument("--compile-mode", default=None,
                   help='torch.compile mode; default "reduce-overhead" (CUDA graphs) on cuda, none on cpu')
    p.add_argument("--fullgraph", action="store_true", help="torch.compile(fullgraph=True)")
    p.add_argument("--tiny", action="store_true", help="the 256-wide test model, contexts 64 and 128 (smoke test)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.contexts, args.prefill = "64,128", min(args.prefill, 16)
        args.tokens, args.reps = min(args.tokens, 4), min(args.reps, 2)
    args.contexts = [int(c) for c in str(args.contexts).split(",")]
    if args.compile_mode is None and device == "cuda" and args.backend == "inductor":
        args.compile_mode = "reduce-overhead"
    for name in ("recompile_limit", "cache_size_limit"):  # one step per cache and context
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))

    model = build_model(args, device)
    results = []
    for context in args.contexts:
        t0 = time.perf_counter()
        results.append(bench_context(model, context, args, device))
        print(f"context {context}: {time.perf_counter() - t0:.0f} s", flush=True)
    import transformers

    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__, "args": vars(args),
              "model": {k: getattr(model.config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                               "num_attention_heads", "num_key_value_heads", "head_dim",
                                                               "vocab_size")},
              "results": results}
    print(json.dumps(results, indent=2))
    print(markdown(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
