"""A static, table-driven, interleaved rANS coder: the stage under codec v2 since format 9 (:mod:`.rans_stage`).

Specification (what another implementation must do to decode these bytes):

* **Frequencies.** An alphabet's symbols ``0..K-1`` carry integer frequencies ``f[s] >= 0`` summing to
  ``M = 2**PROB_BITS`` (``PROB_BITS = 12``), ``cum[s] = f[0] + ... + f[s-1]``. Writers derive them from
  counts with :func:`normalize`, integer arithmetic only, so every host builds the same tables:
  each symbol with a count gets ``max(1, floor(count * M / total))``; the remainder (positive or
  negative) is then spread one unit at a time over the symbols in order of decreasing fractional
  part ``(count * M) mod total`` (ties: lower symbol first), never taking a frequency below 1.
* **State.** 32-bit unsigned, kept in ``[L, 2**32)`` with ``L = 2**16``; renormalisation moves 16-bit
  words. Encoding symbol ``s`` in state ``x``: while ``x >= ((L >> PROB_BITS) << 16) * f[s]`` emit
  ``x & 0xFFFF`` and ``x >>= 16``; then ``x = (x // f[s]) * M + x % f[s] + cum[s]``.
  Decoding: ``slot = x % M``, ``s = symbol_of[slot]`` (a direct lookup table of ``M`` entries: no
  division, no search), ``x = f[s] * (x >> PROB_BITS) + slot - cum[s]``, then while ``x < L``:
  ``x = (x << 16) | next_word``.
* **Lanes.** ``n`` symbols go round-robin to ``lanes`` independent states: symbol ``i`` to lane
  ``i % lanes``. Every lane starts (encoder side) at state ``L``. The encoder codes ``i = n-1 .. 0``
  and appends each emitted word to one stream, which is then reversed; the decoder reads it
  forward while it decodes ``i = 0 .. n-1``, so the lanes' words interleave in one stream and
  splitting into lanes costs only each lane's final state. The final states (the decoder's initial
  ones) are stored beside the stream, one ``uint32`` per lane.
* **Checks a reader makes.** Every lane must end at state ``L`` (the encoder's initial state) and
  every word of the stream must be read: anything else is corrupt data, refused.

Encoding runs once per version on the publisher; decoding is the hot path on every reader: one
lookup, one multiply-add and at most one 16-bit read per symbol, ``nogil`` so chunks decode on
every core (``bench/rans_bench.py`` measures it against constriction's categorical coder).
"""

from __future__ import annotations

import numba
import numpy as np

from ...errors import IntegrityError

PROB_BITS = 12
M = 1 << PROB_BITS
RANS_L = 1 << 16
MAX_LANES = 64


