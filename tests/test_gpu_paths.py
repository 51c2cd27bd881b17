"""vLLM 0.32's CUDA post-processing of the weights, path by path, run here on CPU tensors (docs/GPU.md has the table).

On a GPU the vLLM adapter refreshes no derived copy (engine_ext/engines/vllm/worker.py::build_updater: no refresh
hook off the CPU), so every copy that post-processing derives from a checkpoint tensor must be caught at start-up:
by the census (a new tensor computed from a weight: ``unreproducible``) or by the load check (the parameter the
loader writes was transformed: ``mismatched``). Either refuses updates writing that tensor (409). A copy caught by
neither is a silent divergence.

Each test runs vLLM's own post-processing function (named in its docstring) on small CPU tensors under the census,
with vLLM's platform answering CUDA (tests/gpu_emulation.py::cuda_platform) and, where a CUDA library would be
called, one stand-in for that one function, named in the docstring. Branches that need a CUDA op for the copy itself
are not emulated: gpu_acceptance/gpu_proof.py section (e) checks them where vLLM and a GPU are both present.
"""
from __future__ import annotations

import torch
import pytest

pytest.importorskip("vllm")

# vLLM's modules are imported under the CPU platform, before any emulation (some decide things at import)
from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel  # noqa: E402
from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import DeepGemmFp8BlockScaledMMKernel  # noqa: E402
from vllm.model_executor.kernels.linear.scaled_mm.pytorch import BlockWiseTorchFP8ScaledMMLinearKernel  # noqa: E402
from vllm.model_executor.kernels.linear.scaled_mm.triton import TritonFp8BlockScaledMMKernel  # noqa: E402
from vllm.model_executor.layers.attention.attention import Attention, set_default_quant_scales  # noqa: E402
from vllm.model_executor.layers.attention.mla_attention import MLAAttention  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,  # noqa: E402
                                                         RoutingMethodType)
from vllm.model_executor.layers.fused_moe.oracle import fp8 as fp8_oracle  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle import unquantized as bf16_oracle  # noqa: E402
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod  # noqa: E402
from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.layers.quantization import fp8 as vllm_fp8  # noqa: E402
from vllm.model_executor.layers.quantization.online import fp8 as _online_fp8  # noqa: E402,F401 - imported by the MLA dequant
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: E402
from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl  # noqa: E402

from engine_ext.engines.vllm.census import claimed  # noqa: E402
from gpu_emulation import (checkpoint_of, deep_gemm_sm90, flashinfer_permute_indices, outcome, process,  # noqa: E402
                           vllm_method_source)

