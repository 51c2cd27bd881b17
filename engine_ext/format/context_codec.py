"""The context-conditioned coder ("ctx", format 4): changes coded given the base weights.

Why: whether a float element changes in an optimizer step, and by how many steps, depends
on its magnitude (its ULP is ``2^(exponent - mantissa bits)``), so small weights change far
more often. The receiver holds the base, hence every element's exponent: coding the mask
and the steps conditioned on it takes ~25 % fewer bytes than the first-order bound the
plain coder (:mod:`engine_ext.format.codec`) reaches (docs/benchmarks.md, "Codec v2").

**Model**, for one *part* (a whole tensor, or a grid cell of one, row-major, ``n`` elements):

* *class* of element ``i``: ``c(i) = #{edges <= exponent(base[i])}``, ``K <= 16`` classes;
* the part is cut into at most 2 x 2 *sub-cells* (:func:`sub_cells`; a tensor-parallel
  shard of 2 ranks falls on the cuts) so that a rank holding some sub-cells decodes those;
* *positions*: per (sub-cell, class), the ranks of the changed elements among that
  sub-cell's elements of that class (row-major order); the gaps ``g = r_k - r_{k-1} - 1``
  (``r_{-1} = -1``) are Golomb coded: ``q = g >> b_c`` under the geometric law of the
  class's change rate ``p_c`` (a 16-bit number in the header), and the ``b_c`` low bits uniform;
* *steps* (ordered-space, :mod:`engine_ext.format.dtypes`): per class, a categorical over the
  bin of ``z = zigzag(step)`` (``z`` itself below 8, else ``8 + log2(z) - 3`` with the low
  ``log2(z)`` bits uniform), with its counts in the header.

The entropy coder is ``constriction``'s range coder (one stream for positions, one for
steps). Decoding maps ranks to positions with one pass over the base (:func:`scan`: numba
when installed, else numpy; a Triton pass in ``engine_ext.triton_kernels.context_scan``).

**Layout** (little-endian). Positions bytes: ``b"X1"``, u8 K, u8 sub-cells S, u16 edges
[K-1], u16 p16 [K], varint counts [S][K], then u32 range-coder words. Values bytes: per
class u8 alphabet size A then A varint counts, then u32 words. Every count, size and
symbol is bounded before use; a wrong base decodes to ranks beyond a class's population
(refused) or to a result whose fingerprint the caller refuses.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from . import chunks
from ..errors import IntegrityError

MAGIC = b"X1"
MAX_CLASSES = 16
QMAX = 48  # Golomb quotients >= QMAX escape to 48 raw bits
EXACT = 8  # zigzag steps below this are symbols of their own; above, one symbol per power of two (a 16-bit step: 21 symbols)

SUB_PARTS = 2  # sub-cells per dimension (tensor parallelism of 2 falls on the cuts)
SUB_MIN = 1  # fewest elements per sub-cell: always cut (a shard of 2 ranks may split any tensor)
CLASS_COST_BITS = 48  # header bits one more class costs (its edge, rate, counts, step table): merge below that

# exponent field of each float dtype: (shift, mask) of the raw bits
EXPONENT = {"bfloat16": (7, 0xFF), "float16": (10, 0x1F), "float32": (23, 0xFF)}


def supports(dtype_name: str) -> bool:
    return dtype_name in EXPONENT


# ---------------------------------------------------------------- model pieces
def exponents(bits: np.ndarray, dtype_name: str) -> np.ndarray:
    """Biased exponent of each raw-bits element (int16/int32 view), as int64-free small ints."""
    shift, mask = EXPONENT[dtype_name]
    u = bits.view(np.uint16 if bits.itemsize == 2 else np.uint32)
    return ((u >> shift) & mask).astype(np.uint16)


def class_lut(edges, dtype_name: str) -> np.ndarray:
    """uint8 class of every exponent value: the number of edges at or below it."""
    _, mask = EXPONENT[dtype_name]
    return np.searchsorted(np.asarray(edges, np.int64), np.arange(mask + 1), side="right").astype(np.uint8)


def sub_cells(shape) -> list:
    """The part's sub-cells as (start, stop) boxes (row-major order), at most 2 x 2."""
    shape = tuple(int(s) for s in shape) or (1,)
    cuts = chunks.grid(shape, SUB_MIN, SUB_PARTS)
    if cuts is None:
        return [(tuple(0 for _ in shape), tuple(shape))]
    return chunks.boxes(cuts, shape)


