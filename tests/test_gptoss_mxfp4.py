"""gpt-oss's own MXFP4 checkpoints (``quant_method: "mxfp4"``, experts fused on disk as ``*_blocks`` /
``*_scales`` / ``*_bias``): loaded quantized into one QuantExperts per MoE layer, checked against transformers'
own decoder and model, compiled into one experts op per layer, saved back byte for byte; malformed ones refused
naming the tensor.

Checkpoint: tests/data/checkpoints/gptoss-mxfp4-tiny (written by tests/data/make_gptoss.py; README there).
References, all transformers': ``convert_moe_packed_tensors`` (its MXFP4 decoder) on the file's tensors, and
``GptOssForCausalLM`` loaded with ``Mxfp4Config(dequantize=True)`` (its experts dequantized by that decoder).
Tolerances: the decoded experts bit-exact (e2m1 x 2^k is exact in fp32); logits in fp32 within 1e-5 relative
(the same arithmetic in another order: measured 4e-7; gate and up rows not de-interleaved give 85 %, the gate /
up scales one step off 70 %, the gate / up biases dropped 8 %).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import qcompile
from qcompile.errors import CheckpointError
from qcompile.experts import QuantExperts, is_experts
from tests.test_moe_errors import broken as copy_edited
from tests.test_moe_formats import IDS, compile_graph, op_lines, rel_err

NAME = "gptoss-mxfp4-tiny"
MXFP4 = "w=fp4_e2m1/group32:e8m0/pack=uint8;a=none"
E0 = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def src(testdata) -> Path:
    if not (testdata / NAME).is_dir():
        pytest.skip(f"{NAME} is not among the test checkpoints")
    return testdata / NAME


@functools.lru_cache(maxsize=None)
def _load(path: str, dtype: torch.dtype):
    return qcompile.load(path, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _transformers(path: str):
    """transformers' own model of the checkpoint, its experts dequantized (fp32; transformers 5.17 dequantizes
    them to bf16 on the CPU, which holds every e2m1 code times a power of two exactly)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).float()
    assert all(type(m).__name__ == "GptOssExperts" and m.gate_up_proj.dtype == torch.float32
               for m in model.modules() if is_experts(m))
    return model


def experts_of(model) -> dict[str, QuantExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}


def test_loads_quantized(src):
    model = _load(str(src), torch.bfloat16)
    found = experts_of(model)
    assert list(found) == [E0, "model.layers.1.mlp.experts"]
    assert not any(is_experts(m) for m in model.modules()), "an experts module stayed in bf16"
    for experts in found.values():
        assert experts.scheme_key == MXFP4 and experts.activation == "swigluoai:1.702:7.0"
        tensors = {k: (v.dtype, tuple(v.shape)) for k, v in experts.state_dict().items()}
        assert tensors == {"w13_weight": (torch.uint8, (4, 128, 32)), "w13_weight_scale": (torch.uint8, (4, 128, 2)),
                           "w13_bias": (torch.bfloat16, (4, 128)), "w2_weight": (torch.uint8, (4, 64, 32)),
                           "w2_weight_scale": (torch.uint8, (4, 64, 2)), "w2_bias": (torch.bfloat16, (4, 64))}
    router = model.model.layers[0].mlp.router
    assert router.weight.dtype == torch.bfloat16 and type(router).__name__ == "GptOssTopKRouter"


def test_experts_are_the_file_bytes_deinterleaved(src):
    """w13 = gate rows (the file's even rows) then up rows (odd rows): the codes, scales and biases as stored."""
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for path, experts in experts_of(_load(str(src), torch.bfloat16)).items():
            blocks, scales, bias = (f.get_tensor(f"{path}.gate_up_proj_{t}") for t in ("blocks", "scales", "bias"))
            order = torch.cat((torch.arange(0, 128, 2), torch.arange(1, 128, 2)))
            assert torch.equal(experts.w13_weight, blocks[:, order].reshape(4, 128, 32))
            assert torch.equal(experts.w13_weight_scale, scales[:, order])
            assert torch.equal(experts.w13_bias, bias[:, order])
            assert torch.equal(experts.w2_weight, f.get_tensor(f"{path}.down_proj_blocks").reshape(4, 64, 32))
            assert torch.equal(experts.w2_weight_scale, f.get_tensor(f"{path}.down_proj_scales"))
            assert torch.equal(experts.w2_bias, f.get_tensor(f"{path}.down_proj_bias"))


