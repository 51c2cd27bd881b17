"""The publisher's diff on the CPU (engine_ext.format.diff_kernels), beside the memory primitives it competes with.

    python bench/diff_bench.py                    # 1.12 G bf16 elements (scale_bench's model), 1 % changed
    python bench/diff_bench.py --density 0.001 0.01 0.1 --elements 300000000

Per density: the diff with the kept copy updated (what ``DeltaPublisher`` runs on every
version, on every core), a read of both versions (torch's sum of their 64-bit words, every
core: the bytes the diff must read) and a copy of one version into touched memory (torch's
``copy_``, every core: what ``save_file`` does besides its page faults), medians of
``--repeat``, in seconds, and the diff's GB/s of the two versions read. Each diff's result is checked against the changes planted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_ext.format import diff_kernels  # noqa: E402


def timed(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=1_120_000_000)
    ap.add_argument("--density", type=float, nargs="+", default=[0.01])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    base = rng.integers(-3000, 3000, args.elements // 4 * 4, dtype=np.int16)  # bf16 bits (whole 64-bit words)
    gb = 2 * base.nbytes / 1e9
    kept, scratch = base.copy(), np.empty_like(base)
    print(f"{args.elements} bf16 elements ({base.nbytes / 1e9:.2f} GB a version), {diff_kernels._THREADS} threads\n")
    print("| changed | diff + kept update s | GB/s | read both s | copy one s |\n|---|---:|---:|---:|---:|")
    for density in args.density:
        new = base.copy()
        hit = np.flatnonzero(rng.random(args.elements) < density)
        new[hit] += 1

        def diff():
            np.copyto(kept, base)
            t = time.perf_counter()
            pos, _, got = diff_kernels.changed(kept, new, update=True)
            diff.s.append(time.perf_counter() - t)
            assert np.array_equal(pos, hit) and np.array_equal(got, new[hit]) and np.array_equal(kept, new)
        diff.s = []
        for _ in range(args.repeat):
            diff()
        d = statistics.median(diff.s)
        words = [torch.from_numpy(v.view(np.int64)) for v in (base, new)]
        read = timed(lambda: [w.sum() for w in words], args.repeat)
        copy = timed(lambda: torch.from_numpy(scratch).copy_(torch.from_numpy(base)), args.repeat)
        print(f"| {100 * density:g} % | {d:.3f} | {gb / d:.1f} | {read:.3f} | {copy:.3f} |")
    print("\ncommand: python bench/diff_bench.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
