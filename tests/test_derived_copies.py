"""The copies vLLM's CPU backend derives from the weights for its kernels, on vLLM's own ops in this
process (no server): the audit (``?audit=1``: ``derived``) finds each one stale once the weights it
came from are written, and the refresh an update runs makes it fresh again.

Each family is the one a patch keeps in step (engine_ext/engines/vllm/patches.py): packed MoE
experts (every host) and padded expert biases, packed causal-conv1d weights (AVX-512 BF16 hosts), MLA's W_UK/W_UV (AMX hosts: the impl's packed copies; elsewhere views of
``kv_b_proj``'s weight), sgl-packed linear weights (AMX hosts) and oneDNN handles (checked by what they
compute).
The servers' matrix (tests/test_models.py) audits the same copies after a rollback on a real server.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from engine_ext.engines.vllm import compat, patches  # noqa: E402
from engine_ext.engines.vllm.worker import cpu_derived_check  # noqa: E402

AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not AMX, reason="vLLM takes this path only on CPUs with AMX")


def test_each_patch_installs_once_and_keeps_vllms_own():
    """Installing a patch again (every vLLM process's plugin, then tests) leaves the one wrapper in place,
    and the wrapper reaches vLLM's own function as ``original``."""
    targets = [(patches.keep_cpu_moe_weights, compat.cpu_moe_experts_class(), "process_weights_after_loading"),
               (patches.keep_cpu_moe_weights, compat.cpu_moe_experts_class(), "apply"),
               (patches.keep_amx_mla_weights, compat.mla_attention_class(), "process_weights_after_loading"),
               (patches.drain_replies_after_a_failed_rpc, compat.multiproc_executor_class(), "collective_rpc"),
               (patches.keep_cpu_linear_weights, compat.cpu_gemm_module(), "dispatch_cpu_unquantized_gemm")]
    for install, target, name in targets:
        assert install()
        wrapper = getattr(target, name)
        assert install()
        assert getattr(target, name) is wrapper
        assert not hasattr(wrapper.original, "original")  # vLLM's own, not a wrapper of a wrapper


def _write_one(t: torch.Tensor) -> None:
    """One element moved by one step, in place (what an update does to the checkpoint-layout weight)."""
    with torch.no_grad():
        flat = t.view(-1)
        flat[7] = flat[7] * 1.5 + 0.01


class _Experts(torch.nn.Module):
    """An MoE layer as keep_cpu_moe_weights leaves it: checkpoint-layout experts, packed copies aside."""

    def __init__(self, n=4, inter=32, hidden=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w13_weight = torch.nn.Parameter((torch.randn(n, 2 * inter, hidden, generator=g) * 0.02).to(torch.bfloat16),
                                             requires_grad=False)
        self.w2_weight = torch.nn.Parameter((torch.randn(n, hidden, inter, generator=g) * 0.02).to(torch.bfloat16),
                                            requires_grad=False)
        experts = compat.cpu_moe_experts_class().__new__(compat.cpu_moe_experts_class())
        experts.__dict__["isa"] = compat.cpu_moe_experts_class().isa
        self._engine_ext_moe = {"experts": experts, "padded": False, "packed": {}}
        self._engine_ext_moe["packed"] = patches.packed_experts(self, torch.arange(n))


def test_packed_experts_found_stale_then_refreshed():
    layer = _Experts()
    assert patches.experts_copy_stale(layer) is False
    _write_one(layer.w2_weight.data[2])
    assert patches.experts_copy_stale(layer) is True
    assert patches.repack_experts(layer) == 4
    assert patches.experts_copy_stale(layer) is False


def test_padded_expert_bias_is_kept_in_checkpoint_layout_and_padded_again():
    """An MoE layer with expert biases whose width the engine pads (48 -> 64 per expert): vLLM pads the
    bias in place of the Parameter's data, which its kernel reads. Under the patch the layer holds a
    checkpoint-layout bias for the loader (and the maps), and a write into it is padded into the kernel's
    copy by the refresh, as a cold load pads it."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    cls = compat.cpu_moe_experts_class()
    assert patches.keep_cpu_moe_weights()
    experts = cls.__new__(cls)
    experts.__dict__.update(moe_config=SimpleNamespace(intermediate_size_per_partition=48, activation=MoEActivation.SILU),
                            _use_zentorch=False)
    g = torch.Generator().manual_seed(3)
    layer = torch.nn.Module()
    for name, shape in (("w13_weight", (2, 96, 64)), ("w2_weight", (2, 64, 48)), ("w13_bias", (2, 96))):
        p = torch.nn.Parameter((torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16), requires_grad=False)
        p.weight_loader = "the loader's attributes"
        layer.register_parameter(name, p)
    kernel_bias = layer.w13_bias  # what vLLM's quant config hands the kernel
    checkpoint = layer.w13_bias.data.clone()
    experts.process_weights_after_loading(layer)
    assert kernel_bias.shape == (2, 128) and layer.w13_bias is not kernel_bias
    assert torch.equal(layer.w13_bias.data, checkpoint) and layer.w13_bias.weight_loader == "the loader's attributes"
    assert patches.experts_copy_stale(layer) is False
    _write_one(layer.w13_bias.data[1])  # element 7 of expert 1: the gate half
    assert patches.experts_copy_stale(layer) is True
    assert kernel_bias.data[1, 7] != layer.w13_bias.data[1, 7]
    assert patches.repack_experts(layer) == 2 and patches.experts_copy_stale(layer) is False
    assert kernel_bias.data[1, 7] == layer.w13_bias.data[1, 7] and torch.equal(kernel_bias.data[1, 48:64], torch.zeros(16, dtype=torch.bfloat16))
    assert torch.equal(kernel_bias.data[:, 64:112], layer.w13_bias.data[:, 48:])


def _conv_op_packs() -> bool:
    from vllm import _custom_ops as ops

    return hasattr(ops, "causal_conv1d_weight_pack") and torch.cpu._is_avx512_bf16_supported()


@pytest.mark.skipif(not _conv_op_packs(), reason="vLLM packs causal-conv1d weights only on AVX-512 BF16 (or Arm BF16) hosts")
def test_packed_conv1d_weight_is_written_in_checkpoint_layout_and_packed_again():
    """Qwen3-Next's Gated DeltaNet ``conv1d`` ([dim, 1, 4] bf16): vLLM's dispatch packs it in place of the
    weight's data, which its kernel reads. Under the patch the weight's loader writes the checkpoint layout
    into the stash vLLM keeps (registered, so the probe maps into it); the refresh packs it again with
    vLLM's own op: the kernel's copy equals a cold load's."""
    from vllm import _custom_ops as ops

    assert patches.keep_cpu_linear_weights()
    g = torch.Generator().manual_seed(4)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(64, 1, 4, generator=g) * 0.1).to(torch.bfloat16), requires_grad=False)
    written = []

    def loader(param, w):
        written.append(param)
        param.data.copy_(w)

    layer.weight.weight_loader = loader
    compat.cpu_gemm_module().dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert patches.conv_layers(layer) == [layer] and patches.packed_layers(layer) == []
    assert patches.conv_copy_stale(layer) is False
    new = (torch.randn(64, 1, 4, generator=g) * 0.1).to(torch.bfloat16)
    layer.weight.weight_loader(layer.weight, new)  # what the model's load_weights calls
    assert written == [layer._engine_ext_conv] and torch.equal(layer._engine_ext_conv_weight, new)
    assert patches.conv_copy_stale(layer) is True
    patches.repack_conv(layer)
    assert patches.conv_copy_stale(layer) is False
    assert torch.equal(layer.weight.data, ops.causal_conv1d_weight_pack(new.view(64, 4).contiguous()))
    assert torch.equal(layer._cpu_unpacked_conv_weight, new.view(64, 4))  # vLLM's stash: the spec-decode path's weight