def box_of(flat: np.ndarray, shape, box) -> np.ndarray:
    """The elements of a part's flat row-major array that lie in ``box``, in the box's row-major order."""
    shape = tuple(int(s) for s in shape) or (1,)
    return flat.reshape(shape)[tuple(slice(a, b) for a, b in zip(*box))].reshape(-1)


def golomb_bits(p16: int) -> int:
    """Low bits kept uniform for a class of change rate ``p16 / 65536`` (2^b * p in (1/4, 1/2])."""
    return max(0, min(32, int(math.floor(math.log2(65536 / p16))) - 1))


def quotient_probs(p16: int) -> np.ndarray:
    """The geometric law of Golomb quotients ``0..QMAX-1`` plus the escape (the tail mass)."""
    b = golomb_bits(p16)
    rho = (1.0 - p16 / 65536.0) ** (1 << b)
    j = np.arange(QMAX, dtype=np.float64)
    probs = np.empty(QMAX + 1)
    probs[:QMAX] = (1 - rho) * rho ** j
    probs[QMAX] = max(rho ** QMAX, 1e-9)
    return probs


def _zigzag(steps: np.ndarray) -> np.ndarray:
    w = steps.itemsize * 8
    s = steps.astype(np.int64)
    return ((s << 1) ^ (s >> (w - 1))) & ((1 << w) - 1)


def _step_bins(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(symbol, low bits) of zigzag steps: ``z`` below EXACT is its own symbol (no low bits);
    else symbol ``EXACT + log2(z) - 3`` and the ``log2(z)`` bits below the leading one."""
    lg = np.floor(np.log2(np.maximum(z, 1))).astype(np.int64)
    big = z >= EXACT
    return np.where(big, EXACT + lg - 3, z), np.where(big, lg, 0)


def _log_codes(hist: np.ndarray) -> np.ndarray:
    """A step table in one byte per symbol: 0 for none, else ``1 + round(8 log2 count)``."""
    with np.errstate(divide="ignore"):
        return np.where(hist > 0, 1 + np.minimum(254, np.round(8 * np.log2(np.maximum(hist, 1)))), 0).astype(np.uint8)


def _code_probs(codes: np.ndarray) -> np.ndarray:
    """The (unnormalised) probabilities both ends derive from a table's codes."""
    return np.where(codes > 0, np.exp2((codes.astype(np.float64) - 1) / 8), 0.0)


def _unzigzag(z: np.ndarray, itemsize: int) -> np.ndarray:
    s = (z >> 1) ^ -(z & 1)
    return s.astype(np.int16 if itemsize == 2 else np.int32)


# ---------------------------------------------------------------- varints
def _put_varints(out: bytearray, values) -> None:
    for v in values:
        v = int(v)
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)