def test_experts_decode_as_transformers_decodes_them(src):
    """qcompile's MXFP4 decoder against transformers' convert_moe_packed_tensors, in the HF module's layout
    ([E, H, 2I] gate and up interleaved, [E, I, H]): bit-exact."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for path, experts in experts_of(_load(str(src), torch.float32)).items():
            hf = experts.dequantized(torch.float32)
            for p in ("gate_up_proj", "down_proj"):
                want = convert_moe_packed_tensors(f.get_tensor(f"{path}.{p}_blocks"),
                                                  f.get_tensor(f"{path}.{p}_scales"), dtype=torch.float32)
                assert want.abs().max() > 0
                assert torch.equal(getattr(hf, p), want), f"{path}.{p}"
                assert torch.equal(getattr(hf, f"{p}_bias"), f.get_tensor(f"{path}.{p}_bias").float())


def test_eager_logits_match_transformers(src):
    model, ref = _load(str(src), torch.float32), _transformers(str(src))
    with torch.no_grad():
        got, want = model(IDS).logits, ref(IDS).logits
    assert rel_err(got, want) < 1e-5


def test_compiles_to_one_experts_op_per_layer(src):
    """aot_eager: the graph holds one experts op per MoE layer (no graph break), the routers stay plain matmuls;
    the compiled logits are the eager ones. Inductor: transformers' logits within the same bound."""
    model = _load(str(src), torch.float32)
    want, got, code = compile_graph(model)
    assert torch.equal(got, want)
    assert op_lines(code) == [f"experts_ref layers.{i}.mlp.experts {MXFP4}" for i in (0, 1)]
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="qcompile", fullgraph=True)(IDS).logits
    assert rel_err(got, _transformers(str(src))(IDS).logits) < 1e-5


def test_round_trips(src, tmp_path):
    """save_pretrained writes the fused tensors back: names, dtypes, shapes and bytes of the source, its config.
    Loaded in fp32, the experts still are (their biases written in the stored bf16)."""
    from tests.test_roundtrip import _bytes, assert_same_checkpoint, assert_same_weights

    model = qcompile.load(str(src))
    model.save_pretrained(tmp_path / "bf16")
    assert_same_checkpoint(src, tmp_path / "bf16")
    assert_same_weights(model, qcompile.load(str(tmp_path / "bf16")))
    qcompile.load(str(src), dtype=torch.float32).save_pretrained(tmp_path / "fp32")
    want, got = load_file(src / "model.safetensors"), load_file(tmp_path / "fp32" / "model.safetensors")
    experts = [k for k in want if ".experts." in k]
    assert len(experts) == 12
    for key in experts:
        assert got[key].dtype == want[key].dtype and _bytes(got[key]) == _bytes(want[key]), key


@pytest.mark.parametrize("hidden,inter", [(256, 256), (224, 160)])
def test_tiled_experts_round_trip(src, tmp_path, hidden, inter):
    """A GPU load tiles the experts for wo_mma's grouped build (QuantExperts._tile, here on the CPU; a random
    gpt-oss whose hidden / intermediate sizes are whole chunks of 128, or not, as gpt-oss's 2880: then K is stored
    padded to 256): the reference runs the tiled layout exactly, and saving writes the fused tensors back byte
    for byte."""
    from tests.test_moe_memory import write_gptoss
    from tests.test_roundtrip import assert_same_checkpoint

    path = write_gptoss(src, tmp_path / "src", experts=4, hidden=hidden, inter=inter)
    model = qcompile.load(str(path))
    x = torch.randint(3, 300, (1, 6))
    want = model(x).logits
    experts = list(experts_of(model).values())
    assert experts and all(m._tile() for m in experts)
    assert all(m.scheme_key == "w=fp4_e2m1/group32:e8m0/pack=uint8/tiled;a=none" for m in experts)
    for m in experts:  # [E, N, K / 2] codes and [E, N, K / 32] scales, K padded to 256
        assert m.w13_weight.shape == (4, 2 * inter, 128) and m.w13_weight_scale.shape == (4, 2 * inter, 8)
        assert m.w2_weight.shape == (4, hidden, 128) and m.w2_weight_scale.shape == (4, hidden, 8)
    assert torch.equal(model(x).logits, want)
    model.save_pretrained(tmp_path / "saved")
    assert_same_checkpoint(path, tmp_path / "saved")


