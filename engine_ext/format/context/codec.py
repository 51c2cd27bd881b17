"""The context-conditioned coder (codec v2: ``ctx-rans``, format 9; ``ctx``, format 5): changes coded given the base.

Why: whether a float element changes in an optimizer step, and by how many steps, depends
on its magnitude (its ULP is ``2^(exponent - mantissa bits)``), so small weights change far
more often. The receiver holds the base, hence every element's exponent: coding the mask
and the steps conditioned on it takes ~25 % fewer bytes than the first-order bound the
plain coder (:mod:`engine_ext.format.codec`) reaches (docs/benchmarks.md, "Codec v2").

**Model**, for one *part* (a whole tensor, or a grid cell of one, row-major, ``n`` elements):

* *class* of element ``i``: ``c(i) = #{edges <= exponent(base[i])}``, ``K <= 16`` classes
  (exponents merged while a merge costs fewer bits than a class's header);
* *blocks*: the part is cut where tensor parallelism cuts the tensor (:func:`shard_cuts`:
  2, 4 and 8 equal shares of dimensions 0 and 1, and on dimension 0 the shares of a
  vocabulary padded to a multiple of 64, as vLLM and SGLang pad it), so that every rank
  holds whole blocks and decodes them from its own base alone;
* *counts*: per (class, block) the number of changes ``k``, coded around its expectation
  ``T_c * n_b / n`` (all blocks but the last; the last is what remains);
* *positions*: per (class, block) the ranks of the changed elements among that block's
  elements of that class (row-major order), as gaps ``g = r_k - r_{k-1} - 1`` Golomb coded:
  ``q = g >> b`` under the geometric law of the rate ``k / n_cb`` (``n_cb`` the class's
  expected population in the block), the ``b`` low bits uniform;
* *steps* (ordered space, :mod:`engine_ext.format.dtypes`): per class, a categorical over the
  bin of ``z = zigzag(step)`` (``z`` itself below 8, else ``8 + log2(z) - 3`` with the low
  ``log2(z)`` bits uniform), under one of the version's *step tables* (the manifest's
  ``step_tables``: shared by every part, so no part pays for its own).

Every probability both ends use comes from integers and IEEE ``+ - * /`` only (no ``exp``,
``log`` or ``pow``), so publisher and ranks on different hosts build bit-identical models.
The probabilities are :mod:`engine_ext.format.context.models`. Writers write format 9
(:func:`encode`): the symbols on the project's static interleaved rANS, block-major chunks a rank
decodes alone (:mod:`engine_ext.format.context.rans_stage`). Readers also read format 5, whose entropy
coder was ``constriction``'s range coder (one stream for counts and positions, one for steps;
its writer is kept for tests in ``tests/legacy_ctx.py``). Both share the header and the model
(:func:`arrange`); :func:`decode_streams` reads either. Decoding maps ranks to positions with
one pass over each held block's base (:func:`scan`, numba, blocks on every core; a Triton pass
in ``engine_ext.triton_kernels.context_scan``).

**Format 5 layout** (little-endian). Positions bytes: ``b"X2"``, u8 K, u8 edges [K-1], varint class
populations [K], varint changes per class [K], then u32 range-coder words. Values bytes:
u8 step table per class with changes, then u32 words. Every count, size and symbol is
bounded before use; a wrong base decodes to ranks beyond a class's population (refused)
or to a result whose fingerprint the caller refuses.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from dataclasses import dataclass

import constriction
import numpy as np
import torch

from ...errors import IntegrityError, PartlyHeldError
from ..chunks import Box
from . import rans_stage, rans_stage_kernels
from .blocks import MAX_POLICY, Blocks, part_blocks
from .models import (
    INT,
    QMAX,
    UINT,
    best_table,
    class_key,
    class_lut,
    count_params,
    exponents,
    quotient_probs,
    step_bins,
    table_weights,
    unzigzag,
    zigzag,
)
from .scan_kernels import exponent_histogram, scan
from .scan_kernels import pool as scan_pool
from .scan_kernels import ranks as block_ranks
from .symbols import EXACT, EXPONENT, ITEMSIZE, alphabet, supports

RANGE_MAGIC = b"X2"
MAX_CLASSES = 16
CLASS_COST_BITS = 40  # header bits one more class costs (edge, population, count, table, block counts)


# ---------------------------------------------------------------- model pieces
def _bin_entropy(k: float, n: float) -> float:
    """Bits of an ideal code of ``k`` changes among ``n`` elements (n * H(k / n))."""
    if k <= 0 or k >= n:
        return 0.0
    p = k / n
    return -n * (p * math.log2(p) + (1 - p) * math.log2(1 - p))


def choose_edges(pop: np.ndarray, chg: np.ndarray) -> list[int]:
    """Exponent edges of the classes from the populations and changes per exponent value:
    one class per exponent present, neighbours merged while a merge costs fewer mask bits
    than a class's header (and down to ``MAX_CLASSES``). Encoder only."""
    groups = [
        [int(e), float(pop[e]), float(chg[e])] for e in np.flatnonzero(pop)
    ]  # [first exponent, population, changes]

    def merge_cost(i):
        a, b = groups[i], groups[i + 1]
        return _bin_entropy(a[2] + b[2], a[1] + b[1]) - _bin_entropy(a[2], a[1]) - _bin_entropy(b[2], b[1])

    costs = [merge_cost(i) for i in range(len(groups) - 1)]
    while costs:
        i = min(range(len(costs)), key=costs.__getitem__)
        if costs[i] >= CLASS_COST_BITS and len(groups) <= MAX_CLASSES:
            break
        groups[i] = [groups[i][0], groups[i][1] + groups[i + 1][1], groups[i][2] + groups[i + 1][2]]
        del groups[i + 1], costs[i]
        for j in (i - 1, i):
            if 0 <= j < len(costs):
                costs[j] = merge_cost(j)
    return [g[0] for g in groups[1:]]


