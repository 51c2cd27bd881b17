"""What the default check after every apply (``ENGINE_EXT_VERIFY_DERIVED=sample``) costs against the
refresh it checks, per update, at DeepSeek-V3 / Kimi-K2 shapes on vLLM's CPU path.

After an apply, the refresh re-derives what the kernels read for every layer written (at RL densities:
every MLA layer's packed W_UK/W_UV, every expert of every MoE layer), and the sampled check derives one
layer of each kind afresh (one expert of one MoE layer) and compares it bit for bit. Measured here, with
vLLM 0.32's own derivations (``AMXMLAImpl.process_weights_after_loading``, ``cpu_prepack_moe_weight``) on
stand-ins holding random bf16 weights of the real shapes:

* ``mla refresh``: one layer's re-derivation (``patches.rederive_mla``); ``mla check``: ``patches.mla_copy_stale``;
* ``expert refresh``: one expert's packing (``patches.packed_experts``); ``expert check``:
  ``patches.experts_copy_stale`` of one expert.

The per-update totals are extrapolated from those per-layer figures (61 MLA layers, 58 MoE layers of 256
experts, every one touched) and marked so.

    python bench/verify_derived.py              # V3 shapes; --experts-per-layer 32 for an EP 8 rank
Needs a CPU with AMX (the MLA path it measures).
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch


def timed(fn, rounds: int) -> float:
    xs = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--moe-inter", type=int, default=2048)
    ap.add_argument("--mla-layers", type=int, default=61)
    ap.add_argument("--moe-layers", type=int, default=58)
    ap.add_argument("--experts-per-layer", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if not torch.cpu._is_amx_tile_supported():
        raise SystemExit("this CPU has no AMX: vLLM serves MLA through CPUMLAImpl here (views, nothing to re-derive)")
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

    from engine_ext.engines.vllm import compat, patches

    torch.cpu._init_amx()
    g = torch.Generator().manual_seed(0)
    # MLA: kv_b_proj [heads * (nope 128 + v 128), latent 512]
    w = (torch.randn(a.heads * 256, 512, generator=g) * 0.02).to(torch.bfloat16)
    layer = SimpleNamespace(kv_b_proj=SimpleNamespace(weight=w, quant_method=None), num_heads=a.heads,
                            qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512, _engine_ext_mla=torch.bfloat16)
    impl = AMXMLAImpl.__new__(AMXMLAImpl)
    impl.__dict__.update(kv_b_proj=layer.kv_b_proj, num_heads=a.heads, qk_nope_head_dim=128, v_head_dim=128,
                         kv_lora_rank=512)
    impl.process_weights_after_loading(torch.bfloat16)
    layer.impl = impl
    mla_refresh = timed(lambda: patches.rederive_mla(layer), a.rounds)
    mla_check = timed(lambda: patches.mla_copy_stale(layer), a.rounds)
    assert patches.mla_copy_stale(layer) is False
    # MoE: one expert [2I, H] + [H, I] in a layer of 2 (the stand-in holds 2 experts; the kernel's copy of each)
    cls = compat.cpu_moe_experts_class()
    experts = cls.__new__(cls)
    experts.__dict__["isa"] = "amx"
    moe = torch.nn.Module()
    moe.w13_weight = torch.nn.Parameter((torch.randn(2, 2 * a.moe_inter, a.hidden, generator=g) * 0.02).to(torch.bfloat16),
                                        requires_grad=False)
    moe.w2_weight = torch.nn.Parameter((torch.randn(2, a.hidden, a.moe_inter, generator=g) * 0.02).to(torch.bfloat16),
                                       requires_grad=False)
    moe._engine_ext_moe = {"experts": experts, "padded": False, "packed": {}}
    moe._engine_ext_moe["packed"] = patches.packed_experts(moe, torch.arange(2))
    one = torch.tensor([1])
    expert_refresh = timed(lambda: patches.packed_experts(moe, one), a.rounds)
    expert_check = timed(lambda: patches.experts_copy_stale(moe, one), a.rounds)
    assert patches.experts_copy_stale(moe, one) is False
    print(f"{torch.get_num_threads()} threads, median of {a.rounds} rounds, measured per layer / per expert:")
    for name, s in (("mla refresh", mla_refresh), ("mla check", mla_check), ("expert refresh", expert_refresh),
                    ("expert check", expert_check)):
        print(f"  {name:15s} {s * 1e3:9.2f} ms")
    refresh = a.mla_layers * mla_refresh + a.moe_layers * a.experts_per_layer * expert_refresh
    sample = mla_check + expert_check
    print(f"per update at RL density (every layer and expert touched), extrapolated from the figures above:")
    print(f"  refresh of {a.mla_layers} MLA layers and {a.moe_layers} x {a.experts_per_layer} experts: {refresh:8.2f} s")
    print(f"  sampled check (one MLA layer, one expert):                 {sample * 1e3:8.2f} ms  = {sample / refresh:.2%} of the refresh")
    print(f"  check of every touched layer (ENGINE_EXT_VERIFY_DERIVED=all): about the refresh again ({refresh:.2f} s)")


if __name__ == "__main__":
    main()