# -- malformed checkpoints ---------------------------------------------------------------------

def broken(src: Path, tmp_path: Path, edit=None, config=None) -> str:
    """A copy of the checkpoint with its tensors edited by ``edit(state)`` and config.json by ``config``."""
    return copy_edited(src.parent, tmp_path, NAME, edit, config)


def _set(key, value):
    return lambda state: state.__setitem__(key, value(state[key]))


MALFORMED = {
    "missing scales": (lambda s: s.pop(f"{E0}.gate_up_proj_scales"), rf"{E0}\.gate_up_proj_scales'? is missing"),
    "missing blocks": (lambda s: s.pop(f"{E0}.down_proj_blocks"), rf"{E0}\.down_proj_blocks'? is missing"),
    "missing bias": (lambda s: s.pop(f"{E0}.down_proj_bias"), rf"{E0}\.down_proj_bias'? is missing"),
    "blocks of another shape": (_set(f"{E0}.gate_up_proj_blocks", lambda t: t.reshape(4, 128, 4, 8).contiguous()),
                                rf"{E0}\.gate_up_proj_blocks'? has shape \[4, 128, 4, 8\], expected \[4, 128, 2, 16\]"),
    "scales transposed": (_set(f"{E0}.down_proj_scales", lambda t: t.transpose(1, 2).contiguous()),
                          rf"{E0}\.down_proj_scales'? has shape \[4, 2, 64\]"),
    "scales as floats": (_set(f"{E0}.down_proj_scales", lambda t: t.float()), rf"{E0}\.down_proj_scales'? has dtype"),
    "blocks as int8": (_set(f"{E0}.gate_up_proj_blocks", lambda t: t.view(torch.int8)),
                       rf"{E0}\.gate_up_proj_blocks'? has dtype torch.int8"),
    "an expert missing": (_set(f"{E0}.down_proj_bias", lambda t: t[:3].contiguous()),
                          rf"{E0}\.down_proj_bias'? has shape \[3, 64\], expected \[4, 64\]"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_checkpoint(src, tmp_path, case):
    edit, match = MALFORMED[case]
    with pytest.raises(CheckpointError, match=match):
        qcompile.load(broken(src, tmp_path, edit))


def test_experts_left_unquantized_by_the_config_but_stored_quantized(src, tmp_path):
    def config(cfg):
        cfg["quantization_config"]["modules_to_not_convert"].append("model.layers.0.mlp")
    with pytest.raises(CheckpointError, match=rf"{E0}: .*unquantized.*\({E0}\.\w+_(blocks|scales): torch.uint8"):
        qcompile.load(broken(src, tmp_path, config=config))


def test_experts_kernel_on_sm90(src, monkeypatch):
    """On a CUDA sm_90 device (mocked) the bf16 model's experts lower to the weight-only MoE, biases and
    gpt-oss's activation included: nothing dropped (no reason)."""
    from tests.test_moe_formats import sm90_rows

    rows = sm90_rows(experts_of(_load(str(src), torch.bfloat16))[E0], monkeypatch)
    assert [(r.kernel, r.reason) for r in rows] == [("wo_moe", "")]


def test_experts_left_unquantized_load_as_stored(src, tmp_path):
    """Layer 1's experts listed in modules_to_not_convert and stored in bf16 (the HF module's own
    ``gate_up_proj`` [E, H, 2I] / ``down_proj``): they stay an HF experts module; the model still matches
    transformers' on the same file."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    e1 = "model.layers.1.mlp.experts"

    def edit(state):
        for p in ("gate_up_proj", "down_proj"):
            blocks, scales = state.pop(f"{e1}.{p}_blocks"), state.pop(f"{e1}.{p}_scales")
            state[f"{e1}.{p}"] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)

    def config(cfg):
        cfg["quantization_config"]["modules_to_not_convert"].append(e1)
    path = broken(src, tmp_path, edit, config)
    with pytest.warns(UserWarning, match=rf"1 MoE experts modules stay in torch.float32 \({e1}"):
        model = qcompile.load(path, dtype=torch.float32)
    assert list(experts_of(model)) == [E0]
    assert type(model.get_submodule(e1)).__name__ == "GptOssExperts"
    with torch.no_grad():
        assert rel_err(model(IDS).logits, _transformers(path)(IDS).logits) < 1e-5


@pytest.mark.gpu
def test_gpu_compiled_model_runs_wo_moe(src):
    """Loaded on the GPU in bf16 and compiled by qcompile under inductor: both experts layers run ``wo_moe``
    (tiled at load where wo_mma takes the shape, else its Triton kernel), and the logits stay within 2e-2 of the
    eager model's (the reference op, which the CPU tests hold to transformers' model; bf16 roundings in another
    order)."""
    model = qcompile.load(str(src), device="cuda")
    ids = IDS.cuda()
    be = qcompile.backend()
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(ids).logits.float()
        got = torch.compile(model, backend=be, fullgraph=True)(ids).logits.float()
    experts = [r for r in be.rows if r.op == "qcompile::wo_moe"]
    assert len(experts) == 2 and {r.kernel for r in experts} == {"wo_moe"}, be.explain()
    assert rel_err(got, want) < 2e-2


@pytest.mark.gpu
def test_gpu_decode_step_attention_with_sinks(src):
    """One-token decode steps on the GPU in bf16, compiled by qcompile under inductor with qcompile's static cache:
    both layers' attention (sinks, one sliding-window layer) runs decode_attention with the sinks, and the logits of
    three greedy steps stay within 2e-2 of the eager model's."""
    from qcompile.kv_cache import cache_kwargs, static_cache

    model = qcompile.load(str(src), device="cuda")
    ids = IDS.cuda()
    n = ids.shape[1]
    graphs = []

    def run(compiled: bool):
        cache = static_cache(model, n + 8)
        kw = cache_kwargs(model, cache)

        def step(tok, pos):
            return model(input_ids=tok, cache_position=pos, use_cache=True, **kw).logits

        if compiled:
            torch._dynamo.reset()
            be = qcompile.backend(on_graph=lambda before, after: graphs.append(after))
            step = torch.compile(step, backend=be, fullgraph=True, dynamic=False)
        with torch.no_grad():
            logits = model(input_ids=ids, cache_position=torch.arange(n, device="cuda"), use_cache=True, **kw).logits
            out = []
            for i in range(3):
                out.append(step(logits[:, -1:].argmax(-1), torch.tensor([n + i], device="cuda")).float())
                logits = out[-1]
        return torch.cat(out, 1)

    want, got = run(False), run(True)
    assert len(graphs) == 1 and graphs[0].count("decode_attention.default(") == 2, graphs
    assert rel_err(got, want) < 2e-2


def test_synth_writes_openais_layout(tmp_path):
    """qcompile.synth's gptoss-mxfp4 writer (the end-to-end benchmark's gpt-oss checkpoints): transformers'
    own decoder reads its experts back within MXFP4's rounding of the bf16 weights (at most one unit of each
    group's power-of-two scale: half the widest e2m1 step, 4 to 6), biases unchanged, and qcompile loads it as
    the test checkpoint above."""
    from transformers import AutoModelForCausalLM, GptOssConfig
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from qcompile import synth

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GptOssConfig(
        hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320, sliding_window=8),
        dtype=torch.bfloat16)
    path = synth.write_model(str(tmp_path / "w"), model, synth.GPTOSS_MXFP4)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        for p in ("gate_up_proj", "down_proj"):
            key = f"{E0}.{p}"
            scales = f.get_tensor(f"{key}_scales")
            got = convert_moe_packed_tensors(f.get_tensor(f"{key}_blocks"), scales, dtype=torch.float32)
            want = getattr(model.model.layers[0].mlp.experts, p).float()
            unit = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).transpose(1, 2)  # [E, K, N] as want
            assert ((got - want).abs() <= unit).all(), p
            assert torch.equal(f.get_tensor(f"{key}_bias"), getattr(model.model.layers[0].mlp.experts, f"{p}_bias"))
    assert list(experts_of(qcompile.load(path))) == [E0, "model.layers.1.mlp.experts"]
