"""fp8 block quantisation (engine_ext/format/quantize.py) and the publisher's ``quantize="fp8-block"``.

The recipe is the DeepSeek-V3 / Qwen3-FP8 one: per 128x128 tile, scale = amax / 448, weights
cast to e4m3fn; partial edge tiles; router gates, norms, embeddings, ``lm_head`` kept (bf16).
The publisher quantises every version from the master weights, so a chain of deltas read
back and applied gives, byte for byte, the fp8 checkpoint of the final master weights.
"""
import torch

from engine_ext.store import route
from engine_ext.format.dtypes import as_bits
from engine_ext.trainer.publisher import DeltaPublisher
from engine_ext.format.quantize import FP8, FP8_MAX, dequantize_fp8_block, fp8_block_state_dict, quantization_config, quantize_fp8_block
from test_publish import materialise


def test_block_recipe():
    torch.manual_seed(0)
    w = (0.02 * torch.randn(300, 200)).to(torch.bfloat16)
    q, s = quantize_fp8_block(w)
    assert q.dtype == FP8 and q.shape == w.shape and s.shape == (3, 2) and s.dtype == torch.float32
    tiles = torch.zeros(384, 256)
    tiles[:300, :200] = w.float()
    amax = tiles.view(3, 128, 2, 128).abs().amax(dim=(1, 3))
    assert torch.equal(s, amax / FP8_MAX)
    assert torch.equal(q.float().abs().view(-1).max(), torch.tensor(FP8_MAX))  # each tile's maximum maps to 448
    err = (dequantize_fp8_block(q, s) - w.float()).abs()
    assert bool((err <= s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200] * 32).all())  # e4m3: 3 mantissa bits


def test_state_dict_and_config():
    sd = {"model.embed_tokens.weight": torch.randn(10, 128), "model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128),
          "model.layers.0.self_attn.q_proj.bias": torch.randn(128), "model.layers.0.mlp.gate.weight": torch.randn(8, 128),
          "model.layers.0.mlp.experts.3.down_proj.weight": torch.randn(128, 64), "model.norm.weight": torch.randn(128),
          "lm_head.weight": torch.randn(10, 128)}
    out = fp8_block_state_dict(sd)
    assert [n for n, t in out.items() if t.dtype == FP8] == ["model.layers.0.self_attn.q_proj.weight",
                                                              "model.layers.0.mlp.experts.3.down_proj.weight"]
    assert out["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].shape == (1, 1)
    assert all(t.dtype == torch.bfloat16 for n, t in out.items() if t.dtype != FP8 and "scale" not in n)
    assert quantization_config(sd)["ignored_layers"] == ["model.layers.0.mlp.gate"]  # vLLM would build it as fp8


def test_publisher_quantizes_every_version(tmp_path):
    torch.manual_seed(1)
    master = {"model.layers.0.mlp.down_proj.weight": 0.02 * torch.randn(256, 200),
              "model.norm.weight": 1 + 0.1 * torch.randn(200)}
    versions = [dict(master)]
    for _ in range(3):
        master = {n: t + 1e-3 * t.abs() * torch.randn_like(t) for n, t in master.items()}
        versions.append(master)
    with DeltaPublisher(str(tmp_path), "fp8", anchor_every=0, quantize="fp8-block") as pub:
        for v in versions:
            pub.publish(v)
    d = route.resolve(str(tmp_path), have_version=0)
    got = materialise(fp8_block_state_dict(versions[0]), d)
    want = fp8_block_state_dict(versions[-1])
    assert set(got) == set(want) and all(torch.equal(as_bits(got[n]), as_bits(want[n])) for n in want)
    changed = {t.name: t.nnz for t in d.tensors}
    numel = want["model.layers.0.mlp.down_proj.weight"].numel()
    assert 0 < changed["model.layers.0.mlp.down_proj.weight"] < numel // 4  # sparse fp8 bytes
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" in {t.name for t in d.tensors}


def test_quantizer_reads_the_masters_and_dtype_casts_only_what_it_leaves(tmp_path):
    """With a served dtype (bf16 by default) and quantize="fp8-block", the fp8 bytes and scales come
    from the fp32 masters, never from a bf16 copy of them; the served dtype applies to the tensors
    the recipe leaves unquantised; the scales stay float32. dtype=None leaves those as held."""
    torch.manual_seed(2)
    master = {"model.layers.0.mlp.down_proj.weight": 0.02 * torch.randn(256, 200),
              "model.norm.weight": 1 + 0.1 * torch.randn(200)}
    for dtype, rest in [(torch.bfloat16, "bfloat16"), (None, "float32")]:
        root = tmp_path / str(rest)
        with DeltaPublisher(str(root), "fp8", anchor_every=0, quantize="fp8-block", dtype=dtype) as pub:
            pub.publish(master)
        got = materialise({}, route.resolve(str(root)))
        want = fp8_block_state_dict(master, rest_dtype=dtype)
        assert {n: str(t.dtype) for n, t in got.items()} == {
            "model.layers.0.mlp.down_proj.weight": "torch.float8_e4m3fn", "model.layers.0.mlp.down_proj.weight_scale_inv":
            "torch.float32", "model.norm.weight": f"torch.{rest}"}
        assert all(torch.equal(as_bits(got[n]), as_bits(want[n])) for n in want)
    from_bf16 = fp8_block_state_dict({n: t.to(torch.bfloat16) for n, t in master.items()})
    assert not torch.equal(as_bits(got["model.layers.0.mlp.down_proj.weight_scale_inv"]),
                           as_bits(from_bf16["model.layers.0.mlp.down_proj.weight_scale_inv"]))  # the masters, not a bf16 copy