class _Mixer(torch.nn.Module):
    """vLLM's ``MambaMixer2`` in small: its ``conv1d`` ([dim, 1, 4] bf16, loaded by a weight loader) and the
    ``conv_weights`` buffer it registers at construction, a [dim, 4] view of that weight, which its CPU
    path reads (Granite 4, Nemotron-H, Falcon-H1, Bamba, Zamba2)."""

    def __init__(self, dim=64, seed=8):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter((torch.randn(dim, 1, 4, generator=g) * 0.1).to(torch.bfloat16),
                                                requires_grad=False)
        self.conv1d.weight.weight_loader = lambda param, w: param.data.copy_(w)
        self.register_buffer("conv_weights", self.conv1d.weight.view(dim, 4), persistent=False)

    def load(self, name: str, t: torch.Tensor) -> None:
        param = self.conv1d.weight
        param.weight_loader(param, t)


def _census_of_mixer(dispatch) -> tuple[_Mixer, dict]:
    from engine_ext.engines.vllm.census import claimed
    from engine_ext.server import census
    from engine_ext.server.layout import probe_layout

    mixer = _Mixer()
    census.take(mixer, lambda: dispatch(mixer.conv1d))
    maps = probe_layout(mixer, mixer.load, [("conv1d.weight", (64, 1, 4), "bfloat16")])
    return mixer, census.unreproducible(mixer, maps, claimed)


