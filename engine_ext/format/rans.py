"""A static, table-driven, interleaved rANS coder: the stage under codec v2 since format 9 (``context_rans``).

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

from ..errors import IntegrityError

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


def tables(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    cum, _ = tables(freq)
    symbols = np.ascontiguousarray(symbols, dtype=np.int64)
    if symbols.size and (symbols.min() < 0 or symbols.max() >= freq.size):
        raise ValueError("a symbol outside the alphabet")
    words, states, bad = _encode(symbols, freq, cum, lanes)
    if bad >= 0:
        raise ValueError(f"symbol {int(symbols[bad])} at {bad} has frequency 0")
    return words, states


def decode(words: np.ndarray, states: np.ndarray, n: int, freq: np.ndarray,
           symbol_of: np.ndarray | None = None, cum: np.ndarray | None = None) -> np.ndarray:
    """The ``n`` symbols of a stream; :class:`IntegrityError` where the stream is short, long, or a lane does
    not end at the encoder's initial state. ``symbol_of``/``cum``: tables built once per alphabet (else here)."""
    freq = np.asarray(freq, np.uint32)
    if cum is None or symbol_of is None:
        cum, symbol_of = tables(freq)
    states = np.ascontiguousarray(states, dtype=np.uint32)
    if not 1 <= states.size <= MAX_LANES or (n > 0 and (states < RANS_L).any()):
        raise IntegrityError(f"rANS: {states.size} lane states, or a state below {RANS_L}")
    out = np.empty(n, np.uint16)
    code = _decode(np.ascontiguousarray(words, dtype=np.uint16), states, n, freq, cum, symbol_of, out)
    if code:
        raise IntegrityError({-1: "rANS: the stream ends before its symbols do",
                              -2: "rANS: words left over after the last symbol",
                              -3: "rANS: a lane does not end at the encoder's initial state"}[code])
    return out


# -- the bypass section: raw low bits beside the coded symbols ------------------------------------------
# Bits no model predicts (a gap's low bits, escapes, a step's low bits) skip the coder: value k takes
# widths[k] bits (0..32), packed little-endian, least significant bit first, one after another; the last
# byte is padded with zero bits. Readers know the widths (from the decoded symbols) and check the section's
# length (ceil(sum(widths) / 8) bytes) and that the padding is zero.


@numba.njit(nogil=True, cache=True)
def _pack(values, widths, out):  # pragma: no cover - compiled
    acc = np.uint64(0)
    have = 0
    o = 0
    for k in range(values.shape[0]):
        w = widths[k]
        if w == 0:
            continue
        acc |= (np.uint64(values[k]) & ((np.uint64(1) << np.uint64(w)) - np.uint64(1))) << np.uint64(have)
        have += w
        while have >= 8:
            out[o] = np.uint8(acc & np.uint64(0xFF))
            o += 1
            acc >>= np.uint64(8)
            have -= 8
    if have:
        out[o] = np.uint8(acc)
        o += 1
    return o


@numba.njit(nogil=True, cache=True)
def _unpack(data, widths, out):  # pragma: no cover - compiled
    acc = np.uint64(0)
    have = 0
    r = 0
    for k in range(widths.shape[0]):
        w = widths[k]
        while have < w:
            acc |= np.uint64(data[r]) << np.uint64(have)
            r += 1
            have += 8
        out[k] = np.uint32(acc & ((np.uint64(1) << np.uint64(w)) - np.uint64(1)))
        acc >>= np.uint64(w)
        have -= w
    return acc  # the padding bits of the last byte: zero in a valid section


