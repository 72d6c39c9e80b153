"""The models and measurements behind ``benchmarks/e2e_decode.py``: model shapes, random bf16 models built on
the device, checkpoints written from them (``qcompile.synth.write_model``: the producers' bytes, quantized on
the device), and the timed loops (own decode loop, prefill, HF ``generate``), the copy bandwidth and the
logits errors."""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time

import torch

# The default dense model: Llama-3.1-8B's shapes (untied lm_head).
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, initializer_range=0.02)
# Qwen3-30B-A3B's shapes, 4 layers by default.
QWEN3_MOE = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, vocab_size=151936, tie_word_embeddings=False, norm_topk_prob=True,
                 max_position_embeddings=8192, rms_norm_eps=1e-6, initializer_range=0.02)
# gpt-oss-20B's shapes (MXFP4 experts in OpenAI's checkpoint: ``--formats gptoss-mxfp4``), 4 layers by default:
# sliding-window (128) and full attention layers alternate, as in its config.
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
                   sliding_window=128, tie_word_embeddings=False, rms_norm_eps=1e-5, initializer_range=0.02)
TINY_GPT_OSS = dict(GPT_OSS_20B, hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=384,
                    sliding_window=8)
TINY_MOE = dict(QWEN3_MOE, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                vocab_size=384)


def model_config(arch: str, tiny: bool, layers: int | None):
    from transformers import GptOssConfig, LlamaConfig, Qwen3MoeConfig

    from qcompile import synth

    if arch == "llama":
        config = synth.tiny_llama_config(tie_word_embeddings=False) if tiny else LlamaConfig(**LLAMA_8B)
    elif arch == "gpt_oss":
        config = GptOssConfig(**(TINY_GPT_OSS if tiny else GPT_OSS_20B))
    else:
        config = Qwen3MoeConfig(**(TINY_MOE if tiny else QWEN3_MOE))
    if layers and getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(layers)]
    if layers:
        config.num_hidden_layers = layers
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    return config


def build_bf16(config, device: str, seed: int = 0):
    """A random bf16 model made on ``device`` (seeded; no CPU copy of the weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), median of ``reps``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[1:])


def tensor_bytes(module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def read_bytes(model, batch: int) -> float:
    """Weight bytes one decode step must read: all, less the input embedding table (only gathered rows
    are read) and, for MoE, the experts no token of the batch routes to (uniform routing assumed:
    a fraction ``1 - (1 - k/E)^batch`` of the experts is touched)."""
    total = tensor_bytes(model)
    if not model.config.tie_word_embeddings:
        total -= tensor_bytes(model.get_input_embeddings())
    e, k = getattr(model.config, "num_experts", 0), getattr(model.config, "num_experts_per_tok", 0)
    if e:
        experts = sum(tensor_bytes(m) for n, m in model.named_modules() if n.endswith("mlp.experts"))
        total -= experts * (1 - k / e) ** batch
    return total


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def logits_errors(model, compile_fn, probe, quantized: bool) -> dict:
    """Compiled-vs-eager logits error on ``probe`` and, for a qcompile model, compiled vs its dequantized
    bf16 copy (made and freed here)."""
    from qcompile.linear import dequantize_model

    with torch.no_grad():
        eager = model(probe).logits
        compiled = compile_fn(lambda ids: model(ids).logits)(probe)
        out = {"compiled_vs_eager": rel_err(compiled, eager)}
        if quantized:
            ref = dequantize_model(copy.deepcopy(model))
            out["compiled_vs_dequantized_bf16"] = rel_err(compiled, ref(probe).logits)
            del ref
    return out


class Decoder:
    """Own greedy decode loop at one batch size: StaticCache, a compiled one-token step that returns the next
    token (the argmax inside the step; CUDA graphs where the compile function captures them). The positions are
    views of one tensor made on the device up front, so a step needs nothing from the host and the loop never
    waits for the GPU between steps (copying a host position to the device each step would synchronize the
    stream, leaving the GPU idle while the host prepares the next step). ``run(n)`` returns the seconds of ``n``
    more steps."""

    def __init__(self, model, compile_fn, device: str, batch: int, prompt_len: int, max_steps: int):
        from qcompile.kv_cache import cache_kwargs, static_cache

        self.model, self.device = model, device
        self.cache = static_cache(model, prompt_len + max_steps + 8)
        self.cache_kw = cache_kwargs(model, self.cache)  # `cache=` from transformers 5.24, `past_key_values=` before
        ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), device=device)
        with torch.no_grad():
            logits = model(input_ids=ids, **self.cache_kw, use_cache=True,
                           cache_position=torch.arange(prompt_len, device=device), logits_to_keep=1).logits
        self.tok, self.pos = logits[:, -1:].argmax(-1), prompt_len
        self.positions = torch.arange(prompt_len + max_steps, device=device)
        self.step = compile_fn(self._step)

    def _step(self, tok, pos):
        logits = self.model(input_ids=tok, **self.cache_kw, cache_position=pos, use_cache=True).logits
        return logits[:, -1:].argmax(-1)

    def run(self, n: int) -> float:
        tok, pos = self.tok, self.pos
        if pos + n > len(self.positions):
            raise ValueError(f"the decoder was built for {len(self.positions)} positions, asked for {pos + n}")
        with torch.no_grad():
            sync(self.device)
            t0 = time.perf_counter()
            for _ in range(n):
                # clone: the next step's input must outlive the replay that overwrites this step's output
                tok = self.step(tok, self.positions[pos:pos + 1]).clone()
                pos += 1
            sync(self.device)
        self.tok, self.pos = tok, pos
        return time.perf_counter() - t0


def decode_figures(batch: int, tokens: int, times: list[float]) -> dict:
    """Tokens/s (all sequences) of decode rounds of ``tokens`` steps that took ``times`` seconds: the median
    round, each round's figure, and their spread ((max - min) / median, in percent)."""
    median = statistics.median(times)
    rounds = [batch * tokens / t for t in times]
    return {"tok_s": batch * tokens / median, "ms_per_step": 1e3 * median / tokens,
            "rounds_tok_s": [round(r) for r in rounds],
            "spread_pct": 100 * (max(rounds) - min(rounds)) * median / (batch * tokens)}


