"""The compiled loops of the ``ctx-rans`` layout (:mod:`engine_ext.format.context.rans_stage` states it): the chunk
encoder, the reader's plan of a part (header rest, counts, directory; every size checked), and the chunk
decoder, one table load and one multiply-add per symbol. ``nogil``: a reader spreads chunks over its cores.
"""

from __future__ import annotations

import numba
import numpy as np

from . import rans
from .models import EXACT, QMAX, count_spread, golomb_param

ESCAPE_BITS = 48  # an escaped quotient's extra bits
SLOT = rans.M - 1  # a state's slot: x & SLOT
U = np.uint64  # hot indices as unsigned: numba then emits no negative-index wraparound (8.1 -> 5.9 ns per change)


@numba.njit(nogil=True, cache=True)
def _put(out, o, acc, have, v, w):  # pragma: no cover - compiled
    """Append ``w <= 48`` bits of ``v`` to a little-endian bit writer (acc, have) flushing bytes to ``out[o:]``."""
    if w:
        acc |= (v & ((np.int64(1) << w) - 1)) << have
        have += w
        while have >= 8:
            out[o] = acc & 0xFF
            o += 1
            acc >>= 8
            have -= 8
    return o, acc, have


@numba.njit(nogil=True, cache=True)
def _enc(x, f, c, tmp, w):  # pragma: no cover - compiled
    """One rANS encode step of a symbol (freq ``f``, cumulative ``c``) into state ``x``: (new state, words)."""
    x_max = ((rans.RANS_L >> rans.PROB_BITS) << 16) * f
    while x >= x_max:
        tmp[w] = x & 0xFFFF
        w += 1
        x >>= 16
    return (x // f) * rans.M + x % f + c, w


@numba.njit(nogil=True, cache=True)
def encode_chunks(
    qs, qkey, gq, gb, glow, ss, stab, sl, slow, bounds, lanes, freq, cum, out, nwords, nbypass, states
):  # pragma: no cover - compiled
    """Every chunk's words then bypass into ``out`` (returns its length); per change ``j``: quotient symbol
    ``qs`` under table ``qkey``, quotient ``gq`` (its escape), ``gb`` low bits ``glow``; step symbol ``ss``
    under table ``stab`` (an index into freq/cum), ``sl`` low bits ``slow``. Chunk ``c``: changes
    ``bounds[c]:bounds[c + 1]`` on ``lanes[c]`` lanes; states at ``states[sum(lanes[:c]):]``."""
    o = 0
    si = 0
    tmp = np.empty(4 * (bounds[-1] - bounds[0]) + 8, np.int64)
    for ch in range(bounds.shape[0] - 1):
        s, e, L = bounds[ch], bounds[ch + 1], lanes[ch]
        x = np.full(L, rans.RANS_L, np.int64)
        w = 0
        r0 = s + ((e - s - 1) // L) * L
        while r0 >= s:  # rounds backwards; in a round the steps (backwards), then the quotients
            m = min(L, e - r0)
            for l in range(m - 1, -1, -1):
                j = r0 + l
                x[l], w = _enc(x[l], freq[stab[j], ss[j]], cum[stab[j], ss[j]], tmp, w)
            for l in range(m - 1, -1, -1):
                j = r0 + l
                x[l], w = _enc(x[l], freq[qkey[j], qs[j]], cum[qkey[j], qs[j]], tmp, w)
            r0 -= L
        for i in range(w - 1, -1, -1):  # the decoder reads them forwards
            out[o] = tmp[i] & 0xFF
            out[o + 1] = tmp[i] >> 8
            o += 2
        nwords[ch] = w
        for l in range(L):
            states[si + l] = x[l]
        si += L
        acc = np.int64(0)
        have = 0
        b0 = o
        r0 = s
        while r0 < e:
            m = min(L, e - r0)
            for j in range(r0, r0 + m):
                if gq[j] >= QMAX:
                    o, acc, have = _put(out, o, acc, have, gq[j] - QMAX, ESCAPE_BITS)
                o, acc, have = _put(out, o, acc, have, glow[j], gb[j])
            for j in range(r0, r0 + m):
                o, acc, have = _put(out, o, acc, have, slow[j], sl[j])
            r0 += L
        if have:
            out[o] = acc
            o += 1
        nbypass[ch] = o - b0
    return o


@numba.njit(nogil=True, cache=True, inline="always")
def _refill(data, bp, bend, acc, have):  # pragma: no cover - compiled
    """Bypass bytes into the bit reader until it holds more than 48 bits (or the section ends)."""
    while have <= 48 and bp < bend:
        acc |= np.int64(data[U(bp)]) << have
        bp += 1
        have += 8
    return bp, acc, have


@numba.njit(nogil=True, cache=True)
def decode_chunks(
    data,
    which,
    chunks,
    K,
    groups,
    qtab,
    stab,
    itembits,
    ranks,
    steps,
):  # pragma: no cover - compiled
    """Decode chunks ``which`` (``chunks``: the directory's arrays, per chunk, as :meth:`Plan.chunk_arrays` orders
    them; ``c_off`` the byte offset of its words) into
    ranks and steps at their block-major places. Per (block, class) group ``g`` (block-major; ``groups`` as
    :meth:`Plan.group_arrays` orders them): its end ``gend``,
    the row of its quotient table ``gq`` in ``qtab``, its low bits ``gB``, its block's size ``gsize`` and the row
    of its class's step table ``gs`` in ``stab`` (tables packed by :func:`_rows`). Per change: one table load and
    one multiply-add for the quotient, its low bits, its rank; then the step symbol and its low bits. Returns 0,
    or a negative code naming what is corrupt."""
    c_start, c_lanes, c_off, c_words, c_bypass, c_state, c_prev, c_block, states = chunks
    gend, gq, gB, gsize, gs = groups
    x = np.empty(64, np.int64)
    srow = np.empty(64, np.int64)
    last = data.shape[0] - 2
    for wi in range(which.shape[0]):
        ch = which[wi]
        s, e, L = c_start[ch], c_start[ch + 1], c_lanes[ch]
        r = c_off[ch]  # words from r to wend, then the bypass to bend
        wend = r + 2 * c_words[ch]
        bp = wend
        bend = wend + c_bypass[ch]
        for l in range(L):
            x[U(l)] = states[c_state[ch] + l]
        g = c_block[ch] * K  # the group of change s
        while gend[g] <= s:
            g += 1
        prev = c_prev[ch] - 1
        if (prev >= 0) == ((gend[g - 1] if g else 0) == s):
            return -7  # a chunk that starts its (block, class) names a rank before it, or one that continues names none
        ge, qrow, B, size, sr = gend[g], gq[g], gB[g], gsize[g], gs[g]
        lim = (np.int64(1) << 40) >> B
        acc = np.int64(0)
        have = 0
        j = s
        while j < e:
            m = min(L, e - j)
            for l in range(m):
                jj = j + l
                if jj >= ge:
                    while gend[g] <= jj:
                        g += 1
                    ge, qrow, B, size, sr = gend[g], gq[g], gB[g], gsize[g], gs[g]
                    lim = (np.int64(1) << 40) >> B
                    prev = -1
                srow[U(l)] = sr
                v = x[U(l)]
                ent = np.int64(qtab[U(qrow + (v & SLOT))])
                q = ent >> 25
                v = (ent & 0x1FFF) * (v >> rans.PROB_BITS) + ((ent >> 13) & 0xFFF)
                rr = min(r, last)
                need = np.int64(v < rans.RANS_L)  # branch-free renormalisation: a 16-bit word or none
                v = (v << (need << 4)) | ((np.int64(data[U(rr)]) | (np.int64(data[U(rr + 1)]) << 8)) & -need)
                r += need << 1
                x[U(l)] = v
                if q == QMAX:
                    bp, acc, have = _refill(data, bp, bend, acc, have)
                    if have < ESCAPE_BITS:
                        return -5
                    q += acc & ((np.int64(1) << ESCAPE_BITS) - 1)
                    acc >>= ESCAPE_BITS
                    have -= ESCAPE_BITS
                    if q > lim:
                        return -6
                if have < B:
                    bp, acc, have = _refill(data, bp, bend, acc, have)
                    if have < B:
                        return -5
                prev += 1 + ((q << B) | (acc & ((np.int64(1) << B) - 1)))
                acc >>= B
                have -= B
                if prev >= size:
                    return -6
                ranks[U(jj)] = prev
            for l in range(m):  # (the quotient pass's decode step again, inline: a shared helper measured slower)
                jj = j + l
                v = x[U(l)]
                ent = np.int64(stab[srow[U(l)] + (v & SLOT)])
                sy = ent >> 25
                v = (ent & 0x1FFF) * (v >> rans.PROB_BITS) + ((ent >> 13) & 0xFFF)
                rr = min(r, last)
                need = np.int64(v < rans.RANS_L)  # branch-free renormalisation: a 16-bit word or none
                v = (v << (need << 4)) | ((np.int64(data[U(rr)]) | (np.int64(data[U(rr + 1)]) << 8)) & -need)
                r += need << 1
                x[U(l)] = v
                z = sy
                if sy >= EXACT:
                    lg = sy - EXACT + 3
                    if have < lg:
                        bp, acc, have = _refill(data, bp, bend, acc, have)
                        if have < lg:
                            return -5
                    z = (np.int64(1) << lg) | (acc & ((np.int64(1) << lg) - 1))
                    acc >>= lg
                    have -= lg
                if z == 0 or z >> itembits:
                    return -8
                steps[U(jj)] = (z >> 1) ^ -(z & 1)
            if r > wend:
                return -1
            j += m
        if r != wend:
            return -2
        if bp != bend or acc != 0 or have >= 8:
            return -4
        for l in range(L):
            if x[U(l)] != rans.RANS_L:
                return -3
    return 0


@numba.njit(nogil=True, cache=True)
def encode_counts(zz, B, out):  # pragma: no cover - compiled
    """Golomb-Rice codes of ``zz`` with ``B`` low bits into ``out``: the quotient ``q = zz >> B`` in unary (``q``
    one bits and a zero; ``QMAX`` ones and then ``q - QMAX`` in 48 bits where ``q >= QMAX``), then the low bits;
    least significant bit first, the last byte padded with zeros. Returns the bytes written."""
    o = 0
    acc = np.int64(0)
    have = 0
    for j in range(zz.shape[0]):
        q = zz[j] >> B[j]
        ones = min(q, QMAX)
        while ones > 0:
            w = min(ones, 32)
            o, acc, have = _put(out, o, acc, have, (np.int64(1) << w) - 1, w)
            ones -= w
        if q < QMAX:
            o, acc, have = _put(out, o, acc, have, 0, 1)
        else:
            o, acc, have = _put(out, o, acc, have, q - QMAX, ESCAPE_BITS)
        o, acc, have = _put(out, o, acc, have, zz[j], B[j])
    if have:
        out[o] = acc
        o += 1
    return o


@numba.njit(nogil=True, cache=True)
def varints(data, at, n, limit, out):  # pragma: no cover - compiled
    """``n`` LEB128 varints from ``data[at:]`` into ``out``; the new offset, or -1 (truncated, too long, over ``limit``)."""
    for i in range(n):
        v = np.int64(0)
        shift = 0
        while True:
            if at >= data.shape[0] or shift > 56:
                return -1
            byte = np.int64(data[at])
            at += 1
            v |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        if v > limit:
            return -1
        out[i] = v
    return at


@numba.njit(nogil=True, cache=True)
def _failed(code, K, S):  # pragma: no cover - compiled
    """:func:`plan_part`'s answer for a corrupt part: the code and empty arrays of the same types."""
    z = np.zeros(0, np.int64)
    chunks = (z, z, z, z, z, z, z, z, z)  # (numba multiplies no tuple)
    return np.int64(code), z, np.zeros((K, S), np.int64), chunks, z, np.zeros((S, K + 1), np.int64), (z, z, z, z, z)


@numba.njit(nogil=True, cache=True)
def plan_part(data, at, sizes, pops, totals, ntables, want, qtab):  # pragma: no cover - compiled
    """:func:`plan`'s work, every size checked: (error code or 0, the plan's arrays)."""
    K, S, N = pops.shape[0], sizes.shape[0], data.shape[0]
    numel = sizes.sum()
    n = totals.sum()
    stab = np.zeros(K, np.int64)
    live = 0
    for c in range(K):
        if totals[c] > 0:
            if at >= N:
                return _failed(1, K, S)
            stab[c] = data[at]
            at += 1
            live += 1
            if stab[c] >= ntables:
                return _failed(2, K, S)
    k = np.zeros((K, S), np.int64)
    if S > 1 and live:  # Golomb-Rice coded deviations of the counts from their expectations (encode_counts)
        bp, acc, have = at, np.int64(0), 0
        for c in range(K):
            if totals[c] == 0:
                continue
            for b in range(S - 1):
                expected = totals[c] * sizes[b] // numel
                B, _ = golomb_param(1, count_spread(expected) + 1)
                q = 0
                while True:
                    if have == 0:
                        bp, acc, have = _refill(data, bp, N, acc, have)
                        if have == 0:
                            return _failed(3, K, S)
                    bit = acc & 1
                    acc >>= 1
                    have -= 1
                    if bit == 0:
                        break
                    q += 1
                    if q == QMAX:
                        bp, acc, have = _refill(data, bp, N, acc, have)
                        if have < ESCAPE_BITS:
                            return _failed(3, K, S)
                        q += acc & ((np.int64(1) << ESCAPE_BITS) - 1)
                        acc >>= ESCAPE_BITS
                        have -= ESCAPE_BITS
                        break
                if q > ((np.int64(1) << 40) >> B):
                    return _failed(4, K, S)
                if have < B:
                    bp, acc, have = _refill(data, bp, N, acc, have)
                    if have < B:
                        return _failed(3, K, S)
                zz = (q << B) | (acc & ((np.int64(1) << B) - 1))
                acc >>= B
                have -= B
                got = expected + ((zz >> 1) ^ -(zz & 1))
                if got < 0 or got > sizes[b]:
                    return _failed(5, K, S)
                k[c, b] = got
        if acc & ((np.int64(1) << (have % 8)) - 1):  # the last byte's padding (the refills read whole bytes ahead)
            return _failed(4, K, S)
        at = bp - have // 8
    per_block = np.zeros(S, np.int64)
    for c in range(K):
        rest = totals[c]
        for b in range(S - 1):
            rest -= k[c, b]
        if rest < 0:
            return _failed(6, K, S)
        k[c, S - 1] = rest
        for b in range(S):
            per_block[b] += k[c, b]
    for b in range(S):
        if per_block[b] > sizes[b]:
            return _failed(6, K, S)
    one = np.zeros(1, np.int64)
    at = varints(data, at, 1, n, one)
    if at < 0:
        return _failed(7, K, S)
    C = one[0]
    c_start = np.zeros(C + 1, np.int64)
    lanes, nwords, nbypass, prev = (
        np.zeros(C, np.int64),
        np.zeros(C, np.int64),
        np.zeros(C, np.int64),
        np.zeros(C, np.int64),
    )
    entry = np.zeros(5, np.int64)
    total_lanes, total_bytes = 0, 0
    for ch in range(C):  # the first chunk lists no rank before it (it begins its group); the last chunk no changes
        if ch < C - 1:  # and no bypass size (what remains)
            at = varints(data, at, 5 - (ch == 0), max(N, numel + 1), entry)
            if ch == 0:
                entry[4] = 0
        else:
            at = varints(data, at, 3 - (ch == 0), max(N, numel + 1), entry[2:])
            entry[0], entry[1], entry[2], entry[3], entry[4] = (
                n - c_start[ch],
                entry[2],
                entry[3],
                0,
                0 if ch == 0 else entry[4],
            )
        if at < 0:
            return _failed(7, K, S)
        if entry[0] < 1 or not 1 <= entry[1] <= 64 or entry[2] > N or entry[3] > N:
            return _failed(8, K, S)
        c_start[ch + 1] = c_start[ch] + entry[0]
        lanes[ch], nwords[ch], nbypass[ch], prev[ch] = entry[1], entry[2], entry[3], entry[4]
        total_lanes += entry[1]
        total_bytes += 2 * entry[2] + entry[3]
    if c_start[C] != n:
        return _failed(8, K, S)
    st = at
    at += 4 * total_lanes
    if C:
        nbypass[C - 1] = N - at - total_bytes
    if C == 0 or nbypass[C - 1] < 0:
        return _failed(9, K, S)
    states = np.zeros(total_lanes, np.int64)
    for i in range(total_lanes):
        o = st + 4 * i
        states[i] = (
            np.int64(data[o])
            | (np.int64(data[o + 1]) << 8)
            | (np.int64(data[o + 2]) << 16)
            | (np.int64(data[o + 3]) << 24)
        )
        if states[i] < rans.RANS_L:
            return _failed(10, K, S)
    # per chunk: byte offset of its words, first lane state, the blocks it starts and ends in; which to decode
    offs, c_state, c_block = np.zeros(C, np.int64), np.zeros(C, np.int64), np.zeros(C, np.int64)
    which = np.zeros(C, np.int64)
    nwhich = 0
    b0 = 0
    end0 = per_block[0]
    for ch in range(C):
        offs[ch] = at
        at += 2 * nwords[ch] + nbypass[ch]
        c_state[ch] = c_state[ch - 1] + lanes[ch - 1] if ch else 0
        while end0 <= c_start[ch]:
            b0 += 1
            end0 += per_block[b0]
        c_block[ch] = b0
        b1, end1, wanted = b0, end0, want[b0]
        while end1 < c_start[ch + 1]:
            b1 += 1
            end1 += per_block[b1]
            wanted = wanted or want[b1]
        if wanted:
            which[nwhich] = ch
            nwhich += 1
    # per (block, class) group, block-major: its end, quotient table row, low bits, block size, step table row
    G = S * K
    gend, gq, gB, gsize, gs = (
        np.zeros(G, np.int64),
        np.zeros(G, np.int64),
        np.zeros(G, np.int64),
        np.zeros(G, np.int64),
        np.zeros(G, np.int64),
    )
    starts = np.zeros((S, K + 1), np.int64)
    end = 0
    for b in range(S):
        starts[b, 0] = end
        for c in range(K):
            g = b * K + c
            end += k[c, b]
            starts[b, c + 1] = end
            gend[g] = end
            B, key = golomb_param(k[c, b], max(pops[c] * sizes[b] // numel, k[c, b]))
            gq[g], gB[g], gsize[g], gs[g] = key * rans.M, B, sizes[b], stab[c] * rans.M
    chunks = (c_start, lanes, offs, nwords, nbypass, c_state, prev, c_block, states)
    return np.int64(0), stab, k, chunks, which[:nwhich], starts, (gend, gq, gB, gsize, gs)


@numba.njit(nogil=True, cache=True)
def decode_part(data, at, sizes, pops, totals, ntables, want, qtab, stab, itembits, ranks, steps):  # pragma: no cover
    """:func:`plan_part` then :func:`decode_chunks` and the continuation check in one compiled call (no plan crosses
    into Python: a part's fixed cost); (0 or an error code, starts)."""
    code, _, _, chunks, which, starts, groups = plan_part(data, at, sizes, pops, totals, ntables, want, qtab)
    if code:
        return code, starts
    code = decode_chunks(data, which, chunks, pops.shape[0], groups, qtab, stab, itembits, ranks, steps)
    if code:
        return code, starts
    c_start, prev = chunks[0], chunks[6]
    for ch in which:
        if prev[ch] > 0 and ranks[c_start[ch] - 1] != prev[ch] - 1:
            return np.int64(11), starts
    return np.int64(0), starts