@pytest.mark.skipif(not _conv_op_packs(), reason="vLLM packs causal-conv1d weights only on AVX-512 BF16 (or Arm BF16) hosts")
def test_a_view_of_the_packed_conv_weight_follows_every_write():
    """Granite 4's silent divergence: vLLM packs the conv1d weight in place of its data, and the mixer keeps
    reading its ``conv_weights`` view of the storage the loader wrote at start-up. The patch keeps the loader
    writing that very storage (the census names nothing, and the view follows a write); with the fix
    reverted (the loader writing vLLM's stash, a clone), the census names the tensor and its reader."""
    assert patches.keep_cpu_linear_weights()
    dispatch = compat.cpu_gemm_module().dispatch_cpu_unquantized_gemm
    mixer, found = _census_of_mixer(lambda conv: dispatch(conv, remove_weight=True))
    assert found == {}
    new = (torch.randn(64, 1, 4, generator=torch.Generator().manual_seed(9)) * 0.1).to(torch.bfloat16)
    mixer.load("conv1d.weight", new)
    assert torch.equal(mixer.conv_weights, new.view(64, 4)) and patches.conv_copy_stale(mixer.conv1d) is True

    def reverted(conv):  # the patch before the fix: vLLM's dispatch, then the loader redirected into its stash
        dispatch.original(conv, remove_weight=False)
        patches.keep_conv_weight(conv, conv.__dict__["_cpu_unpacked_conv_weight"].unsqueeze(1))

    mixer, found = _census_of_mixer(reverted)
    assert list(found) == ["conv1d.weight"] and "conv_weights" in found["conv1d.weight"], found


@pytest.mark.skipif(not _conv_op_packs(), reason="vLLM packs causal-conv1d weights only on AVX-512 BF16 (or Arm BF16) hosts")
def test_a_merged_conv_weight_keeps_its_class_and_its_loader():
    """Falcon-H1's and Zamba2's mamba2 ``conv1d`` is a merged column layer: its weight is one of vLLM's parameter
    classes (``BasevLLMParameter``: the loader behind a property) and its loader takes a shard id (x, B and C
    written as three row ranges). The kept weight the patch makes is of the same class, and the loader that
    writes it is the layer's own, shard ids and all (issue 50's sweep found every update of these models
    failing: the patch looked the loader up in the parameter's ``__dict__``, found none, and fell back to
    ``default_weight_loader``, which takes no shard id)."""
    from vllm.model_executor.parameter import BasevLLMParameter

    assert patches.keep_cpu_linear_weights()
    dispatch = compat.cpu_gemm_module().dispatch_cpu_unquantized_gemm
    rows = (32, 16, 16)  # x, B, C
    layer = torch.nn.Module()
    data = (torch.randn(sum(rows), 1, 4, generator=torch.Generator().manual_seed(11)) * 0.1).to(torch.bfloat16)
    weight = BasevLLMParameter.__new__(BasevLLMParameter, data=data)

    def merged_loader(param, loaded, shard_id):
        start = sum(rows[:shard_id])
        param.data[start:start + rows[shard_id]].copy_(loaded)

    weight._weight_loader = merged_loader
    layer.weight = weight
    dispatch(layer, remove_weight=True)
    assert type(layer._engine_ext_conv) is BasevLLMParameter
    new = (torch.randn(16, 1, 4, generator=torch.Generator().manual_seed(12)) * 0.1).to(torch.bfloat16)
    layer.weight.weight_loader(layer.weight, new, 1)  # what MergedColumnParallelLinear.load_weights calls
    assert torch.equal(layer._engine_ext_conv.data[32:48], new) and torch.equal(layer._engine_ext_conv.data[:32], data[:32])
    assert patches.conv_copy_stale(layer) is True
    patches.repack_conv(layer)
    assert patches.conv_copy_stale(layer) is False


