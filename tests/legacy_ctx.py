"""Format 5's context coder writer (``ctx``, range-coded streams: the ``X2`` layout), kept for tests only.

Writers write ``ctx-rans`` (format 9) since issue 41; readers still read ``ctx`` parts
(:func:`engine_ext.format.context.codec.decode_streams`). This is the writer those parts came from, so
that tests can make any ``ctx`` part they need (every shard layout, every dtype, hostile variants) and
check that today's reader decodes it. ``tests/golden/store-f8`` holds parts it wrote, committed.
"""
from __future__ import annotations

import constriction
import numpy as np

from engine_ext.format.context.codec import RANGE_MAGIC, CodedPart, arrange
from engine_ext.format.context.models import (EXACT, ITEMSIZE, QMAX, alphabet, best_table, count_params, quotient_probs,
                                              step_bins, table_weights, zigzag)
from engine_ext.format.context.rans_stage import gap_params


def _put_bits(enc, m, values: np.ndarray, widths: np.ndarray) -> None:
    """``values < 2^widths`` (widths <= 48) as uniform 16-bit digits, low first; zero widths cost nothing."""
    for shift in (0, 16, 32):
        w = np.clip(widths - shift, 0, 16)
        sel = w > 0
        if sel.any():
            enc.encode(((values[sel] >> shift) & ((1 << w[sel]) - 1)).astype(np.int32), m.Uniform(),
                       (1 << w[sel]).astype(np.int32))


def _put_golomb(enc, m, g: np.ndarray, b: np.ndarray, key: np.ndarray) -> None:
    q = g >> b
    sym = np.minimum(q, QMAX).astype(np.int32)
    for k in np.unique(key):
        enc.encode(sym[key == k], m.Categorical(quotient_probs(int(k)), perfect=False))
    esc = q >= QMAX
    if esc.any():
        _put_bits(enc, m, q[esc] - QMAX, np.full(int(esc.sum()), 48))
    _put_bits(enc, m, g & ((1 << b) - 1), b)


def encode(dtype_name: str, tensor_shape, box, policy: int, base_bits: np.ndarray, positions: np.ndarray,
           steps: np.ndarray, tables: list[bytes]) -> CodedPart:
    """One part in format 5's layout (positions bytes, values bytes)."""
    m, queue = constriction.stream.model, constriction.stream.queue
    a = arrange(dtype_name, tensor_shape, box, policy, base_bits, positions)
    bl, K, S = a.bl, a.K, a.bl.S
    order = np.lexsort((a.rank, a.blk, a.cls))  # class, block, rank
    rank, cls = a.rank[order], a.cls[order]
    group = cls * S + a.blk[order]
    k = np.bincount(group, minlength=K * S).reshape(K, S)
    totals = k.sum(axis=1)
    enc = queue.RangeEncoder()
    live = totals > 0
    if S > 1 and live.any():
        expected = (totals[live, None] * bl.sizes[None, :-1]) // bl.numel
        dev = k[live, :-1] - expected
        b, key = count_params(expected)
        _put_golomb(enc, m, ((dev << 1) ^ (dev >> 63)).reshape(-1), b.reshape(-1), key.reshape(-1))
    first = np.ones(order.size, dtype=bool)
    first[1:] = group[1:] != group[:-1]
    gaps = np.where(first, rank, rank - np.roll(rank, 1) - 1)
    b, key = (x.reshape(-1) for x in gap_params(k, a.pops, bl))
    _put_golomb(enc, m, gaps, b[group], key[group])
    pos_bytes = bytes(a.head(RANGE_MAGIC, policy)) + enc.get_compressed().astype("<u4").tobytes()
    z = zigzag(steps[order], ITEMSIZE[dtype_name])
    sym, low = step_bins(z)
    vhead = bytearray()
    venc = queue.RangeEncoder()
    for c in np.flatnonzero(live):
        s = sym[cls == c]
        t = best_table(np.bincount(s, minlength=alphabet(dtype_name)), tables)
        vhead.append(t)
        venc.encode(s.astype(np.int32), m.Categorical(table_weights(tables[t]), perfect=False))
    big = sym >= EXACT
    _put_bits(venc, m, z[big] & ((1 << low[big]) - 1), low[big])
    return CodedPart(pos_bytes, bytes(vhead) + venc.get_compressed().astype("<u4").tobytes())
