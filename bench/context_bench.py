"""Codec v2 (context-conditioned) against codec v1, the first-order bound and Fireworks arc_v3,
side by side on real training (bench/train_data.py).

    python bench/context_bench.py [--lr 1e-6 3e-6] [--pairs 4]

Per lr, over consecutive bf16 version pairs: bytes per changed element of v1
(``engine_ext.format.codec`` without a base), of v2 (the publisher's choice per tensor: the context
coder where it saves >= 10 %, headers included), of arc_v3 (``fireworks-delta-compression``,
only where installed: ``bench/fireworks_codec.py`` says how; blob + checksum), and the
first-order entropy bound (gaps + steps; the smaller of pooled over the model and per tensor).
Encode and decode throughput on one thread, in MB of bf16 model per second; v2 decode is
timed with the numba context pass and with the numpy one.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.codec_bench import entropy_bits  # noqa: E402
from bench.train_data import versions  # noqa: E402
from engine_ext.format import codec, context_codec  # noqa: E402
from engine_ext.format.dtypes import BY_NAME, as_bits, step_between  # noqa: E402

BF16 = BY_NAME["bfloat16"]


def pair_changes(a: dict, b: dict):
    out = []
    for name in a:
        ob, nb = as_bits(a[name]).reshape(-1), as_bits(b[name]).reshape(-1)
        pos = torch.nonzero(ob != nb).reshape(-1)
        if pos.numel():
            out.append((name, tuple(a[name].shape), ob, pos, ob[pos], nb[pos]))
    return out


def encode_all(ch, context: bool):
    return [codec.encode(BF16, ob.numel(), pos, nb, o, base=ob if context else None, shape=shape)
            for _, shape, ob, pos, o, nb in ch]


def decode_all(ch, encs, backend="auto"):
    for (_, shape, ob, pos, _, _), e in zip(ch, encs):
        if e.pos_coder == "ctx":  # what a rank runs, the base read from memory
            base = ob.numpy()
            context_codec.decode("bfloat16", shape, e.pos, e.val, pos.numel(),
                                 lambda box: context_codec.box_of(base, shape, box), backend)
        else:
            codec.decode_positions(e.pos_coder, e.pos, pos.numel(), ob.numel())
            codec.decode_values(e.val_coder, e.val, pos.numel(), BF16)


def best(fn, repeat=3):
    t = float("inf")
    for _ in range(repeat):
        s = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - s)
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6])
    ap.add_argument("--pairs", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import fireworks_codec as fw
        have_fw = fw.available()
    except Exception:  # noqa: BLE001 - the benchmark says so
        have_fw = False
    print("command: python bench/context_bench.py " + " ".join(sys.argv[1:]))
    print("| lr | density | bound B | v1 B | v2 B | v2 / bound | v1 / v2 | arc_v3 B | arc_v3 / v2 | enc v1 MB/s | enc v2 MB/s "
          "| dec v1 MB/s | dec v2 numba MB/s | dec v2 numpy MB/s | dec v2 / v1 time |")
    print("|" + "---|" * 15)
    for lr in a.lr:
        vs = versions(lr, 8, log=lambda *x: None)
        tot = np.zeros(8)
        for old, new in list(itertools.pairwise(vs))[:a.pairs]:
            ch = pair_changes(old, new)
            nnz = sum(c[3].numel() for c in ch)
            numel = sum(t.numel() for t in old.values())
            mb = 2 * numel / 1e6
            gaps = [np.diff(c[3].numpy(), prepend=-1) - 1 for c in ch]
            steps = [step_between(c[4], c[5], True).numpy() for c in ch]
            pooled = (entropy_bits(np.concatenate(gaps)) + entropy_bits(np.concatenate(steps))) / 8
            per_tensor = sum(entropy_bits(g) + entropy_bits(s) for g, s in zip(gaps, steps)) / 8
            t_e1 = best(lambda: encode_all(ch, False), 1)
            v1 = encode_all(ch, False)
            t_e2 = best(lambda: encode_all(ch, True), 1)
            v2 = encode_all(ch, True)
            t_d1 = best(lambda: decode_all(ch, v1))
            t_d2 = best(lambda: decode_all(ch, v2, "auto"))
            t_d2n = best(lambda: decode_all(ch, v2, "numpy"), 1)
            b1 = sum(len(e.pos) + len(e.val) for e in v1)
            b2 = sum(len(e.pos) + len(e.val) for e in v2)
            arc = sum(fw.arc_v3_bytes(old[n], new[n]) for n, *_ in ch) if have_fw else float("nan")
            tot += [nnz, numel, min(pooled, per_tensor), b1, b2, arc, 0, 0]
            print(f"| {lr:g} | {100 * nnz / numel:.2f} % | {min(pooled, per_tensor) / nnz:.3f} | {b1 / nnz:.3f} | {b2 / nnz:.3f} "
                  f"| {b2 / min(pooled, per_tensor):.3f} | {b1 / b2:.2f} | {arc / nnz:.3f} | {arc / b2:.2f} "
                  f"| {mb / t_e1:.0f} | {mb / t_e2:.0f} | {mb / t_d1:.0f} | {mb / t_d2:.0f} | {mb / t_d2n:.0f} | {t_d2 / t_d1:.1f} |")
        n, _, bound, b1, b2, arc, _, _ = tot
        print(f"lr {lr:g} all pairs: v2/bound {b2 / bound:.3f}, v1/bound {b1 / bound:.3f}, v1/v2 {b1 / b2:.2f}, "
              f"arc_v3/v2 {arc / b2:.2f}, arc_v3/v1 {arc / b1:.2f}")


if __name__ == "__main__":
    main()