def test_experts_left_to_the_engine_are_refused():
    """GPT-OSS's old divergence: MoE experts whose packing is left to the engine (the keep-weights patch not
    applied) are packed in place of the parameters the loader writes, so an update would write the
    checkpoint's layout into the packed copies. Refused at start-up, before any update: the maps write
    storages post-processing computed, which the load check reads back as differing from the checkpoint
    (``mismatched``); where the loader cannot be mapped (the dense fallback), the census names them."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from engine_ext.server import census
    from engine_ext.server.layout import probe_layout

    cls = compat.cpu_moe_experts_class()
    process = getattr(cls.process_weights_after_loading, "original", cls.process_weights_after_loading)
    experts = cls.__new__(cls)
    experts.__dict__.update(moe_config=SimpleNamespace(intermediate_size_per_partition=32, activation=MoEActivation.SILU),
                            _use_zentorch=False, isa=cls.isa if isinstance(getattr(cls, "isa", None), str) else "vec")
    from engine_ext.format.dtypes import BY_TORCH
    from engine_ext.server.rank import RankUpdater

    layer = _Experts()
    del layer._engine_ext_moe
    loaded = {n: getattr(layer, n).data.clone() for n in ("w13_weight", "w2_weight")}
    census.take(layer, lambda: process(experts, layer))
    assert all(getattr(layer, n).data_ptr() != t.data_ptr() for n, t in loaded.items())  # packed in their place

    def load(name, t):
        getattr(layer, name).data.copy_(t.view(getattr(layer, name).shape))

    up = RankUpdater(layer, load, {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in loaded.items()},
                     read_checkpoint=loaded.__getitem__, find_unreproducible=lambda maps: census.unreproducible(layer, maps))
    reply = up.setup()
    assert sorted(set(reply.mismatched) | set(reply.unreproducible)) == ["w13_weight", "w2_weight"], reply

    def load_through_a_copy(name, t):  # a loader the probe cannot follow: the dense fallback reloads through it
        getattr(layer, name).data.copy_((t.float() * 1).to(t.dtype).view(getattr(layer, name).shape))

    specs = [(n, tuple(t.shape), "bfloat16") for n, t in loaded.items()]
    found = census.unreproducible(layer, probe_layout(layer, load_through_a_copy, specs))
    assert sorted(found) == ["w13_weight", "w2_weight"], found


class _KvBProj(torch.nn.Module):
    def __init__(self, heads, nope, v, latent):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.weight = torch.nn.Parameter((torch.randn(heads * (nope + v), latent, generator=g) * 0.02).to(torch.bfloat16),
                                         requires_grad=False)
        self.quant_method = None


class _Mla(torch.nn.Module):
    """An MLA attention layer's members the audit and the refresh read (vLLM's MLAAttention has them)."""

    def __init__(self, heads=2, nope=32, v=32, latent=64):
        super().__init__()
        self.kv_b_proj = _KvBProj(heads, nope, v, latent)
        self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank = heads, nope, v, latent


def test_mla_views_follow_the_weight_and_a_copy_is_found_stale():
    """Without AMX, vLLM's MLAAttention holds W_UK_T and W_UV as views of kv_b_proj's weight: they follow
    every in-place write. A copy (what a vLLM that copied would hold) is found stale after one."""
    layer = _Mla()
    layer.impl = object()
    w_uk, w_uv = compat.mla_split_kv_b_proj(layer)
    layer.W_UK_T, layer.W_UV = w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)
    assert patches.mla_attention_layers(layer) == [layer] and patches.mla_copy_stale(layer) is False
    _write_one(layer.kv_b_proj.weight.data)
    assert patches.mla_copy_stale(layer) is False  # views
    layer.W_UK_T = layer.W_UK_T.clone()
    _write_one(layer.kv_b_proj.weight.data)
    assert patches.mla_copy_stale(layer) is True


@needs_amx
def test_amx_mla_packed_copies_found_stale_then_rederived():
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

    torch.cpu._init_amx()
    layer = _Mla()
    impl = AMXMLAImpl.__new__(AMXMLAImpl)
    for name in ("kv_b_proj", "num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
        setattr(impl, name, getattr(layer, name))
    impl.process_weights_after_loading(torch.bfloat16)
    layer.impl, layer._engine_ext_mla = impl, torch.bfloat16
    assert patches.mla_layers(layer) == [layer] and patches.mla_copy_stale(layer) is False
    _write_one(layer.kv_b_proj.weight.data)
    assert patches.mla_copy_stale(layer) is True
    patches.rederive_mla(layer)
    assert patches.mla_copy_stale(layer) is False


def _linear(n=32, k=64) -> torch.nn.Module:
    g = torch.Generator().manual_seed(2)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16), requires_grad=False)
    assert patches.keep_cpu_linear_weights()
    compat.cpu_gemm_module().dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return layer


def test_linear_copy_on_this_host():
    """A small linear layer on whichever GEMM path this host takes: the sgl path (AMX hosts) serves a packed
    tensor, stale after a write and fresh after the re-pack; oneDNN (other AVX-512 hosts) serves an opaque
    handle, compared by what it computes, fresh after the re-pack (whether a write alone makes it stale is
    the next test's); the torch path (AVX2) reads the weight itself: nothing derived, None."""
    layer = _linear()
    assert layer.weight.numel() > 0  # kept by the patch
    path = patches.gemm_path(layer)
    if path == "torch":
        assert patches.linear_copy_stale(layer) is None
        return
    assert path in ("sgl", "onednn") and patches.linear_copy_stale(layer) is False
    _write_one(layer.weight.data)
    if path == "sgl":
        assert patches.linear_copy_stale(layer) is True
    patches.repack(layer)
    assert patches.linear_copy_stale(layer) is False


def test_a_onednn_handle_is_checked_by_what_it_computes():
    """Above 1 MiB vLLM's CPU GEMM serves through oneDNN (every x86 host with AVX-512 BF16), whose handle is opaque: the check
    runs the served GEMM and a fresh dispatch's on one probe input and compares the outputs bit for bit. A
    write the handle does not see is found stale; the re-pack makes it fresh."""
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN GEMM")
    layer = _linear(n=1024, k=1024)  # 2 MiB of bf16
    if patches.gemm_path(layer) == "torch" and not torch.cpu._is_avx512_bf16_supported():
        # an AVX2 host: oneDNN has no bf16 GEMM there, vLLM's dispatch catches its RuntimeError and serves
        # torch.nn.functional.linear, which reads the weight itself (test_linear_copy_on_this_host holds that)
        pytest.skip("no oneDNN bf16 GEMM on this host (no AVX-512 BF16): vLLM serves torch's linear")
    assert patches.gemm_path(layer) == "onednn"
    assert patches.linear_copy_stale(layer) is False
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    before = layer.cpu_linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        layer.weight.data[:, :64] *= 2  # a write every output reads
    sees_the_write = not torch.equal(before, layer.cpu_linear(x, layer.weight, layer.bias))
    assert patches.linear_copy_stale(layer) is (not sees_the_write)  # a handle that copied the weight is stale
    patches.repack(layer)
    assert patches.linear_copy_stale(layer) is False


def test_the_audit_names_the_stale_layers():
    model = torch.nn.Module()
    model.experts = _Experts()
    model.proj = _linear()
    derived = patches.gemm_path(model.proj) != "torch"  # AVX2 hosts: torch's linear reads the weight, nothing derived
    model.proj._engine_ext_packed = derived  # as the patched dispatch marks it
    check = cpu_derived_check(model)
    assert check() == {"checked": 1 + derived, "opaque": 0, "stale": []}
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    before = model.proj.cpu_linear(x, model.proj.weight, model.proj.bias)
    _write_one(model.experts.w13_weight.data[0])
    with torch.no_grad():
        model.proj.weight.data[:, :8] *= 2
    # the sgl path (AMX) serves a packed copy; oneDNN's handle (other hosts) may read the weight itself
    copied = torch.equal(before, model.proj.cpu_linear(x, model.proj.weight, model.proj.bias))
    assert check()["stale"] == (["experts", "proj"] if copied and derived else ["experts"])
    model.more = _Experts()
    for layer in (model.experts, model.more):
        for e in range(4):
            _write_one(layer.w2_weight.data[e])
    # after an apply, by default: one layer of each kind (one expert of it), a different one each time
    seen = [check(sample=True) for _ in range(2)]
    assert [s["checked"] + s["opaque"] for s in seen] == [1 + derived] * 2
    assert {n for s in seen for n in s["stale"] if n != "proj"} == {"experts", "more"}
    patches.repack_experts(model.experts)
    patches.repack_experts(model.more)
    patches.repack(model.proj)
    assert check()["stale"] == []


@pytest.mark.skipif(not AMX or __import__("os").environ.get("ENGINE_EXT_TEST_HIDE_AMX") == "1",
                    reason="this host's paths are the ones above (no AMX, or AMX hidden already)")
def test_the_paths_of_hosts_without_amx_here():
    """On an AMX host, this module again with AMX hidden from vLLM (tests/server_hooks), in a process of its
    own: the oneDNN GEMM, CPUMLAImpl's views and the MoE prepack's other ISA, as on an AVX-512 host without
    AMX, so every host's CI runs the derived copies of both kinds of host."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ENGINE_EXT_TEST_HIDE_AMX="1",
               PYTHONPATH=os.pathsep.join(p for p in [os.path.join(tests, "server_hooks"), os.environ.get("PYTHONPATH")] if p))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not hosts_without_amx"],
                       env=env, cwd=os.path.dirname(tests), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]
