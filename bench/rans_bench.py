"""The static interleaved rANS stage (engine_ext/format/context/rans.py) against constriction's categorical coder, side by side.

    python bench/rans_bench.py                  # 2 M symbols of a skewed 49-symbol alphabet, ~30 s

Decode ns per symbol on one core for 1, 8 and 32 lanes, on two threads (two chunks, nogil), the
fixed cost of one decode call, and constriction's ANS stack coder with one ``Categorical`` model for
the same symbols (what format 5's 49-symbol streams used); bytes of each against the entropy. Best of ``--repeat``.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_ext.format.context import rans  # noqa: E402


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


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
    cum, symbol_of = rans.coding_tables(freq)
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
    small = sym[:16]
    w16, s16 = rans.encode(small, freq, 8)
    t = best(lambda: [rans.decode(w16, s16, 16, freq, symbol_of, cum) for _ in range(1000)], a.repeat)
    print(f"fixed cost per call (16 symbols, tables built): {t / 1000 * 1e6:.1f} us")
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