def normalize(counts, prob_bits: int = PROB_BITS) -> np.ndarray:
    """Integer frequencies summing to ``2**prob_bits`` from symbol counts (the rule in the module docstring)."""
    counts = np.asarray(counts, dtype=np.int64)
    m = 1 << prob_bits
    present = np.flatnonzero(counts > 0)
    if counts.ndim != 1 or (counts < 0).any() or present.size == 0:
        raise ValueError("counts: a 1-D array of non-negative integers, at least one positive")
    if present.size > m:
        raise ValueError(f"{present.size} symbols do not fit {m} slots")
    total = int(counts.sum())
    scaled = counts * m  # int64: counts below 2**51 / m
    freq = np.where(counts > 0, np.maximum(1, scaled // total), 0)
    frac = scaled % total
    order = sorted(present.tolist(), key=lambda s: (-int(frac[s]), s))
    short = m - int(freq.sum())
    i = 0
    while short > 0:  # give units to the largest fractional parts
        freq[order[i % len(order)]] += 1
        short, i = short - 1, i + 1
    i = len(order) - 1
    while short < 0:  # take units from the smallest fractional parts, never below 1
        s = order[i % len(order)]
        if freq[s] > 1:
            freq[s] -= 1
            short += 1
        i -= 1
    return freq.astype(np.uint32)


def coding_tables(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cum, symbol_of): the cumulative frequencies and the ``M``-slot decode table of a normalized alphabet."""
    freq = np.asarray(freq, dtype=np.uint32)
    if int(freq.sum()) != M:
        raise ValueError(f"frequencies sum to {int(freq.sum())}, not {M}")
    cum = np.zeros(freq.size + 1, np.uint32)
    cum[1:] = np.cumsum(freq)
    return cum, np.repeat(np.arange(freq.size, dtype=np.uint16), freq)


@numba.njit(nogil=True, cache=True)
def _encode(symbols, freq, cum, lanes):  # pragma: no cover - compiled
    n = symbols.shape[0]
    states = np.full(lanes, RANS_L, np.uint64)
    out = np.empty(2 * n + 2, np.uint16)  # at most two words per symbol
    w = 0
    bad = -1
    for i in range(n - 1, -1, -1):
        s = symbols[i]
        f = np.uint64(freq[s])
        if f == 0:
            bad = i
            break
        lane = i % lanes
        x = states[lane]
        x_max = np.uint64((RANS_L >> PROB_BITS) << 16) * f
        while x >= x_max:
            out[w] = np.uint16(x & np.uint64(0xFFFF))
            w += 1
            x >>= np.uint64(16)
        states[lane] = (x // f) * np.uint64(M) + x % f + np.uint64(cum[s])
    return out[:w][::-1].copy(), states.astype(np.uint32), bad


@numba.njit(nogil=True, cache=True)
def _decode(words, states, n, freq, cum, symbol_of, out):  # pragma: no cover - compiled
    lanes = states.shape[0]
    x = states.astype(np.uint32)
    r = 0
    nw = words.shape[0]
    mask = np.uint32(M - 1)
    i = 0
    while i < n:  # a round of the lanes at a time: symbol i is lane i % lanes without a division
        for lane in range(min(lanes, n - i)):
            v = x[lane]
            slot = v & mask
            s = symbol_of[slot]
            out[i + lane] = s
            v = freq[s] * (v >> np.uint32(PROB_BITS)) + slot - cum[s]  # < 2**32: f * (x >> 12) + slot < 2**32
            if v < np.uint32(RANS_L):  # one 16-bit word brings it back: v >= 1 after a decode step
                if r >= nw:
                    return -1  # the stream ended early
                v = (v << np.uint32(16)) | np.uint32(words[r])
                r += 1
            x[lane] = v
        i += lanes
    if r != nw:
        return -2  # words left over
    for lane in range(lanes):
        if x[lane] != np.uint32(RANS_L):
            return -3  # a lane did not end where the encoder began
    return 0


def encode(symbols: np.ndarray, freq: np.ndarray, lanes: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """``symbols`` (integers below ``freq.size``) as (the interleaved uint16 stream, the lanes' uint32 states)."""
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be 1..{MAX_LANES}, got {lanes}")
    freq = np.asarray(freq, np.uint32)
    cum, _ = coding_tables(freq)
    symbols = np.ascontiguousarray(symbols, dtype=np.int64)
    if symbols.size and (symbols.min() < 0 or symbols.max() >= freq.size):
        raise ValueError("a symbol outside the alphabet")
    words, states, bad = _encode(symbols, freq, cum, lanes)
    if bad >= 0:
        raise ValueError(f"symbol {int(symbols[bad])} at {bad} has frequency 0")
    return words, states


def decode(
    words: np.ndarray,
    states: np.ndarray,
    n: int,
    freq: np.ndarray,
    symbol_of: np.ndarray | None = None,
    cum: np.ndarray | None = None,
) -> np.ndarray:
    """The ``n`` symbols of a stream; :class:`IntegrityError` where the stream is short, long, or a lane does
    not end at the encoder's initial state. ``symbol_of``/``cum``: tables built once per alphabet (else here)."""
    freq = np.asarray(freq, np.uint32)
    if cum is None or symbol_of is None:
        cum, symbol_of = coding_tables(freq)
    states = np.ascontiguousarray(states, dtype=np.uint32)
    if not 1 <= states.size <= MAX_LANES or (n > 0 and (states < RANS_L).any()):
        raise IntegrityError(f"rANS: {states.size} lane states, or a state below {RANS_L}")
    out = np.empty(n, np.uint16)
    code = _decode(np.ascontiguousarray(words, dtype=np.uint16), states, n, freq, cum, symbol_of, out)
    if code:
        raise IntegrityError(
            {
                -1: "rANS: the stream ends before its symbols do",
                -2: "rANS: words left over after the last symbol",
                -3: "rANS: a lane does not end at the encoder's initial state",
            }[code]
        )
    return out


__all__ = ["PROB_BITS", "RANS_L", "M", "coding_tables", "decode", "encode", "normalize"]