class _Reader:
    """Bounded reads from a header; any overrun is an IntegrityError."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise IntegrityError("context header truncated")
        b = self.data[self.at:self.at + n]
        self.at += n
        return b

    def varints(self, n: int, limit: int) -> list[int]:
        out = []
        for _ in range(n):
            v, shift = 0, 0
            while True:
                byte = self.take(1)[0]
                v |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    break
                shift += 7
                if shift > 63:
                    raise IntegrityError("context header: varint too long")
            if v > limit:
                raise IntegrityError(f"context header: count {v} over its bound {limit}")
            out.append(v)
        return out

    def words(self) -> np.ndarray:
        rest = self.data[self.at:]
        if len(rest) % 4:
            raise IntegrityError("context stream is not whole 32-bit words")
        return np.frombuffer(rest, dtype="<u4").astype(np.uint32)


# ---------------------------------------------------------------- class choice
def _bin_entropy(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(np.where(p > 0, p * np.log2(p), 0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0))
    return n * np.nan_to_num(h)


def choose_edges(exps: np.ndarray, changed_exps: np.ndarray, n_exp: int) -> list[int]:
    """Exponent edges of the classes: start from one class per exponent value present and
    merge neighbours while a merge costs fewer mask bits than a class's header (at most
    ``MAX_CLASSES`` classes)."""
    pop = np.bincount(exps, minlength=n_exp).astype(np.float64)
    chg = np.bincount(changed_exps, minlength=n_exp).astype(np.float64)
    present = np.flatnonzero(pop)
    groups = [[int(e), pop[e], chg[e]] for e in present]  # [first exponent, population, changes]
    while len(groups) > 1:
        n = np.array([g[1] for g in groups])
        k = np.array([g[2] for g in groups])
        h = _bin_entropy(k, n)
        merged = _bin_entropy(k[:-1] + k[1:], n[:-1] + n[1:]) - h[:-1] - h[1:]
        i = int(np.argmin(merged))
        if merged[i] >= CLASS_COST_BITS and len(groups) <= MAX_CLASSES:
            break
        groups[i] = [groups[i][0], groups[i][1] + groups[i + 1][1], groups[i][2] + groups[i + 1][2]]
        del groups[i + 1]
    return [g[0] for g in groups[1:]]


# ---------------------------------------------------------------- encode
@dataclass
class Encoded:
    pos: bytes
    val: bytes


def _models():
    import constriction

    return constriction.stream.model, constriction.stream.queue


def _encode_uniform(enc, m, values: np.ndarray, bits: int) -> None:
    """``values`` < 2^bits as 16-bit uniform digits (low first)."""
    v = values.astype(np.int64)
    while bits > 0:
        w = min(16, bits)
        enc.encode((v & ((1 << w) - 1)).astype(np.int32), m.Uniform(1 << w))
        v >>= w
        bits -= w


def _decode_uniform(dec, m, n: int, bits: int) -> np.ndarray:
    out = np.zeros(n, dtype=np.int64)
    shift = 0
    while bits > 0:
        w = min(16, bits)
        out |= dec.decode(m.Uniform(1 << w), n).astype(np.int64) << shift
        shift += w
        bits -= w
    return out


def encode(dtype_name: str, shape, base_bits: np.ndarray, positions: np.ndarray, steps: np.ndarray) -> Encoded:
    """Encode the changes of one part: ``positions`` (sorted part-local row-major indices),
    ``steps`` (nonzero ordered-space steps there), given the part's ``base_bits`` (flat)."""
    m, queue = _models()
    shift, mask = EXPONENT[dtype_name]
    if (steps == 0).any():
        raise ValueError("a context-coded step is never zero")
    exps = exponents(base_bits, dtype_name)
    edges = choose_edges(exps, exps[positions], mask + 1)
    lut = class_lut(edges, dtype_name)
    cls = lut[exps]
    K = len(edges) + 1
    cells = sub_cells(shape)
    changed = np.zeros(base_bits.size, dtype=bool)
    changed[positions] = True
    step_at = np.zeros(base_bits.size, dtype=np.int64)
    step_at[positions] = steps
    counts = np.zeros((len(cells), K), dtype=np.int64)
    gaps = [[] for _ in range(K)]  # per class, cell-major
    cell_steps = [[] for _ in range(K)]
    for j, box in enumerate(cells):
        c_cell, ch_cell, s_cell = (box_of(a, shape, box) for a in (cls, changed, step_at))
        for c in range(K):
            in_class = c_cell == c
            r = np.flatnonzero(ch_cell[in_class])
            counts[j, c] = r.size
            if r.size:
                gaps[c].append(np.diff(r, prepend=-1) - 1)
                cell_steps[c].append(s_cell[in_class & ch_cell])
    totals = counts.sum(axis=0)
    pops = np.bincount(cls, minlength=K)
    p16 = [0 if not totals[c] else int(min(65535, max(1, round(65536 * totals[c] / pops[c])))) for c in range(K)]
    head = bytearray(MAGIC)
    head += struct.pack("<BB", K, len(cells))
    head += struct.pack(f"<{K - 1}H", *edges) if K > 1 else b""
    head += struct.pack(f"<{K}H", *p16)
    _put_varints(head, counts.reshape(-1))
    enc = queue.RangeEncoder()
    for c in range(K):
        if not totals[c]:
            continue
        g = np.concatenate(gaps[c])
        b = golomb_bits(p16[c])
        q = g >> b
        esc = q >= QMAX
        enc.encode(np.minimum(q, QMAX).astype(np.int32), m.Categorical(quotient_probs(p16[c]), perfect=False))
        if esc.any():
            _encode_uniform(enc, m, q[esc] - QMAX, 48)
        if b:
            _encode_uniform(enc, m, g & ((1 << b) - 1), b)
    pos_bytes = bytes(head) + enc.get_compressed().astype("<u4").tobytes()
    vhead = bytearray()
    venc = queue.RangeEncoder()
    for c in range(K):
        if not totals[c]:
            continue
        z = _zigzag(np.concatenate(cell_steps[c]).astype(base_bits.dtype))
        sym, low = _step_bins(z)
        codes = _log_codes(np.bincount(sym, minlength=1))
        vhead.append(len(codes))
        vhead += codes.tobytes()
        venc.encode(sym.astype(np.int32), m.Categorical(_code_probs(codes), perfect=False))
        big = sym >= EXACT
        for nb in np.unique(low[big]):  # the low bits of each power-of-two bin, uniform
            _encode_uniform(venc, m, z[big & (low == nb)], int(nb))
    return Encoded(pos_bytes, bytes(vhead) + venc.get_compressed().astype("<u4").tobytes())