SAMPLE_RUNS, SAMPLE_RUN = 64, 4096  # the base elements :func:`pays` looks at: evenly spaced runs


def sample(flat: torch.Tensor) -> np.ndarray:
    """Up to SAMPLE_RUNS evenly spaced runs of SAMPLE_RUN elements of a flat tensor (any device), as numpy."""
    n = flat.numel()
    if n > SAMPLE_RUNS * SAMPLE_RUN:
        flat = torch.cat(
            [flat[a : a + SAMPLE_RUN] for a in np.linspace(0, n - SAMPLE_RUN, SAMPLE_RUNS).astype(np.int64).tolist()]
        )
    return flat.cpu().numpy()


def pays(dtype_name: str, base_sample: np.ndarray, changed_old: np.ndarray, numel: int, gain: float) -> bool:
    """Whether the exponent context promises at least ``gain`` of the mask's bits: the ideal
    cost of the changes given each element's exponent (populations from ``base_sample``)
    against without. Uniform changes (no context to use) skip the context coder's passes
    over the whole base. Encoder only."""
    n_exp = EXPONENT[dtype_name][1] + 1
    pop = np.bincount(exponents(base_sample, dtype_name), minlength=n_exp) * (numel / max(base_sample.size, 1))
    chg = np.bincount(exponents(changed_old, dtype_name), minlength=n_exp).astype(np.float64)
    plain = _bin_entropy(float(chg.sum()), float(numel))
    given = sum(_bin_entropy(min(k, n), n) for k, n in zip(chg, np.maximum(pop, chg)) if k)
    return given <= (1 - gain) * plain


# ---------------------------------------------------------------- Golomb codes
def _get_bits(dec, m, widths: np.ndarray) -> np.ndarray:
    out = np.zeros(widths.size, dtype=np.int64)
    for shift in (0, 16, 32):
        w = np.clip(widths - shift, 0, 16)
        sel = w > 0
        if sel.any():
            out[sel] |= dec.decode(m.Uniform(), (1 << w[sel]).astype(np.int32)).astype(np.int64) << shift
    return out


def _get_golomb(dec, m, b: np.ndarray, key: np.ndarray) -> np.ndarray:
    q = np.empty(b.size, dtype=np.int64)
    for k in np.unique(key):
        sel = key == k
        q[sel] = dec.decode(m.Categorical(quotient_probs(int(k)), perfect=False), int(sel.sum()))
    esc = q == QMAX
    if esc.any():
        q[esc] += _get_bits(dec, m, np.full(int(esc.sum()), 48))
    if q.size and (q > ((1 << 40) >> b)).any():  # beyond any tensor (MAX_NUMEL): the shift stays exact
        raise IntegrityError("context stream: a value beyond the tensor")
    return (q << b) | _get_bits(dec, m, b)


