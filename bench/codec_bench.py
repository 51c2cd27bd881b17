"""Payload and codec speed on synthetic RL steps, side by side in one run.

    python bench/codec_bench.py [--steps 6] [--lr 3e-6] [--layers 4]

Per step (bf16 weights after each Adam step on fp32 masters, see tests/support/synthetic.py):
density; bytes of our encoding (engine_ext.format.codec, per tensor the smaller value mode);
a PULSE-style encoding (per-tensor gaps downcast to the narrowest unsigned type +
absolute bf16 values, each zstd level 1); a TRL-style one (int32 indices + bf16
values, uncompressed); the first-order entropy bound of the change set (gaps +
ordered-space steps, pooled over the model, and per tensor); encode/decode throughput
in GB of (bf16) model per second, single thread, best of --repeat.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.synthetic (tests/support)
from support.synthetic import AdamRL, llm_shapes  # noqa: E402
from engine_ext.format import codec  # noqa: E402
from engine_ext.format.dtypes import BY_NAME, as_bits, step_between  # noqa: E402
from engine_ext.report import entropy_bits  # noqa: E402  (the report's first-order bound: one definition)

BF16 = BY_NAME["bfloat16"]


def changes(old: dict, new: dict):
    out = []
    for name, n in new.items():
        ob, nb = as_bits(old[name]).reshape(-1), as_bits(n).reshape(-1)
        pos = torch.nonzero(ob != nb).reshape(-1)
        out.append((name, n.numel(), pos, ob[pos], nb[pos]))
    return out


def ours_encode(ch):
    return [codec.encode(BF16, numel, pos, nb, ob) if pos.numel() else None for _, numel, pos, ob, nb in ch]


def ours_decode(ch, encs):
    for (_, numel, pos, _, _), e in zip(ch, encs):
        if e is not None:
            codec.decode_positions(e.pos_coder, e.pos, pos.numel(), numel)
            codec.decode_values(e.val_coder, e.val, pos.numel(), BF16)


def pulse_encode(ch):
    z = zstandard.ZstdCompressor(level=1)
    out = []
    for _, numel, pos, ob, nb in ch:
        if pos.numel() == 0:
            out.append(None)
            continue
        gaps = np.diff(pos.numpy(), prepend=0)
        m = int(gaps.max())
        gdt = np.uint8 if m < 256 else np.uint16 if m < 65536 else np.uint32
        out.append((gdt, z.compress(gaps.astype(gdt).tobytes()), z.compress(nb.numpy().tobytes())))
    return out


def pulse_decode(ch, encs):
    d = zstandard.ZstdDecompressor()
    for e in encs:
        if e is not None:
            np.cumsum(np.frombuffer(d.decompress(e[1]), e[0]).astype(np.int64))
            np.frombuffer(d.decompress(e[2]), np.int16)


def best_time(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        r = fn()
        best = min(best, time.perf_counter() - t)
    return best, r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="Adam steps before measuring (bias-corrected early steps are atypical)")
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tr = AdamRL(llm_shapes(layers=a.layers), lr=a.lr)
    prev = tr.weights()
    for _ in range(a.warmup):
        prev = tr.step()
    model_bytes = sum(t.numel() * 2 for t in prev.values())
    print(f"model: {sum(t.numel() for t in prev.values()):,} bf16 params ({model_bytes / 1e6:.1f} MB), lr {a.lr}, "
          f"steps after {a.warmup} warm-up steps; bytes are per changed element")
    print("| step | density | ours B | PULSE-style B | TRL-style B | bound pooled | bound per-tensor | ours / bound | PULSE / ours | "
          "enc ours GB/s | enc PULSE GB/s | dec ours GB/s | dec PULSE GB/s |")
    print("|" + "---|" * 13)
    totals = np.zeros(5)
    for step in range(1, a.steps + 1):
        new = tr.step()
        ch = changes(prev, new)
        nnz = sum(c[2].numel() for c in ch)
        numel = sum(c[1] for c in ch)
        t_oe, encs = best_time(lambda: ours_encode(ch), a.repeat)
        t_pe, pulse = best_time(lambda: pulse_encode(ch), a.repeat)
        t_od, _ = best_time(lambda: ours_decode(ch, encs), a.repeat)
        t_pd, _ = best_time(lambda: pulse_decode(ch, pulse), a.repeat)
        ours = sum(len(e.pos) + len(e.val) for e in encs if e)
        pulse_b = sum(len(e[1]) + len(e[2]) for e in pulse if e)
        trl = nnz * (4 + 2)
        gaps = [np.diff(c[2].numpy(), prepend=-1) - 1 for c in ch if c[2].numel()]
        steps = [step_between(c[3], c[4], True).numpy() for c in ch if c[2].numel()]
        pooled = (entropy_bits(np.concatenate(gaps)) + entropy_bits(np.concatenate(steps))) / 8
        per_tensor = sum(entropy_bits(g) + entropy_bits(s) for g, s in zip(gaps, steps)) / 8
        bound = min(pooled, per_tensor)
        totals += [ours, pulse_b, trl, bound, nnz]
        gb = model_bytes / 1e9
        print(f"| {step} | {100 * nnz / numel:.2f} % | {ours / nnz:.3f} | {pulse_b / nnz:.3f} | {trl / nnz:.3f} | "
              f"{pooled / nnz:.3f} | {per_tensor / nnz:.3f} | {ours / bound:.3f} | {pulse_b / ours:.2f} | "
              f"{gb / t_oe:.2f} | {gb / t_pe:.2f} | {gb / t_od:.2f} | {gb / t_pd:.2f} |")
        prev = new
    o, p, t, b, n = totals
    print(f"\nall steps: ours {o / n:.3f} B/changed element, PULSE-style {p / n:.3f}, TRL-style {t / n:.3f}, "
          f"bound {b / n:.3f}; ours/bound {o / b:.3f}; PULSE-style/ours {p / o:.2f}; dense bf16 / ours {model_bytes * a.steps / o:.0f}x")


if __name__ == "__main__":
    main()
