"""The static interleaved rANS stage (engine_ext/format/rans.py) against constriction's categorical coder, side by side.

    python bench/rans_bench.py                  # 2 M symbols of a skewed 49-symbol alphabet, ~30 s

Decode ns per symbol on one core for 1, 8 and 32 lanes, on two threads (two chunks, nogil), the
bypass section's unpack per value, the fixed cost of one decode call, positions decoded in one fused
pass (gap classes + low bits) against v1's pcodec per change, and
constriction's ANS stack coder with one ``Categorical`` model for the same symbols (what codec v2's
49-symbol streams use today); bytes of each against the entropy. Best of ``--repeat``.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_ext.format import rans  # noqa: E402


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def positions_rows(repeat: int, numel: int = 1 << 24, density: float = 0.03) -> None:
    """Positions (uniform at ``density``: what an RL step's changes look like to a coder without context):
    rANS gap classes + bypass low bits, decoded in one fused pass, against v1's pcodec gaps, ns per change."""
    from engine_ext.format import codec

    rng = np.random.default_rng(1)
    pos = np.flatnonzero(rng.random(numel) < density)
    n = pos.size
    data = rans.encode_positions(pos)
    rans.decode_positions(data, n)
    t = best(lambda: rans.decode_positions(data, n), repeat)
    coder, ref = codec.encode_positions(pos, numel)
    codec.decode_positions(coder, ref, n, numel)
    tp = best(lambda: codec.decode_positions(coder, ref, n, numel), repeat)
    half = [pos[: n // 2], pos[n // 2:]]
    parts = [rans.encode_positions(h) for h in half]
    with ThreadPoolExecutor(2) as pool:
        def both():
            list(pool.map(lambda k: rans.decode_positions(parts[k], half[k].size), range(2)))
        both()
        t2 = best(both, repeat)
    print(f"\npositions: {n} changes in {numel} elements ({density:.0%})")
    print(f"{'coder':>34} {'decode ns/change':>16} {'bytes/change':>13}")
    print(f"{'rans classes + bypass, 1 thread':>34} {t / n * 1e9:>16.2f} {len(data) / n:>13.3f}")
    print(f"{'rans classes + bypass, 2 threads':>34} {t2 / n * 1e9:>16.2f}")
    print(f"{f'v1 ({coder}), 1 thread':>34} {tp / n * 1e9:>16.2f} {len(ref) / n:>13.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2_000_000)
    ap.add_argument("--k", type=int, default=49)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(a.k, 0.3))
    sym = rng.choice(a.k, a.n, p=p)
    counts = np.bincount(sym, minlength=a.k)
    q = counts[counts > 0] / counts.sum()
    entropy = -(counts[counts > 0] * np.log2(q)).sum() / 8
    freq = rans.normalize(counts)
    cum, symbol_of = rans.tables(freq)
    print(f"{a.n} symbols, {a.k}-symbol alphabet, entropy {entropy / a.n * 8:.3f} bits/symbol")
    print(f"{'coder':>34} {'decode ns/sym':>14} {'bytes/entropy':>14}")
    for lanes in (1, 8, 32):
        words, states = rans.encode(sym, freq, lanes)
        rans.decode(words, states, a.n, freq, symbol_of, cum)  # compile
        t = best(lambda: rans.decode(words, states, a.n, freq, symbol_of, cum), a.repeat)
        print(f"{f'rans {lanes} lanes, 1 thread':>34} {t / a.n * 1e9:>14.2f} {(words.nbytes + states.nbytes) / entropy:>14.4f}")
    halves = [sym[: a.n // 2], sym[a.n // 2:]]
    enc = [rans.encode(h, freq, 32) for h in halves]
    with ThreadPoolExecutor(2) as pool:
        def both():
            list(pool.map(lambda e: rans.decode(e[1][0], e[1][1], halves[e[0]].size, freq, symbol_of, cum),
                          enumerate(enc)))
        both()
        t2 = best(both, a.repeat)
    print(f"{'rans 32 lanes, 2 threads (2 chunks)':>34} {t2 / a.n * 1e9:>14.2f}")
    widths = rng.integers(4, 13, a.n).astype(np.uint8)  # a gap's low bits: a few to a dozen
    values = (rng.integers(0, 1 << 12, a.n) & ((1 << widths.astype(np.int64)) - 1)).astype(np.uint32)
    data = rans.pack_bits(values, widths)
    rans.unpack_bits(data, widths)
    t = best(lambda: rans.unpack_bits(data, widths), a.repeat)
    print(f"{'bypass bits, unpack (4-12 bits each)':>34} {t / a.n * 1e9:>14.2f}")
    small = sym[:16]
    w16, s16 = rans.encode(small, freq, 8)
    t = best(lambda: [rans.decode(w16, s16, 16, freq, symbol_of, cum) for _ in range(1000)], a.repeat)
    print(f"fixed cost per call (16 symbols, tables built): {t / 1000 * 1e6:.1f} us")
    positions_rows(a.repeat)
    try:
        import constriction
    except ImportError:
        print("constriction not installed: no reference row")
        return
    model = constriction.stream.model.Categorical(counts / counts.sum(), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(sym.astype(np.int32), model)
    compressed = coder.get_compressed()

    def dec():
        constriction.stream.stack.AnsCoder(compressed).decode(model, a.n)

    t = best(dec, a.repeat)
    print(f"{'constriction ANS, Categorical':>34} {t / a.n * 1e9:>14.2f} {compressed.nbytes / entropy:>14.4f}")


if __name__ == "__main__":
    main()