class _Reader:
    """Bounded reads from a header; any overrun is an IntegrityError."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise IntegrityError("context header truncated")
        b = self.data[self.at : self.at + n]
        self.at += n
        return b

    def varints(self, n: int, limit: int) -> np.ndarray:
        out = np.zeros(n, np.int64)
        at = rans_stage_kernels.varints(np.frombuffer(self.data, np.uint8), self.at, n, limit, out)
        if at < 0:
            raise IntegrityError(f"context header: truncated, or a count over its bound {limit}")
        self.at = at
        return out

    def words(self) -> np.ndarray:
        rest = self.data[self.at :]
        if len(rest) % 4:
            raise IntegrityError("context stream is not whole 32-bit words")
        return np.frombuffer(rest, dtype="<u4").astype(np.uint32)


# ---------------------------------------------------------------- encode
@dataclass
class CodedPart:
    """A context-coded part's segments: ``ctx-rans`` keeps all its bytes in ``pos`` (``val`` empty)."""

    pos: bytes
    val: bytes = b""


@dataclass
class Arranged:
    """A part's changes as the model sees them (encoder only): its classes and blocks, and each
    change's class, block and rank among its (block, class) elements."""

    edges: list
    pops: np.ndarray  # [K] elements of each class
    bl: Blocks
    cls: np.ndarray
    blk: np.ndarray
    rank: np.ndarray

    @property
    def K(self) -> int:
        return len(self.edges) + 1

    def head(self, magic: bytes, policy: int) -> bytearray:
        """The header both layouts share: magic, K, policy, edges, populations, changes per class."""
        head = bytearray(magic) + struct.pack("<BB", self.K, policy) + bytes(self.edges)
        head += rans_stage.varint_bytes(self.pops)
        head += rans_stage.varint_bytes(np.bincount(self.cls, minlength=self.K))
        return head


def arrange(
    dtype_name: str, tensor_shape, box: Box | None, policy: int, base_bits: np.ndarray, positions: np.ndarray
) -> Arranged:
    """Classes, blocks and ranks of a part's changes (``positions``: sorted part-local row-major indices),
    given the part's ``base_bits`` (flat)."""
    shift, mask = EXPONENT[dtype_name]
    bl = part_blocks(tensor_shape, box, policy)
    u = np.ascontiguousarray(base_bits).view(UINT[ITEMSIZE[dtype_name]]).reshape(-1)
    pos = positions.astype(np.int64)
    exp_at = ((u[pos] >> shift) & mask).astype(np.int64)
    pop_e = exponent_histogram(u, shift, mask)
    edges = choose_edges(pop_e, np.bincount(exp_at, minlength=mask + 1))
    lut = class_lut(edges, dtype_name)
    pops = np.bincount(lut, weights=pop_e, minlength=len(edges) + 1).astype(np.int64)
    blk = bl.block_of(pos)
    by_block = np.argsort(blk, kind="stable")
    rank = np.empty(pos.size, np.int64)
    bstart = np.searchsorted(blk[by_block], np.arange(bl.S + 1))
    block_ranks(u, *class_key(edges, dtype_name, bl.numel), bl.rows, bl.row_ptr, bl.run, pos[by_block], bstart, rank)
    by_position = np.empty_like(rank)
    by_position[by_block] = rank
    return Arranged(edges, pops, bl, lut[exp_at].astype(np.int64), blk, by_position)


def encode(
    dtype_name: str,
    tensor_shape,
    box: Box | None,
    policy: int,
    base_bits: np.ndarray,
    positions: np.ndarray,
    steps: np.ndarray,
    step_tables: list[bytes],
) -> CodedPart:
    """The ``ctx-rans`` bytes (format 9, :mod:`engine_ext.format.context.rans_stage`) of one part's changes (``box``
    of the tensor, None: all of it; its blocks cut by ``policy``): ``positions`` (sorted part-local row-major
    indices), ``steps`` (nonzero ordered-space steps there), given the part's ``base_bits`` (flat) and the
    version's ``step_tables`` for this dtype."""
    if (steps == 0).any():
        raise ValueError("a context-coded step is never zero")
    a = arrange(dtype_name, tensor_shape, box, policy, base_bits, positions)
    K, S = a.K, a.bl.S
    order = np.lexsort((a.rank, a.cls, a.blk))  # block, class, rank
    k = np.bincount(a.cls * S + a.blk, minlength=K * S).reshape(K, S)
    z = zigzag(steps[order], ITEMSIZE[dtype_name])
    sym, lg = step_bins(z)
    cls = a.cls[order]
    table_of_class = np.full(K, -1, np.int64)
    for c in np.flatnonzero(k.sum(axis=1)):
        table_of_class[c] = best_table(np.bincount(sym[cls == c], minlength=alphabet(dtype_name)), step_tables)
    return CodedPart(
        rans_stage.encode(
            bytes(a.head(rans_stage.MAGIC, policy)),
            a.bl,
            a.pops,
            k,
            a.rank[order],
            sym,
            lg,
            z & ((np.int64(1) << lg) - 1),
            table_of_class,
            step_tables,
        )
    )