HOPPER, BLACKWELL = (9, 0), (10, 0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def _bf16(*shape, seed=0) -> torch.nn.Parameter:
    return _param((torch.randn(*shape, generator=_gen(seed)) * 0.02).to(torch.bfloat16))


def _fp8(*shape, seed=0) -> torch.nn.Parameter:
    """Block-quantised fp8 e4m3 values as a checkpoint holds them (magnitudes up to 448)."""
    return _param((torch.randn(*shape, generator=_gen(seed)) * 120).clamp(-448, 448).to(torch.float8_e4m3fn))


def _block_scales(*shape, seed=0, ue8m0=False) -> torch.nn.Parameter:
    """fp32 block scales (``weight_scale_inv``): a trainer's quantiser (any positive value), or UE8M0 (powers of two,
    as DeepSeek-V3.1-style checkpoints carry: ``scale_fmt: ue8m0``)."""
    s = torch.rand(*shape, generator=_gen(seed)) * 1e-3 + 1e-4
    return _param(torch.exp2(torch.round(torch.log2(s))) if ue8m0 else s)


# ---------------------------------------------------------------------------- bf16 dense


def test_bf16_dense_derives_nothing_on_cuda():
    """``UnquantizedLinearMethod.process_weights_after_loading`` and ``UnquantizedEmbeddingMethod``'s (vllm
    model_executor/layers/linear.py, vocab_parallel_embedding.py) with the platform answering CUDA (H100): both
    branch on ``is_cpu()`` only, so nothing is packed; the GEMM reads ``layer.weight`` (``default_unquantized_gemm``).
    The attention layer's own step (``Attention.process_weights_after_loading``, with the backends' default impl
    step) sets KV-cache scales from no weight. Nothing is derived, nothing refused: updates write in place."""
    model = torch.nn.Module()
    model.embed = torch.nn.Module()
    model.embed.weight = _bf16(128, 64, seed=1)
    model.embed.quant_method = UnquantizedEmbeddingMethod()
    model.qkv = torch.nn.Module()
    model.qkv.weight = _bf16(96, 64, seed=2)
    model.qkv.quant_method = UnquantizedLinearMethod()
    model.attn = torch.nn.Module()
    model.attn.impl = TritonMLAImpl.__new__(TritonMLAImpl)  # any v1 impl: their step is AttentionImplBase's no-op
    model.attn.quant_config = None
    set_default_quant_scales(model.attn, register_buffer=True)  # as vLLM's attention layer registers them
    ckpt = checkpoint_of(model)

    def post():
        for m in (model.embed, model.qkv):
            m.quant_method.process_weights_after_loading(m)
        Attention.process_weights_after_loading(model.attn, torch.bfloat16)

    process(model, post, HOPPER)
    assert model.qkv.weight.numel() == 96 * 64  # on the CPU platform the same call drops it for a packed copy
    out = outcome(model, ckpt)
    assert out.derived == {} and out.refused == set() and out.fallback == ()
    assert model.attn._k_scale_cpu is not None  # the host-side scale exists and refuses nothing


# ---------------------------------------------------------------------------- fp8 block dense


def _fp8_linear(kernel, ue8m0=False, seed=0) -> torch.nn.Module:
    """A block-fp8 linear layer as ``Fp8LinearMethod.create_weights`` leaves it loaded (``weight`` fp8 [256, 256],
    ``weight_scale_inv`` fp32 [2, 2], block 128 x 128), with ``kernel`` as the method's linear kernel."""
    layer = torch.nn.Module()
    layer.weight = _fp8(256, 256, seed=seed)
    if ue8m0:  # a UE8M0 quantiser leaves every block's largest magnitude in (224, 448]
        with torch.no_grad():
            w = layer.weight.data.float()
            for r in (0, 128):
                for c in (0, 128):
                    w[r, c] = 400.0 if (r + c) % 256 else -320.0
            layer.weight.data.copy_(w.to(torch.float8_e4m3fn))
    layer.weight_scale_inv = _block_scales(2, 2, seed=seed + 1, ue8m0=ue8m0)
    layer.weight_block_size = [128, 128]
    k = object.__new__(kernel)
    k.use_deep_gemm_e8m0, k.is_deep_gemm_supported = True, True  # as DeepGemmFp8BlockScaledMMKernel.__init__ sets them on H100
    method = object.__new__(vllm_fp8.Fp8LinearMethod)
    method.use_marlin, method.block_quant, method.act_q_static, method.fp8_linear = False, True, False, k
    layer.quant_method = method
    return layer


@pytest.mark.parametrize("kernel", [TritonFp8BlockScaledMMKernel, CutlassFp8BlockScaledMMKernel,
                                    BlockWiseTorchFP8ScaledMMLinearKernel])
def test_fp8_block_dense_without_deep_gemm_is_views_only(kernel):
    """``Fp8LinearMethod.process_weights_after_loading`` then ``Fp8BlockScaledMMLinearKernel.process_weights_after_loading``
    (vllm model_executor/layers/quantization/fp8.py, kernels/linear/scaled_mm/BlockScaledMMLinearKernel.py), which
    the Triton, CUTLASS and torch block kernels inherit, with the platform answering CUDA (H100):
    ``process_fp8_weight_block_strategy`` normalises to FNUZ only on ROCm and pads only on ROCm, so the weight and
    its scales are re-registered over the same storages (``replace_parameter`` of ``.data``). Nothing derived,
    nothing refused: the kernel reads what updates write."""
    assert "process_weights_after_loading" not in vars(kernel)  # the inherited step is the one run here
    layer = _fp8_linear(kernel)
    ckpt, before = checkpoint_of(layer), layer.weight.data_ptr()
    process(layer, lambda: layer.quant_method.process_weights_after_loading(layer), HOPPER)
    assert layer.weight.data_ptr() == before
    out = outcome(layer, ckpt)
    assert out.derived == {} and out.refused == set()


def test_fp8_block_dense_deep_gemm_requantises_in_place_and_is_refused():
    """``DeepGemmFp8BlockScaledMMKernel.process_weights_after_loading`` (vllm kernels/linear/scaled_mm/deep_gemm.py),
    vLLM's choice for block-fp8 linear layers on H100/H200/B200 when DeepGEMM is present (the CUDA wheel vendors
    it), with ``VLLM_USE_DEEP_GEMM_E8M0=1`` (the default): ``deepgemm_post_process_fp8_weight_block`` calls
    ``requant_weight_ue8m0_inplace`` (fp8_utils.py), pure torch, which re-quantises every 128 x 128 block to a
    power-of-two scale *in place*, in the very storages the loader writes. Emulated: the platform (H100) and
    DeepGEMM's SM90 ``transform_sf_into_required_layout`` (returns fp32 scales as they are; gpu_emulation.deep_gemm_sm90).

    The live weight and scales no longer equal the checkpoint: the load check names both (``mismatched``), and
    updates writing them are refused. The census refuses both too: post-processing computed each from the other,
    in the storages the maps write (it does not wait for a byte to change: the UE8M0 checkpoint below)."""
    layer = _fp8_linear(DeepGemmFp8BlockScaledMMKernel)
    ckpt = checkpoint_of(layer)
    with deep_gemm_sm90():
        process(layer, lambda: layer.quant_method.process_weights_after_loading(layer), HOPPER)
    assert not torch.equal(layer.weight_scale_inv.data, ckpt["weight_scale_inv"])
    assert torch.equal(torch.exp2(torch.log2(layer.weight_scale_inv.data).round()), layer.weight_scale_inv.data)
    out = outcome(layer, ckpt)
    assert out.derived == {"": ["weight", "weight_scale_inv"]}
    assert set(out.mismatched) == set(out.unreproducible) == {"weight", "weight_scale_inv"}


def _cold(weight: torch.Tensor, scale: torch.Tensor) -> torch.nn.Module:
    """A fresh DeepGEMM layer loaded with (``weight``, ``scale``) and post-processed: what a cold start serves."""
    layer = _fp8_linear(DeepGemmFp8BlockScaledMMKernel)
    with torch.no_grad():
        layer.weight.data.copy_(weight)
        layer.weight_scale_inv.data.copy_(scale)
    with deep_gemm_sm90():
        process(layer, lambda: layer.quant_method.process_weights_after_loading(layer), HOPPER)
    return layer


def _ue8m0_layer_and_update():
    """A UE8M0 checkpoint post-processed by DeepGEMM (requantisation: the identity on it), and an update that a
    trainer's fp32 block quantiser produced (scales that are not powers of two), written in place."""
    layer = _fp8_linear(DeepGemmFp8BlockScaledMMKernel, ue8m0=True)
    ckpt = checkpoint_of(layer)
    with deep_gemm_sm90():
        process(layer, lambda: layer.quant_method.process_weights_after_loading(layer), HOPPER)
    new_w, new_s = _fp8(256, 256, seed=7).data, _block_scales(2, 2, seed=8).data
    return layer, ckpt, new_w, new_s


def test_a_ue8m0_checkpoint_on_deep_gemm_is_refused():
    """The path above with a checkpoint whose scales are already UE8M0 (DeepSeek-V3.1 style): the in-place
    requantisation leaves every byte as loaded, so the load check passes; yet an update whose scales are not powers
    of two, written in place, would be served as written while a cold start requantises it. The census refuses the
    weight and its scales at start-up: post-processing computed each from the other in the storages the maps write.
    (Before issue 50's closing change the census left every storage the maps write to the load check, and this
    checkpoint's updates were accepted.)"""
    layer, ckpt, new_w, new_s = _ue8m0_layer_and_update()
    out = outcome(layer, ckpt)
    assert out.derived == {"": ["weight", "weight_scale_inv"]} and out.mismatched == ()
    assert set(out.unreproducible) == {"weight", "weight_scale_inv"}
    with torch.no_grad():  # what an accepted update would have written (identity maps: the parameters themselves)
        layer.weight.data.copy_(new_w)
        layer.weight_scale_inv.data.copy_(new_s)
    cold = _cold(new_w, new_s)
    assert not torch.equal(layer.weight_scale_inv.data, cold.weight_scale_inv.data)  # why it must be refused
    assert not torch.equal(layer.weight.data.view(torch.uint8), cold.weight.data.view(torch.uint8))


# ---------------------------------------------------------------------------- MoE


E, H, I = 2, 256, 256  # experts, hidden, intermediate: multiples of the 128 x 128 blocks


def _moe_config() -> FusedMoEConfig:
    parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=1, ep_size=1, tp_rank=0, pcp_rank=0, dp_rank=0,
                                      ep_rank=0, sp_size=1, use_ep=False, all2all_backend="naive", enable_eplb=False)
    return FusedMoEConfig(num_experts=E, experts_per_token=2, hidden_dim=H, intermediate_size=I, num_local_experts=E,
                          num_logical_experts=E, activation=MoEActivation.SILU, device="cpu",
                          routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
                          in_dtype=torch.bfloat16, intermediate_size_per_partition=I,
                          intermediate_size_per_partition_unpadded=I, hidden_dim_unpadded=H)