def profile_kernels(dec: Decoder, tokens: int, top: int) -> list:
    """The ``top`` GPU kernels with the most time per step over one more round of ``dec`` (torch.profiler):
    [[name, µs per step, launches per step], ...]."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.run(tokens)
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    return [[e.key[:80], round(e.device_time_total / tokens, 2), round(e.count / tokens, 2)] for e in events[:top]]


def compiled_prefill(model, compile_fn, device: str, length: int):
    """A compiled batch-1 prefill of ``length`` random tokens into a StaticCache (last logits only): a call
    that empties the cache, runs the prefill and returns its wall seconds, the device synchronized before and
    after; the prefill and the last synchronization run inside ``around`` (a context manager: a profiler, say).
    Call it under ``torch.no_grad()``; the first calls compile."""
    from qcompile.kv_cache import cache_kwargs, static_cache

    cache = static_cache(model, length)
    kw = cache_kwargs(model, cache)
    ids = torch.randint(3, model.config.vocab_size, (1, length), device=device)
    pos = torch.arange(length, device=device)
    fn = compile_fn(lambda ids, pos: model(input_ids=ids, **kw, cache_position=pos, use_cache=True,
                                           logits_to_keep=1).logits)

    def run(around=None) -> float:
        cache.reset()  # transformers 5.24's static layers count their own positions
        sync(device)
        t0 = time.perf_counter()
        with around or contextlib.nullcontext():
            fn(ids, pos)
            sync(device)
        return time.perf_counter() - t0

    return run


def prefill_ms(model, compile_fn, device: str, length: int, reps: int) -> float:
    """Median ms of ``reps`` compiled prefills (:func:`compiled_prefill`), after two that compile."""
    run = compiled_prefill(model, compile_fn, device, length)
    with torch.no_grad():
        times = [run() for _ in range(reps + 2)]
    return 1e3 * statistics.median(times[2:])


def generate_tok_s(model, compile_config, device: str, batch: int, prompt_len: int, new_tokens: int,
                   reps: int) -> dict:
    """HF ``generate`` with a static cache and ``compile_config``: decode tokens/s (all sequences) from whole
    calls, with nothing added to generate's own loop: the time of a call making ``new_tokens`` tokens minus
    that of one making 1 (the prefill alone, which generate runs uncompiled), over the ``new_tokens - 1``
    decode steps between; the device synchronized before and after each call only. Calls of the two
    lengths alternate, ``reps`` of each, medians; where the difference is not positive (timer noise above the
    decode steps' time, as on a loaded CPU) more pairs, up to ``5 * reps`` (``pairs``: how many), else NaN.
    ``deferred``: whether generate deferred its stop check (``qcompile.generation``: a model qcompile loaded,
    on CUDA)."""
    from unittest import mock

    from transformers.generation import utils as generation_utils

    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), device=device)

    def call(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, cache_implementation="static", compile_config=compile_config, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    call(new_tokens)  # compiles and captures
    check = getattr(generation_utils, "DeferredStopCheck", None)
    deferred = False
    if check is not None:  # did generate build a DeferredStopCheck?
        with mock.patch.object(check, "__init__", autospec=True, side_effect=check.__init__) as init:
            call(new_tokens)
        deferred = init.called
    long, short = [], []
    for i in range(5 * reps):  # past ``reps`` only while the timer's noise hides the decode steps
        long.append(call(new_tokens))
        short.append(call(1))
        step = (statistics.median(long) - statistics.median(short)) / (new_tokens - 1)
        if i + 1 >= reps and step > 0:
            return {"tok_s": batch / step, "ms_per_step": 1e3 * step, "deferred": deferred, "pairs": i + 1}
    return {"tok_s": math.nan, "ms_per_step": math.nan, "deferred": deferred, "pairs": len(long)}


def compile_config(quantized: bool, cuda: bool, inner: str = "inductor", options: dict | None = None):
    """generate()'s CompileConfig: qcompile with its CUDA graphs for a quantized model (the backend option;
    ``mode`` must then be None, torch.compile takes mode or options) and its other ``options``, inductor
    reduce-overhead for bf16. ``inner`` other than inductor: that compiler instead (a smoke test)."""
    from transformers import CompileConfig

    graphs = cuda and inner == "inductor"
    if quantized:
        config = CompileConfig(backend="qcompile", fullgraph=True, dynamic=False, mode=None,
                               options={**(options or {}), "cudagraphs": graphs, "inner": inner})
    else:
        config = CompileConfig(backend=inner, fullgraph=True, dynamic=False,
                               mode="reduce-overhead" if graphs else "default")
    config._compile_all_devices = not cuda  # CPU: compile anyway (a smoke test of the same path)
    return config