# ---------------------------------------------------------------- decode
@dataclass
class Header:
    """What a part's bytes say before its streams (both layouts): ``at`` is where the streams begin."""

    magic: bytes
    policy: int
    edges: list[int]
    pops: np.ndarray  # [K] elements of each class in the part
    totals: np.ndarray  # [K] changes of each class
    at: int

    @property
    def K(self) -> int:
        return len(self.pops)


def parse_positions_header(data: bytes, nnz: int, numel: int, dtype_name: str) -> Header:
    if not supports(dtype_name):
        raise IntegrityError(f"context coder does not support {dtype_name}")
    r = _Reader(data)
    magic = r.take(2)
    if magic not in (RANGE_MAGIC, rans_stage.MAGIC):
        raise IntegrityError("not a context-coded segment (format 5 or 9)")
    K, policy = r.take(2)
    if not 1 <= K <= MAX_CLASSES or policy > MAX_POLICY:
        raise IntegrityError(f"context header: {K} classes (expected 1..{MAX_CLASSES}), block policy {policy}")
    edges = list(r.take(K - 1))
    _, mask = EXPONENT[dtype_name]
    if any(not 0 < e <= mask for e in edges) or any(a >= b for a, b in itertools.pairwise(edges)):
        raise IntegrityError("context header: class edges not increasing within the exponent range")
    pops = r.varints(K, numel)
    totals = r.varints(K, nnz)
    if int(pops.sum()) != numel or (totals > pops).any():
        raise IntegrityError(
            "context header: class populations do not make up the part, or hold fewer elements than changes"
        )
    if int(totals.sum()) != nnz:
        raise IntegrityError(f"context header holds {int(totals.sum())} changes, the manifest {nnz}")
    return Header(magic, policy, edges, pops, totals, r.at)


def decode_ranks(h: Header, bl: Blocks, dec, m) -> tuple[np.ndarray, np.ndarray]:
    """(changes per (class, block) [K, S], ranks in (class, block, rank) order), decoded
    without the base; every count and rank bounded by its block."""
    K, S = h.K, bl.S
    k = np.zeros((K, S), dtype=np.int64)
    live = h.totals > 0
    if S > 1 and live.any():
        expected = (h.totals[live, None] * bl.sizes[None, :-1]) // bl.numel
        b, key = count_params(expected)
        zz = _get_golomb(dec, m, b.reshape(-1), key.reshape(-1)).reshape(expected.shape)
        got = expected + ((zz >> 1) ^ -(zz & 1))
        if (got < 0).any() or (got > bl.sizes[None, :-1]).any():
            raise IntegrityError("context counts: a block count outside the block")
        k[live, :-1] = got
    k[:, -1] = h.totals - k[:, :-1].sum(axis=1)
    if (k[:, -1] < 0).any() or (k[:, -1] > bl.sizes[-1]).any() or (k.sum(axis=0) > bl.sizes).any():
        raise IntegrityError("context counts: more changes than elements in a block")
    b, key = (x.reshape(-1) for x in rans_stage.gap_params(k, h.pops, bl))
    flat = k.reshape(-1)
    group = np.repeat(np.arange(K * S), flat)
    g = _get_golomb(dec, m, b[group], key[group])
    if not g.size or float(g.astype(np.float64).sum()) > K * bl.numel:  # ranks are bounded by their blocks
        raise IntegrityError("context positions: no changes, or gaps beyond the part")
    run = np.cumsum(g + 1)
    start = np.concatenate([[0], np.cumsum(flat)])[:-1]
    before = np.where(start > 0, run[np.maximum(start - 1, 0)], 0)
    ranks = run - np.repeat(before, flat) - 1
    ends = np.cumsum(flat)[flat > 0] - 1
    if ends.size and (ranks[ends] >= np.repeat(bl.sizes[None, :], K, axis=0).reshape(-1)[flat > 0]).any():
        raise IntegrityError("context positions: ranks beyond their block")
    return k, ranks