def pack_bits(values: np.ndarray, widths: np.ndarray) -> bytes:
    """The bypass section of ``values`` (uint32), value ``k`` in ``widths[k]`` bits (0..32; higher bits must be zero)."""
    values = np.ascontiguousarray(values, dtype=np.uint32)
    widths = np.ascontiguousarray(widths, dtype=np.uint8)
    if values.shape != widths.shape or (widths > 32).any():
        raise ValueError("one width (0..32) per value")
    if ((values.astype(np.uint64) >> widths.astype(np.uint64)) != 0).any():
        raise ValueError("a value wider than its width")
    out = np.empty((int(widths.sum(dtype=np.int64)) + 7) // 8, np.uint8)
    return out[:_pack(values, widths, out)].tobytes()


def unpack_bits(data: bytes, widths: np.ndarray) -> np.ndarray:
    """The values of a bypass section whose widths the reader knows; :class:`IntegrityError` if its length is not
    exactly what they need or its padding is not zero."""
    widths = np.ascontiguousarray(widths, dtype=np.uint8)
    if (widths > 32).any():
        raise IntegrityError("bypass: a width over 32 bits")
    need = (int(widths.sum(dtype=np.int64)) + 7) // 8
    if len(data) != need:
        raise IntegrityError(f"bypass: {len(data)} bytes where the widths need {need}")
    out = np.empty(widths.size, np.uint32)
    if _unpack(np.frombuffer(data, np.uint8), widths, out):
        raise IntegrityError("bypass: padding bits are not zero")
    return out


# -- positions as gap classes and raw low bits: the fused decode (a prototype, in no format yet) ---------------
# Sorted unique positions as gaps g[0] = p[0] + 1, g[k] = p[k] - p[k-1] (all >= 1); gap g is its class
# c = bit_length(g) (1..64), coded by the rANS stage with the part's static class frequencies, and its c - 1 low bits
# in the bypass section. Bytes: u16 lanes, then 64 u16 class frequencies, then u32 per lane state, u32 word count, the
# words, then the bypass section.
GAP_CLASSES = 65


@numba.njit(nogil=True, cache=True)
def _gap_classes(gaps):  # pragma: no cover - compiled
    c = np.empty(gaps.shape[0], np.int64)
    for i in range(gaps.shape[0]):
        g = gaps[i]
        k = 0
        while g:
            k += 1
            g >>= np.uint64(1)
        c[i] = k
    return c


@numba.njit(nogil=True, cache=True)
def _decode_positions(words, states, n, freq, cum, symbol_of, bits, out):  # pragma: no cover - compiled
    """rANS class, then its low bits, then the position: one pass, no intermediate array."""
    lanes = states.shape[0]
    x = states.astype(np.uint32)
    r = 0
    nw = words.shape[0]
    mask = np.uint32(M - 1)
    acc = np.uint64(0)  # the bypass reader
    have = 0
    b = 0
    nb = bits.shape[0]
    pos = np.int64(-1)
    i = 0
    while i < n:
        for lane in range(min(lanes, n - i)):
            v = x[lane]
            slot = v & mask
            c = symbol_of[slot]
            v = freq[c] * (v >> np.uint32(PROB_BITS)) + slot - cum[c]
            if v < np.uint32(RANS_L):
                if r >= nw:
                    return -1
                v = (v << np.uint32(16)) | np.uint32(words[r])
                r += 1
            x[lane] = v
            if c == 0:
                return -4  # class 0 is no gap
            w = c - 1
            while have < w:
                if b >= nb:
                    return -5
                acc |= np.uint64(bits[b]) << np.uint64(have)
                b += 1
                have += 8
            low = acc & ((np.uint64(1) << np.uint64(w)) - np.uint64(1))
            acc >>= np.uint64(w)
            have -= w
            pos += np.int64((np.uint64(1) << np.uint64(w)) | low)
            out[i + lane] = pos
        i += lanes
    if r != nw or b != nb or acc != np.uint64(0):
        return -2
    for lane in range(lanes):
        if x[lane] != np.uint32(RANS_L):
            return -3
    return 0


def encode_positions(pos: np.ndarray, lanes: int = 32) -> bytes:
    """Sorted unique non-negative positions as gap classes (rANS) and low bits (bypass)."""
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    gaps = np.diff(pos, prepend=np.int64(-1)).astype(np.uint64)
    if pos.size and (pos[0] < 0 or (gaps == 0).any()):
        raise ValueError("positions must be sorted, unique and non-negative")
    classes = _gap_classes(gaps)
    counts = np.bincount(classes, minlength=GAP_CLASSES)[1:GAP_CLASSES] if pos.size else np.ones(GAP_CLASSES - 1, np.int64)
    freq = np.concatenate([[0], normalize(counts)]).astype(np.uint32)
    words, states = encode(classes, freq, lanes)
    widths = np.maximum(classes - 1, 0).astype(np.uint8)
    low = (gaps & ((np.uint64(1) << widths.astype(np.uint64)) - np.uint64(1))).astype(np.uint64)
    if (widths > 32).any():  # the bypass section packs up to 32 bits a value: split a wider gap's low bits
        raise ValueError("a gap of 2**33 or more")
    head = np.concatenate([[lanes], freq[1:]]).astype(np.uint16)
    return (head.tobytes() + states.tobytes() + np.uint32(words.size).tobytes() + words.tobytes()
            + pack_bits(low.astype(np.uint32), widths))


def decode_positions(data: bytes, n: int) -> np.ndarray:
    """The ``n`` positions of :func:`encode_positions`' bytes; :class:`IntegrityError` on any inconsistency."""
    head = 2 * GAP_CLASSES
    if len(data) < head:
        raise IntegrityError("rANS positions: shorter than their header")
    h = np.frombuffer(data, np.uint16, GAP_CLASSES)
    lanes = int(h[0])
    freq = np.concatenate([[0], h[1:]]).astype(np.uint32)
    if not 1 <= lanes <= MAX_LANES or int(freq.sum()) != M:
        raise IntegrityError("rANS positions: bad lanes or class frequencies")
    at = head + 4 * lanes + 4
    if len(data) < at:
        raise IntegrityError("rANS positions: truncated lane states")
    states = np.frombuffer(data, np.uint32, lanes, head)
    nw = int(np.frombuffer(data, np.uint32, 1, at - 4)[0])
    if len(data) < at + 2 * nw or (n and (states < RANS_L).any()):
        raise IntegrityError("rANS positions: truncated stream or bad lane state")
    words = np.frombuffer(data, np.uint16, nw, at)
    bits = np.frombuffer(data, np.uint8, len(data) - at - 2 * nw, at + 2 * nw)
    cum, symbol_of = tables(freq)
    out = np.empty(n, np.int64)
    code = _decode_positions(words, states, n, freq, cum, symbol_of, bits, out)
    if code:
        raise IntegrityError(f"rANS positions: corrupt data (code {code})")
    return out


__all__ = ["M", "PROB_BITS", "RANS_L", "decode", "decode_positions", "encode", "encode_positions", "normalize",
           "pack_bits", "tables", "unpack_bits"]
