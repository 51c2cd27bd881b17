"""What re-deriving an AMX MLA layer's packed W_UK/W_UV costs after an update, against reading the
layer's ``kv_b_proj`` densely (what the dense fallback did every version), per layer.

    python bench/mla_rederive.py                     # DeepSeek-V3 / Kimi-K2 shape: 128 heads, nope 128, v 128, latent 512
    python bench/mla_rederive.py --heads 16          # a TP 8 rank's heads

Runs vLLM 0.32's own ``AMXMLAImpl.process_weights_after_loading`` (what
``engine_ext.engines.vllm.patches.rederive_mla`` calls) on a stand-in holding a random bf16 ``kv_b_proj``
of that shape, side by side with ``safetensors.torch.load_file`` of the same tensor from a file in the
page cache copied into the layer's weight (the dense fallback: read, then the loader's copy) and
``save_file`` of it (the producer's cost of a dense version).
Needs a CPU with AMX (``convert_weight_packed`` packs for AMX tiles).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--nope", type=int, default=128)
    ap.add_argument("--v", type=int, default=128)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    if not torch.cpu._is_amx_tile_supported():
        raise SystemExit("this CPU has no AMX: vLLM serves MLA through CPUMLAImpl here (views, nothing to re-derive)")
    from safetensors.torch import load_file, save_file
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

    torch.cpu._init_amx()
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(a.heads * (a.nope + a.v), a.latent, generator=g) * 0.02).to(torch.bfloat16)
    proj = SimpleNamespace(weight=weight, quant_method=None)
    impl = SimpleNamespace(kv_b_proj=proj, kv_lora_rank=a.latent, num_heads=a.heads, qk_nope_head_dim=a.nope,
                           v_head_dim=a.v)
    path = os.path.join(tempfile.mkdtemp(), "kv_b_proj.safetensors")
    rows = {"rederive": [], "save_file": [], "load+copy": []}
    dest = torch.empty_like(weight)
    for _ in range(a.rounds):
        t = time.perf_counter()
        AMXMLAImpl.process_weights_after_loading(impl, torch.bfloat16)
        rows["rederive"].append(time.perf_counter() - t)
        t = time.perf_counter()
        save_file({"w": weight}, path)
        rows["save_file"].append(time.perf_counter() - t)
        t = time.perf_counter()
        dest.copy_(load_file(path)["w"])
        rows["load+copy"].append(time.perf_counter() - t)
    mib = weight.numel() * 2 / 2**20
    print(f"kv_b_proj [{weight.shape[0]}, {weight.shape[1]}] bf16, {mib:.1f} MiB, {torch.get_num_threads()} threads, "
          f"{a.rounds} rounds (median, min-max):")
    for name, xs in rows.items():
        print(f"  {name:10s} {statistics.median(xs) * 1e3:8.2f} ms  ({min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f})  "
              f"{mib / 1024 / statistics.median(xs):.2f} GiB/s")
    ratios = [r / d for r, d in zip(rows["rederive"], rows["load+copy"])]
    print(f"  rederive / (load+copy) per round: median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