def decode_steps(
    data: bytes, totals: np.ndarray, step_tables: list[bytes], dtype_name: str, dec_factory, m
) -> np.ndarray:
    """The steps in (class, block, rank) order."""
    r = _Reader(data)
    live = np.flatnonzero(totals)
    choice = list(r.take(live.size))
    if any(t >= len(step_tables) for t in choice):
        raise IntegrityError(f"context steps: a step table beyond the version's {len(step_tables)}")
    dec = dec_factory(r.words())
    itemsize = ITEMSIZE[dtype_name]
    sym = np.concatenate(
        [
            dec.decode(m.Categorical(table_weights(step_tables[t]), perfect=False), int(totals[c]))
            for c, t in zip(live, choice)
        ]
        or [np.empty(0, np.int32)]
    ).astype(np.int64)
    if sym.size and sym.max() >= alphabet(dtype_name):
        raise IntegrityError("context steps: a symbol beyond the alphabet")
    z = sym.copy()
    big = sym >= EXACT
    lg = sym[big] - EXACT + 3
    z[big] = (np.int64(1) << lg) | _get_bits(dec, m, lg)
    if (z == 0).any():
        raise IntegrityError("context steps: a zero step")
    return unzigzag(z, itemsize)


@dataclass
class Streams:
    """What the host decodes of one part before its context pass: the part's blocks, its classes,
    and the ranks with their steps regrouped block-major (block ``b``, class ``c`` at
    ``ranks[starts[b, c] : starts[b, c + 1]]``), every count and rank bounded by its block."""

    bl: Blocks
    edges: list[int]
    ranks: np.ndarray
    starts: np.ndarray  # [S, K + 1]
    steps: np.ndarray  # the step of each of ``ranks``

    @property
    def K(self) -> int:
        return self.starts.shape[1] - 1


@dataclass(frozen=True)
class StoredPart:
    """A context-coded part as a reader hands it to a decoder: its tensor's dtype and shape, the box of the tensor
    it covers (None: all of it), its positions and values segments as stored, its change count (the manifest's)
    and the version's step tables."""

    dtype_name: str
    tensor_shape: tuple[int, ...]
    box: Box | None
    pos_data: bytes
    val_data: bytes
    nnz: int
    step_tables: list[bytes]

    def header(self) -> tuple[Header, Blocks]:
        """Its :func:`part_header`."""
        return part_header(self.dtype_name, self.tensor_shape, self.box, self.pos_data, self.nnz)


def part_header(dtype_name: str, tensor_shape, box: Box | None, pos_data: bytes, nnz: int) -> tuple[Header, Blocks]:
    """A part's header and its blocks (cheap: no stream is decoded)."""
    full = tuple(int(x) for x in tensor_shape) or (1,)
    numel = math.prod(b - a for a, b in zip(*box)) if box else math.prod(full)
    h = parse_positions_header(pos_data, nnz, numel, dtype_name)
    return h, part_blocks(full, box, h.policy)


PARALLEL_CHANGES = 1 << 15  # parts with this many changes decode their chunks on every core
_CORES = os.cpu_count() or 1