def _experts_layer(fp8: bool) -> torch.nn.Module:
    """A routed-experts layer as the MoE methods' ``create_weights`` leave it loaded: ``w13_weight`` [E, 2I, H]
    (gate then up), ``w2_weight`` [E, H, I], and for block fp8 their ``*_weight_scale_inv`` [E, ., .]."""
    layer = torch.nn.Module()
    if fp8:
        layer.w13_weight, layer.w2_weight = _fp8(E, 2 * I, H, seed=1), _fp8(E, H, I, seed=2)
        layer.w13_weight_scale_inv = _block_scales(E, 2 * I // 128, H // 128, seed=3)
        layer.w2_weight_scale_inv = _block_scales(E, H // 128, I // 128, seed=4)
        layer.w13_input_scale = layer.w2_input_scale = None
        layer.weight_block_size = [128, 128]
    else:
        layer.w13_weight, layer.w2_weight = _bf16(E, 2 * I, H, seed=1), _bf16(E, H, I, seed=2)
    layer.moe_config = _moe_config()
    layer.local_num_experts, layer.intermediate_size_per_partition = E, I
    layer.activation = MoEActivation.SILU
    layer._expert_routing_tables = lambda: None  # no expert-parallel routing tables (RoutedExperts' answer without EP)
    return layer


BF16_MOE = {
    # backend: checkpoint tensors refused (by the load check: the loaded parameter is transformed)
    "TRITON": set(),  # H100/H200's choice: .contiguous() of contiguous weights, nothing derived
    "FLASHINFER_CUTLASS": {"w13_weight"},  # swap_w13_to_w31: a new [w3; w1] tensor replaces w13_weight
    "FLASHINFER_TRTLLM": {"w13_weight", "w2_weight"},  # B200's choice: both permuted into block layout in place
}


@pytest.mark.parametrize("backend", sorted(BF16_MOE))
def test_bf16_moe_on_each_cuda_backend(backend):
    """``UnquantizedFusedMoEMethod.process_weights_after_loading`` (vllm fused_moe/unquantized_fused_moe_method.py)
    with the backend forced, which runs ``convert_to_unquantized_kernel_format`` (fused_moe/oracle/unquantized.py)
    and builds vLLM's real modular kernel (``make_unquantized_moe_kernel``: prepare/finalize and the backend's
    experts, whose own post-processing step then runs). Emulated: the platform (B200, where all three are
    candidates: FlashInfer TRT-LLM first, then CUTLASS, then Triton; H100/H200 put Triton first), and for
    FLASHINFER_TRTLLM FlashInfer's two row-permutation helpers (gpu_emulation.flashinfer_permute_indices).

    Every transform replaces or rewrites the parameter the loader writes, so the load check refuses exactly the
    tensors it transformed; Triton derives nothing."""
    layer = _experts_layer(fp8=False)
    method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    torch.nn.Module.__init__(method)  # a CustomOp (an nn.Module): the layer holds it as a submodule, as vLLM's does
    method.moe, method.moe_quant_config, method.moe_kernel = layer.moe_config, None, None
    method.unquantized_backend = bf16_oracle.UnquantizedMoeBackend[backend]
    method.experts_cls = bf16_oracle.backend_to_kernel_cls(method.unquantized_backend)[0]
    layer.quant_method = method
    ckpt = checkpoint_of(layer)
    if backend == "FLASHINFER_TRTLLM":
        with flashinfer_permute_indices():
            process(layer, lambda: method.process_weights_after_loading(layer), BLACKWELL)
    else:
        process(layer, lambda: method.process_weights_after_loading(layer), BLACKWELL)
    assert method.moe_kernel is not None  # the real kernel object was built (and walked by the census)
    out = outcome(layer, ckpt)
    assert set(out.mismatched) == BF16_MOE[backend] and out.unreproducible == {}, out
    assert not any(claimed(m) for m in layer.modules())  # the vLLM adapter claims (refreshes) none of it


FP8_MOE = {
    "TRITON": set(),  # H100/H200's choice for block fp8 without expert parallelism: weights as loaded
    "VLLM_CUTLASS": set(),  # TritonOrCutlassExperts: weights as loaded
    "DEEPGEMM": {"w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"},  # UE8M0 requant in place
    "FLASHINFER_CUTLASS": {"w13_weight", "w13_weight_scale_inv"},  # H100/H200 with expert parallelism: [w3; w1] swap
    # B200: w13/w2 gathered into new 4-D BlockMajorK tensors the loader cannot write (dense fallback: the census
    # refuses them, the reload would write the checkpoint's layout there), the w13 scales swapped to [w3; w1]
    "FLASHINFER_TRTLLM": {"w13_weight", "w2_weight", "w13_weight_scale_inv"},
}


@pytest.mark.parametrize("backend", sorted(FP8_MOE))
def test_fp8_block_moe_on_each_cuda_backend(backend):
    """``Fp8MoEMethod.process_weights_after_loading`` (vllm model_executor/layers/quantization/fp8.py) with the
    backend forced: ``convert_to_fp8_moe_kernel_format`` (fused_moe/oracle/fp8.py; DEEPGEMM:
    ``prepare_fp8_moe_layer_for_deepgemm`` = the UE8M0 requantisation in place; FLASHINFER_CUTLASS:
    ``prepare_fp8_moe_layer_for_fi``, pure torch for block fp8: the [w3; w1] swap of weights and scales and an
    in-place ``clamp_(min=1e-10)`` of the scales), ``replace_parameter``, and vLLM's real modular kernel
    (``make_fp8_moe_kernel``). Emulated: the platform (H100; B200 for FLASHINFER_TRTLLM), for DEEPGEMM
    gpu_emulation.deep_gemm_sm90, for FLASHINFER_TRTLLM FlashInfer's row-permutation helper
    (``_shuffle_deepseek_fp8_moe_weights`` into the BlockMajorK layout; its experts object is not built: its
    constructor asks for the accelerator's device index, so only its quant config is).

    The load check refuses the tensors the conversion rewrote in place or re-registered in a layout the loader
    still writes; the census refuses those it re-laid into a layout the loader cannot write (FLASHINFER_TRTLLM);
    Triton and vLLM's CUTLASS derive nothing."""
    layer = _experts_layer(fp8=True)
    method = vllm_fp8.Fp8MoEMethod.__new__(vllm_fp8.Fp8MoEMethod)
    method.moe, method.moe_quant_config, method.moe_kernel = layer.moe_config, None, None
    method.quant_config = type("Fp8Config", (), {"activation_scheme": "dynamic", "weight_block_size": [128, 128]})()
    method.weight_block_size = method.moe_block_shape = [128, 128]
    method.block_quant, method.weight_scale_name, method.weight_scale_refine = True, "weight_scale_inv", None
    method.fp8_backend = fp8_oracle.Fp8MoeBackend[backend]
    method.experts_cls = fp8_oracle.backend_to_kernel_cls(method.fp8_backend)[0]
    layer.quant_method = method
    if backend == "FLASHINFER_TRTLLM":  # its experts' constructor asks torch for the accelerator's device index
        method._init_moe_kernel = lambda layer: setattr(method, "moe_quant_config", method.get_fused_moe_quant_config(layer))
    ckpt = checkpoint_of(layer)
    with deep_gemm_sm90(), flashinfer_permute_indices():
        process(layer, lambda: method.process_weights_after_loading(layer), BLACKWELL if "TRTLLM" in backend else HOPPER)
    assert method.moe_kernel is not None or backend == "FLASHINFER_TRTLLM"
    out = outcome(layer, ckpt)
    assert out.refused == FP8_MOE[backend], out
    if backend == "FLASHINFER_TRTLLM":
        assert set(out.unreproducible) == set(out.fallback) == {"w13_weight", "w2_weight"}
        assert "computed from it" in out.unreproducible["w13_weight"]
    else:  # the load check names what changed a byte; the census what was computed from other weights (DeepGEMM)
        assert set(out.mismatched) == FP8_MOE[backend], out
        assert set(out.unreproducible) == (FP8_MOE[backend] if backend == "DEEPGEMM" else set()), out


# ---------------------------------------------------------------------------- MLA


def _mla(fp8: bool) -> torch.nn.Module:
    """DeepSeek-V2/V3's attention in small: ``kv_b_proj`` (bf16, or block fp8 with its scales, as DeepSeek-V3's
    checkpoint has it) and the ``MLAAttention`` layer that holds it (2 heads, nope 64, v 64, latent 256)."""
    n, p, v, latent = 2, 64, 64, 256
    model = torch.nn.Module()
    kv = torch.nn.Module()
    if fp8:
        kv.weight = _fp8(n * (p + v), latent, seed=5)
        kv.weight_scale_inv = _block_scales(n * (p + v) // 128, latent // 128, seed=6)
        kv.weight_block_size = [128, 128]
        method = object.__new__(vllm_fp8.Fp8LinearMethod)
        method.use_marlin, method.use_deep_gemm, method.block_quant = False, False, True
        kv.quant_method = method
    else:
        kv.weight = _bf16(n * (p + v), latent, seed=5)
        kv.quant_method = UnquantizedLinearMethod()
    attn = MLAAttention.__new__(MLAAttention)
    torch.nn.Module.__init__(attn)
    attn.impl = TritonMLAImpl.__new__(TritonMLAImpl)  # Triton MLA (and FlashMLA, CUTLASS MLA ...): no step of their own
    attn.is_amx_bmm_enabled = attn.dcp_q_replicate = False
    attn.is_aiter_triton_fp4_bmm_enabled = attn.is_aiter_triton_fp8_bmm_enabled = False
    attn.kv_b_proj, attn.kv_lora_rank, attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim = kv, latent, n, p, v
    attn.quant_config, attn.layer_name = None, "attn"
    set_default_quant_scales(attn, register_buffer=True)
    model.kv_b_proj, model.attn = kv, attn
    return model


def test_mla_bf16_holds_views_of_kv_b_proj():
    """``MLAAttention.process_weights_after_loading`` (vllm model_executor/layers/attention/mla_attention.py) with the
    platform answering CUDA (H100): ``split_kv_b_proj`` takes ``kv_b_proj.weight.to(bf16)`` (the same tensor) and
    registers ``W_UK_T``/``W_UV`` as permuted views of it. Views follow every in-place write: nothing derived,
    nothing refused (and the KV-cache scales made here refuse nothing)."""
    model = _mla(fp8=False)
    ckpt = {"kv_b_proj.weight": model.kv_b_proj.weight.detach().clone()}
    process(model, lambda: model.attn.process_weights_after_loading(torch.bfloat16), HOPPER)
    assert model.attn.W_UK_T.untyped_storage().data_ptr() == model.kv_b_proj.weight.untyped_storage().data_ptr()
    out = outcome(model, ckpt)
    assert out.derived == {} and out.refused == set()


def test_mla_fp8_dequantised_copies_are_named_and_refused():
    """The same step on a block-fp8 ``kv_b_proj`` whose linear kernel is not DeepGEMM (Triton or CUTLASS block
    GEMM): ``get_and_maybe_dequant_weights`` dequantises with ``scaled_dequantize`` (pure torch) into new bf16
    tensors, registered as the ``W_UK_T``/``W_UV`` parameters of the attention layer. The census names them from
    provenance, so ``kv_b_proj.weight`` and its scales are refused. Emulated: the platform (H100). (With DeepGEMM the
    dequantisation is the layer's own GEMM on an identity matrix, a CUDA op: gpu_acceptance/gpu_proof.py section (e).)"""
    model = _mla(fp8=True)
    ckpt = {f"kv_b_proj.{n}": p.detach().clone() for n, p in model.kv_b_proj.named_parameters()}
    process(model, lambda: model.attn.process_weights_after_loading(torch.bfloat16), HOPPER)
    out = outcome(model, ckpt)
    assert out.derived == {"attn": ["W_UK_T", "W_UV"]}
    assert set(out.unreproducible) == {"kv_b_proj.weight", "kv_b_proj.weight_scale_inv"} and out.mismatched == ()
    assert "W_UK_T" in out.unreproducible["kv_b_proj.weight"]


# ---------------------------------------------------------------------------- GPT-OSS


def test_gpt_oss_attention_sinks_on_flashinfer_are_named_and_refused():
    """``FlashInferImpl.process_weights_after_loading`` (vllm v1/attention/backends/flashinfer.py: GPT-OSS's
    attention on B200) keeps a float32 copy of the layer's bf16 ``sinks`` (a checkpoint tensor) as ``impl.sinks``.
    The backend module imports FlashInfer, which is not installed here: the method is compiled from vLLM's source
    text alone (gpu_emulation.vllm_method_source) and run on an object holding what ``FlashInferImpl.__init__`` sets
    (``_sinks_source`` and ``sinks``: the parameter). The census names the copy by provenance (the ``to`` op), so
    ``sinks`` is refused. (On H100/H200 GPT-OSS runs FlashAttention 3, which reads the parameter itself.)"""
    model = torch.nn.Module()
    model.sinks = _bf16(4, seed=9)
    impl = type("FlashInferImpl", (), {})()
    impl.__class__.__module__ = "vllm.v1.attention.backends.flashinfer"  # what the census walks into (vLLM's objects)
    impl._sinks_source = impl.sinks = model.sinks
    step = vllm_method_source("v1/attention/backends/flashinfer.py", "FlashInferImpl", "process_weights_after_loading",
                              {"torch": torch})
    model.attn = torch.nn.Module()
    model.attn.impl = impl
    ckpt = checkpoint_of(model)
    process(model, lambda: step(impl, torch.bfloat16), BLACKWELL)
    assert impl.sinks.dtype == torch.float32
    out = outcome(model, ckpt)
    assert out.derived == {"attn": ["impl.sinks"]} and set(out.unreproducible) == {"sinks"}


def test_a_copy_held_in_a_third_party_object_is_named():
    """triton_kernels' holder in small: a dataclass of module ``triton_kernels.tensor`` (as OpenAI's kernels define
    ``Storage``) holding a swizzled copy of a weight, set by a post-processing step beside the live parameter. The
    census walks any holder (before issue 50's closing change only the engines' own classes, so vLLM's GPT-OSS
    Triton path kept its swizzled experts out of its sight)."""
    from dataclasses import dataclass

    @dataclass
    class Storage:
        data: torch.Tensor

    Storage.__module__ = "triton_kernels.tensor"
    layer = torch.nn.Module()
    layer.w13_weight = _bf16(2, 64, 32, seed=10)
    ckpt = checkpoint_of(layer)

    def post():
        layer.w13_swizzled = Storage(layer.w13_weight.data.transpose(1, 2).contiguous())

    process(layer, post, HOPPER)
    assert "w13_weight" in outcome(layer, ckpt).refused