# ---------------------------------------------------------------- decode
@dataclass
class Header:
    edges: list[int]
    p16: list[int]
    counts: np.ndarray  # [sub-cells, K]
    cells: list
    words: np.ndarray

    @property
    def K(self) -> int:
        return len(self.p16)


def parse_positions_header(data: bytes, nnz: int, shape, dtype_name: str) -> Header:
    if not supports(dtype_name):
        raise IntegrityError(f"context coder does not support {dtype_name}")
    r = _Reader(data)
    if r.take(2) != MAGIC:
        raise IntegrityError("not a context-coded segment")
    K, S = struct.unpack("<BB", r.take(2))
    cells = sub_cells(shape)
    if not 1 <= K <= MAX_CLASSES or S != len(cells):
        raise IntegrityError(f"context header: {K} classes, {S} sub-cells (expected 1..{MAX_CLASSES}, {len(cells)})")
    edges = list(struct.unpack(f"<{K - 1}H", r.take(2 * (K - 1)))) if K > 1 else []
    _, mask = EXPONENT[dtype_name]
    if any(not 0 < e <= mask for e in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
        raise IntegrityError("context header: class edges not increasing within the exponent range")
    p16 = list(struct.unpack(f"<{K}H", r.take(2 * K)))
    counts = np.array(r.varints(S * K, nnz), dtype=np.int64).reshape(S, K)
    if int(counts.sum()) != nnz:
        raise IntegrityError(f"context header holds {int(counts.sum())} changes, the manifest {nnz}")
    for j, box in enumerate(cells):
        if int(counts[j].sum()) > math.prod(b - a for a, b in zip(*box)):
            raise IntegrityError("context header: more changes than elements in a sub-cell")
    if any(counts[:, c].sum() and not p16[c] for c in range(K)):
        raise IntegrityError("context header: a class with changes has no rate")
    return Header(edges, p16, counts, cells, r.words())


def decode_ranks(h: Header) -> list[list[np.ndarray]]:
    """Per sub-cell, per class: the within-class ranks of the changes (decoded without the base)."""
    m, queue = _models()
    dec = queue.RangeDecoder(h.words)
    out = [[None] * h.K for _ in h.cells]
    for c in range(h.K):
        n = int(h.counts[:, c].sum())
        if not n:
            for j in range(len(h.cells)):
                out[j][c] = np.empty(0, dtype=np.int64)
            continue
        b = golomb_bits(h.p16[c])
        q = dec.decode(m.Categorical(quotient_probs(h.p16[c]), perfect=False), n).astype(np.int64)
        esc = q == QMAX
        if esc.any():
            q[esc] += _decode_uniform(dec, m, int(esc.sum()), 48)
        if int(q.max()) > (1 << 40) >> b:  # a gap beyond any tensor (MAX_NUMEL): the shift below stays exact
            raise IntegrityError("context positions: a gap beyond the tensor")
        g = q << b
        if b:
            g |= _decode_uniform(dec, m, n, b)
        at = 0
        for j, box in enumerate(h.cells):
            k = int(h.counts[j, c])
            if k and float(g[at:at + k].sum()) + k > math.prod(e - s for s, e in zip(*box)):
                raise IntegrityError("context positions: ranks beyond their sub-cell")  # and no int64 overflow
            out[j][c] = np.cumsum(g[at:at + k] + 1) - 1
            at += k
    return out


def decode_steps(data: bytes, counts: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Per class, the steps in (sub-cell, rank) order; ``counts`` [sub-cells, K] from the positions header."""
    m, queue = _models()
    r = _Reader(data)
    K = counts.shape[1]
    tables = []
    for c in range(K):
        n = int(counts[:, c].sum())
        if not n:
            tables.append(None)
            continue
        a = r.take(1)[0]
        if not 1 <= a <= EXACT + 8 * itemsize - 3:
            raise IntegrityError(f"context steps: alphabet of {a} symbols")
        codes = np.frombuffer(r.take(a), dtype=np.uint8)
        if not codes.any():
            raise IntegrityError("context steps: an empty table")
        tables.append(_code_probs(codes))
    dec = queue.RangeDecoder(r.words())
    out = []
    for c in range(K):
        n = int(counts[:, c].sum())
        if tables[c] is None:
            out.append(np.empty(0, dtype=np.int16 if itemsize == 2 else np.int32))
            continue
        z = dec.decode(m.Categorical(tables[c], perfect=False), n).astype(np.int64)
        big = z >= EXACT
        lg = z - EXACT + 3
        for nb in np.unique(lg[big]):
            sel = big & (lg == nb)
            z[sel] = (1 << int(nb)) | _decode_uniform(dec, m, int(sel.sum()), int(nb))
        if (z == 0).any():
            raise IntegrityError("context steps: a zero step")
        out.append(_unzigzag(z, itemsize))
    return out


def decode(dtype_name: str, shape, pos_data: bytes, val_data: bytes, nnz: int, base_of,
           backend: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """(sorted part-local positions, steps) of the changes in the sub-cells the caller holds.

    ``base_of(box)`` gives the flat raw bits (numpy, row-major) of one sub-cell of the part's
    base, or None when this caller holds none of it (its changes are skipped). ``backend``:
    the context pass's (:func:`scan`)."""
    h = parse_positions_header(pos_data, nnz, shape, dtype_name)
    shift, mask = EXPONENT[dtype_name]
    itemsize = 2 if dtype_name != "float32" else 4
    try:  # the range decoder refuses some invalid words with its own exceptions
        ranks = decode_ranks(h)
        steps = decode_steps(val_data, h.counts, itemsize)
    except (AssertionError, ValueError, RuntimeError, OverflowError) as e:
        raise IntegrityError(f"corrupt context stream ({type(e).__name__}: {e})") from None
    lut = class_lut(h.edges, dtype_name)
    out_pos, out_val = [], []
    used = np.zeros(h.K, dtype=np.int64)  # steps consumed per class (cell-major)
    for j, box in enumerate(h.cells):
        k = h.counts[j]
        bits = base_of(box)
        if bits is not None:
            flat_ranks = np.concatenate(ranks[j]) if k.sum() else np.empty(0, np.int64)
            starts = np.concatenate([[0], np.cumsum(k)]).astype(np.int64)
            p, src = scan(bits, shift, mask, lut, flat_ranks, starts, backend)
            cls_of = np.searchsorted(starts, src, side="right") - 1
            vals = np.empty(p.size, dtype=steps[0].dtype if steps else np.int16)
            for c in range(h.K):
                sel = cls_of == c
                vals[sel] = steps[c][used[c] + src[sel] - starts[c]]
            out_pos.append(chunks.to_global(torch.from_numpy(p), tuple(shape) or (1,), box).numpy())
            out_val.append(vals)
        used += k
    if not out_pos:
        return np.empty(0, np.int64), np.empty(0, np.int16 if itemsize == 2 else np.int32)
    pos, val = np.concatenate(out_pos), np.concatenate(out_val)
    if len(out_pos) > 1:
        order = np.argsort(pos, kind="stable")
        pos, val = pos[order], val[order]
    return pos, val


# ---------------------------------------------------------------- the context pass
def scan_reference(bits, shift, mask, lut, ranks, starts):
    """numpy: elements of class c in row-major order by a stable sort of the classes."""
    cls = lut[(bits.view(np.uint16 if bits.itemsize == 2 else np.uint32) >> shift) & mask]
    K = starts.size - 1
    pop = np.bincount(cls, minlength=K)[:K]
    for c in range(K):
        if starts[c + 1] > starts[c] and ranks[starts[c + 1] - 1] >= pop[c]:
            raise IntegrityError("context ranks beyond their class (a wrong base, or corrupt)")
    order = np.argsort(cls, kind="stable")
    offset = np.concatenate([[0], np.cumsum(pop)])
    cls_of = np.repeat(np.arange(K), np.diff(starts))
    pos = order[offset[cls_of] + ranks]
    src = np.argsort(pos, kind="stable")
    return pos[src].astype(np.int64), src.astype(np.int64)


_NUMBA = None


def _numba_scan():
    global _NUMBA
    if _NUMBA is None:
        try:
            import numba
        except ImportError:
            _NUMBA = False
            return _NUMBA

        @numba.njit(nogil=True, cache=True)
        def kernel(bits, shift, mask, lut, ranks, starts, pos, src):  # pragma: no cover - compiled
            K = starts.shape[0] - 1
            cnt = np.zeros(K, np.int64)
            ptr = starts[:-1].copy()
            nxt = np.empty(K, np.int64)
            for c in range(K):
                nxt[c] = ranks[ptr[c]] if ptr[c] < starts[c + 1] else -1
            k = 0
            for i in range(bits.shape[0]):
                c = lut[(bits[i] >> shift) & mask]
                r = cnt[c]
                if r == nxt[c]:
                    pos[k] = i
                    src[k] = ptr[c]
                    k += 1
                    ptr[c] += 1
                    nxt[c] = ranks[ptr[c]] if ptr[c] < starts[c + 1] else -1
                cnt[c] = r + 1
            return k

        _NUMBA = kernel
    return _NUMBA


def scan(bits, shift, mask, lut, ranks, starts, backend: str = "auto"):
    """(positions, index into ``ranks``) of the elements whose within-class rank is listed:
    one pass over the base. Raises IntegrityError for a rank beyond its class."""
    kernel = _numba_scan() if backend in ("auto", "numba") else False
    if not kernel:
        if backend == "numba":
            raise RuntimeError("numba is not installed")
        return scan_reference(bits, shift, mask, lut, ranks, starts)
    u = np.ascontiguousarray(bits).view(np.uint16 if bits.itemsize == 2 else np.uint32)
    pos = np.empty(ranks.size, np.int64)
    src = np.empty(ranks.size, np.int64)
    k = kernel(u, shift, mask, lut, ranks.astype(np.int64), starts.astype(np.int64), pos, src)
    if k != ranks.size:
        raise IntegrityError("context ranks beyond their class (a wrong base, or corrupt)")
    return pos, src