def decode_streams(part: StoredPart, want=None, head: tuple[Header, Blocks] | None = None) -> Streams:
    """The entropy-coded streams of a part, decoded without its base (small: O(changes)): of the blocks in
    ``want`` only (default all; format 9 decodes no others, format 5 decodes all), ``head`` its
    :func:`part_header` where the caller has it."""
    h, bl = head or part.header()
    itemsize = ITEMSIZE[part.dtype_name]
    step_tables = part.step_tables
    if h.magic == rans_stage.MAGIC:
        if part.val_data:
            raise IntegrityError("a ctx-rans part has no values segment")
        data = np.frombuffer(part.pos_data, np.uint8)
        workers = _CORES
        if part.nnz < PARALLEL_CHANGES or workers == 1:
            starts, ranks, steps = rans_stage.decode_part(data, h, bl, INT[itemsize], step_tables, want)
            return Streams(bl, h.edges, ranks, starts, steps)
        p = rans_stage.plan(data, h, bl, INT[itemsize], step_tables, want)
        ranks, steps = rans_stage.decode(data, p, workers, scan_pool())
        return Streams(bl, h.edges, ranks, p.starts, steps)
    m, queue = constriction.stream.model, constriction.stream.queue  # format 5: constriction's range coder
    try:  # the range decoder refuses some invalid words with its own exceptions
        k, ranks = decode_ranks(h, bl, queue.RangeDecoder(_Reader(part.pos_data[h.at :]).words()), m)
        steps = decode_steps(part.val_data, h.totals, step_tables, part.dtype_name, queue.RangeDecoder, m)
    except (AssertionError, ValueError, RuntimeError, OverflowError) as e:
        raise IntegrityError(f"corrupt context stream ({type(e).__name__}: {e})") from None
    K, S = h.K, bl.S
    # ranks regrouped block-major (block b, class c at starts[b, c]); perm: block-major -> class-major
    group = np.repeat(np.arange(K * S), k.reshape(-1))
    perm = np.argsort((group % S) * K + group // S, kind="stable")
    starts = np.zeros((S, K + 1), dtype=np.int64)
    starts[:, 1:] = np.cumsum(k.T, axis=1)
    starts += np.concatenate([[0], np.cumsum(k.sum(axis=0))])[:-1, None]
    return Streams(bl, h.edges, ranks[perm], starts, steps[perm])


def held_blocks(bl: Blocks, base_of) -> dict | None:
    """The base the caller holds of a part: ``{-1: whole}`` for all of it, else ``{block: bits}`` per held
    block (empty: none). ``base_of`` as in :func:`decode`."""
    try:
        whole = base_of(((0,) * len(bl.shape), bl.shape))
    except PartlyHeldError:
        whole = False
    if whole is None:
        return {}
    if whole is not False:
        return {-1: whole}
    held = {}
    for b, sub in enumerate(bl.boxes):
        try:
            bits = base_of(sub)
        except PartlyHeldError as e:
            raise IntegrityError(f"{e}: {CUT_BLOCK}") from None
        if bits is not None:
            held[b] = bits
    return held


def decode(part: StoredPart, base_of) -> tuple[np.ndarray, np.ndarray]:
    """(sorted part-local positions, steps) of the changes in the blocks the caller holds.

    ``base_of(box)`` gives the flat raw bits (numpy, row-major) of a box of the part's base
    (part-local coordinates), None when the caller holds none of it, or raises
    :class:`PartlyHeldError` when it holds only some: then each block is asked for alone, and
    only those held are decoded. The context pass runs here on the host (numba); a base on an
    accelerator is decoded there by :func:`engine_ext.triton_kernels.context_decode.decode`."""
    h, bl = part.header()
    itemsize = ITEMSIZE[part.dtype_name]
    empty = np.empty(0, np.int64), np.empty(0, INT[itemsize])
    held = held_blocks(bl, base_of)
    if not held:
        return empty
    st = decode_streams(part, None if -1 in held else np.fromiter(held, np.int64), (h, bl))
    starts, ranks_b, steps = st.starts, st.ranks, st.steps
    if -1 in held:
        u = np.ascontiguousarray(held[-1]).view(UINT[itemsize]).reshape(-1)
        if u.size != bl.numel:
            raise IntegrityError("the base of a context-coded part has the wrong size")
        pos, src = scan(u, part.dtype_name, h.edges, bl, ranks_b, starts)
        vals = steps[src]
    else:
        out_pos, out_val = [], []
        for b, bits in held.items():
            sub = bl.boxes[b]
            ext = tuple(t - a for a, t in zip(*sub))
            u = np.ascontiguousarray(bits).view(UINT[itemsize]).reshape(-1)
            if u.size != bl.sizes[b]:
                raise IntegrityError("the base of a context-coded block has the wrong size")
            one = part_blocks(ext, None, 0)  # the block alone, as a part of one block
            sb = starts[b : b + 1] - starts[b, 0]
            p, src = scan(u, part.dtype_name, h.edges, one, ranks_b[starts[b, 0] : starts[b, -1]], sb)
            coords = np.unravel_index(p, ext)
            out_pos.append(np.ravel_multi_index(tuple(c + a for c, a in zip(coords, sub[0])), bl.shape))
            out_val.append(steps[starts[b, 0] + src])
        pos, vals = np.concatenate(out_pos), np.concatenate(out_val)
    if bl.S > 1:
        order = np.argsort(pos, kind="stable")
        pos, vals = pos[order], vals[order]
    return pos, vals


CUT_BLOCK = (
    "this rank's shard cuts a context-coded block (a layout its block policy does not anticipate: "
    "publish with ENGINE_EXT_CONTEXT_CODER=0)"
)
