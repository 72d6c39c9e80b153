"""End-to-end decode: a tiny-but-wide random Llama written in quantized formats (``--formats``, default
ModelOpt FP8) compiled with qcompile vs the same model in bf16 under plain torch.compile. Own decode loop
(StaticCache, compiled step, batch 1): HF generate with mode="reduce-overhead" breaks in transformers 5.17.

    python benchmarks/e2e_decode.py --out e2e.json            # H100: hidden 4096, inter 14336, 2 layers
    python benchmarks/e2e_decode.py --tiny --device cpu       # smoke test anywhere

Reports decode tokens/s (median of ``--reps`` rounds of ``--tokens`` tokens, the models' rounds
interleaved so that a slow spell of the host or GPU hits every model alike), weight memory, and
compiled-vs-eager logits error of the quantized model.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time

import torch


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def decoder(model, compile_fn, device, prompt_len: int, n_tokens: int, reps: int):
    """Prefill, compile and warm one decode step (StaticCache, batch 1); returns ``run()``: the seconds
    that ``n_tokens`` more greedy tokens take."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt_len + n_tokens * (reps + 2) + 8)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), device=device)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt_len, device=device),
                       use_cache=True).logits

    def step(tok, pos):
        return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

    compiled = compile_fn(step)
    state = {"tok": logits[:, -1:].argmax(-1), "pos": prompt_len}

    def run() -> float:
        tok, pos = state["tok"], state["pos"]
        with torch.no_grad():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_tokens):
                out = compiled(tok, torch.tensor([pos], device=device))
                tok = out[:, -1:].argmax(-1).clone()
                pos += 1
            if device == "cuda":
                torch.cuda.synchronize()
        state.update(tok=tok, pos=pos)
        return time.perf_counter() - t0

    run()  # compiles and warms up
    return run


def measure(model, probe, args, cuda) -> tuple[dict, object]:
    """Logits errors and weight memory of a qcompile model, and its decoder (qcompile's CUDA graphs)."""
    import qcompile
    from qcompile.linear import dequantize_model

    be = qcompile.backend(cudagraphs=cuda)
    with torch.no_grad():
        eager = model(probe).logits.float()
        comp = torch.compile(model, backend=qcompile.backend())(probe).logits.float()
        ref = dequantize_model(copy.deepcopy(model))(probe).logits.float()
    run = decoder(model, lambda f: torch.compile(f, backend=be), args.device, args.prompt, args.tokens, args.reps)
    print("\n".join(be.explain().splitlines()[:3]))
    return {"weight_MiB": weight_bytes(model) / 2**20,
            "compiled_vs_eager_rel_err": ((comp - eager).norm() / eager.norm()).item(),
            "compiled_vs_dequantized_bf16_rel_err": ((comp - ref).norm() / ref.norm()).item(),
            "kernels": sorted({r.kernel for r in be.rows})}, run


def main(argv=None):
    import qcompile
    from qcompile import synth

    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="timed rounds per model (interleaved; median)")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the 256-wide test model (smoke test)")
    p.add_argument("--formats", default="modelopt-fp8", help="comma-separated qcompile.synth formats")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    cfg = synth.tiny_llama_config() if args.tiny else synth.tiny_llama_config(
        hidden_size=args.hidden, intermediate_size=args.inter, num_hidden_layers=args.layers, vocab_size=args.vocab,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        tie_word_embeddings=False)
    root = tempfile.mkdtemp(prefix="qcompile-e2e-")

    from transformers import AutoModelForCausalLM

    results = {}
    # bf16 baseline: the same random weights (same seed) under plain torch.compile
    synth.write_bf16(f"{root}/bf16", cfg)
    bf16 = AutoModelForCausalLM.from_pretrained(f"{root}/bf16", dtype=torch.bfloat16).to(args.device).eval()
    probe = torch.randint(3, cfg.vocab_size, (1, 32), device=args.device)
    with torch.no_grad():  # control: how far inductor alone moves this random model's logits
        e, c = bf16(probe).logits.float(), torch.compile(bf16)(probe).logits.float()
    bf16_rel = ((c - e).norm() / e.norm()).item()
    torch._dynamo.reset()
    mode = "reduce-overhead" if cuda else None
    runs, models = {}, []
    name = "bf16 torch.compile" + (" reduce-overhead" if cuda else "")
    results[name] = {"weight_MiB": weight_bytes(bf16) / 2**20, "compiled_vs_eager_rel_err": bf16_rel}
    runs[name] = decoder(bf16, lambda f: torch.compile(f, mode=mode), args.device, args.prompt, args.tokens, args.reps)
    models.append(bf16)

    for fmt in args.formats.split(","):
        t0 = time.perf_counter()
        synth.write_checkpoint(f"{root}/{fmt}", fmt, config=cfg)
        print(f"wrote {fmt} in {time.perf_counter() - t0:.0f} s", flush=True)
        model = qcompile.load(f"{root}/{fmt}", device=args.device).eval()
        name = f"{fmt} qcompile" + (" cudagraphs" if cuda else "")
        results[name], runs[name] = measure(model, probe, args, cuda)
        models.append(model)
    # the models' rounds interleaved, so that a slow spell of the host or the GPU hits all of them alike
    times = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            times[name].append(run())
    for name, ts in times.items():
        results[name]["tok_s"] = args.tokens / statistics.median(ts)
        results[name]["tok_s_rounds"] = [round(args.tokens / t) for t in ts]
    print(json.dumps(results, indent=2))
    print("\n| model | decode tok/s (median) | rounds | ms/token | weight MiB | compiled vs eager logits |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for k, v in results.items():
        print(f"| {k} | {v['tok_s']:.0f} | {' / '.join(map(str, v['tok_s_rounds']))} | {1e3 / v['tok_s']:.3f} | "
              f"{v['weight_MiB']:.0f} | {v['compiled_vs_eager_rel_err']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": cfg.to_dict(), "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
