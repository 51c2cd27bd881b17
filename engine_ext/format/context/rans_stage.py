"""Codec v2's streams on the project's own rANS stage (coder ``ctx-rans``, format 9; docs/FORMAT.md, "ctx-rans").

Why: format 5's range-coded streams (``ctx``) cost 73 ns per change to decode, on one thread, and
every rank decoded a whole part's streams. The model is static (nothing adapts), so a table-driven
interleaved rANS (:mod:`engine_ext.format.context.rans`) decodes it in a few ns per change, and laying the
symbols out block by block lets a rank decode only the blocks it holds, on every core.

**Symbols** (the model is :mod:`engine_ext.format.context.models`'s, as in format 5). Changes are
ordered by block, then class, then rank. Change ``j`` of (block ``b``, class ``c``) has the gap
``g = rank - previous rank - 1`` (the first: its rank); its Golomb quotient ``q = g >> B`` is the
symbol ``min(q, QMAX)`` under the quotient table of key ``key[c, b]``, and its step's bin is a
symbol under the step table the part names for class ``c`` (``B``, ``key``: :func:`gap_params`).

**Chunks.** The changes are cut into chunks: a block of more than ``CHUNK_CHANGES`` alone, in near-equal
chunks; smaller blocks gathered in order until a chunk holds ``CHUNK_MIN`` (a short remainder joins the
gathered chunk before it), so a chunk may span blocks. A chunk of ``n`` changes codes them on ``L``
lanes (:func:`lanes_for`; change ``j`` of the chunk on lane ``j % L``) in *rounds* of ``L`` changes: a
round's quotient symbols (lanes ``0..m-1``), then its step symbols. Its rANS words (one 16-bit stream,
all lanes) come first, then its *bypass* section: per round, for each change ``48`` escape bits when
``q >= QMAX`` (``q - QMAX``) and the gap's ``B`` low bits, then for each change its step's low bits
(:func:`engine_ext.format.context.models.step_bins`), every field least significant bit first, the
last byte padded with zeros.

**Bytes** (little-endian): ``b"X3"``, u8 K, u8 block policy, u8 edges[K-1], varint populations[K],
varint changes per class[K], u8 step table per class with changes; where the part has more than one
block and changes, the *counts* (changes per (class, block) for every live class and every block but
the last: the zigzag of their deviation from their expectation, Golomb-Rice coded with format 5's
``B``: the quotient in unary, ``QMAX`` ones then 48 bits for a larger one, then the ``B`` low bits; a
bit section padded to a byte); then varint C and per chunk varint changes, lanes, words, bypass bytes
and (rank before the chunk + 1; 0 where the chunk starts its (block, class)), the first chunk without
that last field (it starts a (block, class)), the last without its changes and bypass bytes (what remains); then every chunk's u32 lane states; then every chunk's
words and bypass, in chunk order. Nothing may follow.

**Checks a reader makes:** every size and count bounded before use; each block's chunks hold exactly
its changes; every lane ends at the encoder's initial state, every word and bypass byte is read and
the padding is zero; quotients and ranks stay inside their block; a chunk that continues a
(block, class) starts where the previous chunk ended; no step is zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...errors import IntegrityError
from . import rans, rans_stage_kernels
from .blocks import Blocks
from .models import QMAX, count_params, golomb_params, quotient_probs, table_weights

if TYPE_CHECKING:  # a type only: codec imports this module
    from .codec import Header

MAGIC = b"X3"
CHUNK_CHANGES = 16384  # a block's changes above this are cut into chunks: the unit a thread (a GPU program) takes
CHUNK_MIN = 2048  # small blocks' changes gather into chunks of at least this many (each costs its states and entry)
LANES = 4  # rANS lanes of a chunk (fewer in a small one): enough independent chains for a CPU core
LANE_MIN = 1024  # changes a lane needs before a chunk takes another (its final state costs 4 bytes)
QKEYS = 80  # quotient table keys (golomb_params: min(B, 4) * 16 + level, level <= 12)
_W = 64  # table width: symbols per alphabet at most (quotients 49, steps <= 37)


# ---------------------------------------------------------------- tables (built once, cached)


def _rows(weights_list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(freq [T, 64], cum [T, 65], slots [T * M]) of normalized integer weights: the encoder's tables, and the
    decoder's one table per alphabet, a slot's symbol ``s``, ``f[s]`` and ``slot - cum[s]`` packed in an int32
    (``f | bias << 13 | s << 25``) so that a decode step is one load and one multiply-add."""
    T = len(weights_list)
    freq = np.zeros((T, _W), np.int64)
    cum = np.zeros((T, _W + 1), np.int64)
    slots = np.zeros((T, rans.M), np.int32)
    for t, w in enumerate(weights_list):
        f = rans.normalize(w).astype(np.int64)
        freq[t, : f.size] = f
        cum[t, 1:] = np.cumsum(freq[t])
        sym = np.repeat(np.arange(f.size), f)
        slots[t] = freq[t, sym] | ((np.arange(rans.M) - cum[t, sym]) << 13) | (sym << 25)
    return freq, cum, slots.reshape(-1)


@functools.lru_cache(maxsize=1)
def rans_quotient_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The quotient laws of every key as rANS tables: counts ``max(1, floor(p * 2^30))`` of
    :func:`quotient_probs` (IEEE ``+ - * /`` only, then integer normalisation): alike on every host."""
    return _rows([np.maximum(1, np.floor(quotient_probs(k) * float(1 << 30))).astype(np.int64) for k in range(QKEYS)])


@functools.lru_cache(maxsize=32)
def rans_step_tables(step_tables: tuple[bytes, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A version's step tables (one-byte codes) as rANS tables: their exact integer weights, normalized."""
    return _rows([table_weights(t).astype(np.int64) for t in step_tables])


def gap_params(k: np.ndarray, pops: np.ndarray, bl: Blocks) -> tuple[np.ndarray, np.ndarray]:
    """Golomb parameters (B, key) per (class, block) [K, S]: ``k`` changes among the class's expected
    population in the block (at least ``k``)."""
    expected_pop = np.maximum((pops[:, None] * bl.sizes[None, :]) // max(bl.numel, 1), k)
    b, key = golomb_params(k.reshape(-1), expected_pop.reshape(-1))
    return b.reshape(k.shape), key.reshape(k.shape)


def lanes_for(n: int) -> int:
    """A chunk's lanes: one per ``LANE_MIN`` changes, at most ``LANES`` (writer's choice; the directory lists them)."""
    return max(1, min(LANES, n // LANE_MIN))


def chunk_bounds(per_block: np.ndarray) -> np.ndarray:
    """Where a part's changes (block-major, ``per_block`` in each block) are cut into chunks: whole blocks
    gathered until a chunk holds ``CHUNK_MIN`` changes (its lane states and directory entry then cost
    little; a short remainder joins the gathered chunk before it), a block of more than ``CHUNK_CHANGES``
    alone and cut into near-equal chunks. Encoder only."""
    bounds, at, open_, gathered = [0], 0, False, False  # gathered: the last chunk closed holds whole small blocks
    for n in per_block.tolist():
        if n > CHUNK_CHANGES:
            if open_:
                bounds.append(at)
            parts = -(-n // CHUNK_CHANGES)
            bounds += (at + (np.arange(1, parts + 1) * n) // parts).tolist()
            at, open_, gathered = at + n, False, False
            continue
        at += n
        open_ = open_ or n > 0
        if open_ and at - bounds[-1] >= CHUNK_MIN:
            bounds.append(at)
            open_, gathered = False, True
    if open_:
        if gathered:
            bounds[-1] = at
        else:
            bounds.append(at)
    return np.asarray(bounds, np.int64)


# ---------------------------------------------------------------- encode
def varint_bytes(values) -> bytes:
    """LEB128 of non-negative integers (the layouts' headers and directories)."""
    out = bytearray()
    for v in values:
        v = int(v)
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def _golomb(g: np.ndarray, B: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(quotient symbol, quotient, low bits) of Golomb values ``g`` with ``B`` low bits."""
    q = g >> B
    return np.minimum(q, QMAX), q, g & ((np.int64(1) << B) - 1)


def encode(
    head: bytes,
    bl: Blocks,
    pops: np.ndarray,
    k: np.ndarray,
    ranks: np.ndarray,
    zsym: np.ndarray,
    zlow_bits: np.ndarray,
    zlow: np.ndarray,
    table_of_class: np.ndarray,
    step_tables: list[bytes],
) -> bytes:
    """A part's bytes after ``head`` (magic, K, policy, edges, populations, totals): ``k`` [K, S] changes per
    (class, block); ``ranks`` and the step bins (``zsym``, ``zlow_bits``, ``zlow``) in block, class, rank
    order; ``table_of_class`` the step table of each class (-1: no changes)."""
    K, S = k.shape
    totals = k.sum(axis=1)
    live = totals > 0
    out = bytearray(head)
    out += bytes(table_of_class[live].astype(np.uint8))
    qf, qc, _ = rans_quotient_tables()
    sf, sc, _ = rans_step_tables(tuple(step_tables))  # (the decoder's are built from the same normalized frequencies)
    freq, cum = np.concatenate([qf, sf]), np.concatenate([qc, sc])
    if S > 1 and live.any():
        expected = (totals[live, None] * bl.sizes[None, :-1]) // bl.numel
        dev = (k[live, :-1] - expected).reshape(-1)
        B, _ = count_params(expected)
        zz = ((dev << 1) ^ (dev >> 63)).astype(np.int64)
        buf = np.empty(16 * zz.size + 16 + int(((zz >> B.reshape(-1)).clip(0, QMAX) // 8).sum()), np.uint8)
        out += buf[: rans_stage_kernels.encode_counts(zz, B.reshape(-1).astype(np.int64), buf)].tobytes()
    # block-major: block b, class c at first[b, c]
    per_block = k.sum(axis=0)
    first = np.zeros((S, K + 1), np.int64)
    first[:, 1:] = np.cumsum(k.T, axis=1)
    first += np.concatenate([[0], np.cumsum(per_block)])[:-1, None]
    B, key = gap_params(k, pops, bl)
    n = ranks.size
    group_c = np.repeat(np.tile(np.arange(K), S), k.T.reshape(-1))  # the class of each change
    group_b = np.repeat(np.repeat(np.arange(S), K), k.T.reshape(-1))
    is_first = np.ones(n, bool)
    is_first[1:] = (group_c[1:] != group_c[:-1]) | (group_b[1:] != group_b[:-1])
    gaps = np.where(is_first, ranks, ranks - np.roll(ranks, 1) - 1)
    gB = B[group_c, group_b]
    qs, q, low = _golomb(gaps, gB)
    bounds = chunk_bounds(per_block)
    lanes = np.array([lanes_for(int(m)) for m in np.diff(bounds)], np.int64)
    starts_at = bounds[:-1]
    prev = np.where(is_first[starts_at] if n else np.zeros(0, bool), 0, ranks[np.maximum(starts_at - 1, 0)] + 1)
    buf = np.empty(16 * n + 64 * len(lanes) + 16, np.uint8)
    nwords, nbypass = np.zeros(len(lanes), np.int64), np.zeros(len(lanes), np.int64)
    states = np.zeros(int(lanes.sum()), np.int64)
    used = rans_stage_kernels.encode_chunks(
        qs,
        key[group_c, group_b],
        q,
        gB,
        low,
        zsym,
        QKEYS + table_of_class[group_c],
        zlow_bits,
        zlow,
        bounds,
        lanes,
        freq,
        cum,
        buf,
        nwords,
        nbypass,
        states,
    )
    directory = np.stack([np.diff(bounds), lanes, nwords, nbypass, prev], axis=1).tolist()
    directory[0] = directory[0][:4]  # the first chunk begins its (block, class): no rank before it
    directory[-1] = directory[-1][1:3] + directory[-1][4:]  # the last chunk's changes and bypass size: what remains
    out += varint_bytes([len(lanes)]) + b"".join(varint_bytes(r) for r in directory)
    out += states.astype("<u4").tobytes() + buf[:used].tobytes()
    return bytes(out)


# ---------------------------------------------------------------- decode
# The plan's arrays per chunk and per (block, class) group, in the order the compiled planner returns them and
# the decoders (numba and Triton) take them: numba passes tuples, so these orders are where the sides meet
CHUNK_ARRAYS = ("c_start", "lanes", "offs", "nwords", "nbypass", "c_state", "prev", "c_block", "states")
GROUP_ARRAYS = ("gend", "gq", "gB", "gsize", "gs")


@dataclass
class Plan:
    """A part's chunks as its header and directory list them (host work, O(chunks), every size checked): what a
    decoder runs, on the host (:func:`decode`) or on a device (``engine_ext.triton_kernels.rans_decode``).
    Arrays per chunk: ``c_start`` [C + 1] its first change, ``lanes``, ``offs`` the byte offset of its words,
    ``nwords``, ``nbypass`` bytes, ``c_state`` its first lane state in ``states``, ``prev`` (the rank before it
    + 1; 0 where it starts its (block, class)), ``c_block`` the block it starts in. Per (block, class) group ``g``
    (block-major, ``g = b * K + c``): ``gend`` its end, ``gq`` its quotient table's row in ``qtab``, ``gB`` its
    low bits, ``gsize`` its block's size, ``gs`` its class's step table row in ``stab``. Tables: packed slots
    (:func:`_rows`)."""

    starts: np.ndarray  # [S, K + 1]: block b, class c at starts[b, c]
    which: np.ndarray  # the chunks to decode
    c_start: np.ndarray
    lanes: np.ndarray
    offs: np.ndarray
    nwords: np.ndarray
    nbypass: np.ndarray
    c_state: np.ndarray
    prev: np.ndarray
    c_block: np.ndarray
    states: np.ndarray
    K: int
    gend: np.ndarray
    gq: np.ndarray
    gB: np.ndarray
    gsize: np.ndarray
    gs: np.ndarray
    qtab: np.ndarray
    stab: np.ndarray
    step_dtype: np.dtype

    def chunk_arrays(self) -> tuple[np.ndarray, ...]:
        """The per-chunk arrays, in :data:`CHUNK_ARRAYS`' order."""
        return tuple(getattr(self, name) for name in CHUNK_ARRAYS)

    def group_arrays(self) -> tuple[np.ndarray, ...]:
        """The per-(block, class) arrays, in :data:`GROUP_ARRAYS`' order."""
        return tuple(getattr(self, name) for name in GROUP_ARRAYS)

    @property
    def n(self) -> int:
        return int(self.c_start[-1])

    @property
    def itembits(self) -> int:
        return 8 * np.dtype(self.step_dtype).itemsize

    def check_continuations(self, ranks: np.ndarray) -> None:
        """A chunk that continues its (block, class) must start where the previous one ended (after a decode)."""
        cont = self.which[self.prev[self.which] > 0]
        if cont.size and (ranks[self.c_start[cont] - 1] != self.prev[cont] - 1).any():
            raise IntegrityError(_error(11))


_PLAN_ERRORS = {
    1: "truncated step tables",
    2: "a step table beyond the version's",
    3: "truncated counts",
    4: "corrupt counts",
    5: "a block count outside the block",
    6: "more changes than elements in a block",
    7: "a truncated or bad chunk directory",
    8: "chunks of no changes, bad lanes, or not the part's changes",
    9: "chunk bytes that do not make up the rest of the part",
    10: "a lane state below its lower bound",
    11: "a chunk does not continue its (block, class) where the previous ended",
}


def _error(code: int, n_step_tables: int = 0) -> str:
    """The message of a plan's (positive) or a chunk's (negative) error code."""
    if code < 0:
        return f"ctx-rans: corrupt chunk (code {code})"
    return f"ctx-rans: {_PLAN_ERRORS[code]}" + (f" {n_step_tables}" if code == 2 else "")


def _wanted(S: int, want) -> np.ndarray:
    wanted = np.ones(S, np.bool_)
    if want is not None:
        wanted[:] = False
        wanted[np.asarray(want, np.int64)] = True
    return wanted


def plan(data: np.ndarray, h: Header, bl: Blocks, step_dtype, step_tables: list[bytes], want=None) -> Plan:
    """The :class:`Plan` of a part (``data``, uint8) whose header ``h`` ends at ``data[h.at]``: the chunks of the blocks in ``want``
    (default all). One compiled pass over the header's rest and the directory (a reader plans every part)."""
    code, _stab, _k, chunks, which, starts, groups = rans_stage_kernels.plan_part(
        data, h.at, bl.sizes, h.pops, h.totals, len(step_tables), _wanted(bl.S, want), rans_quotient_tables()[2]
    )
    if code:
        raise IntegrityError(_error(int(code), len(step_tables)))
    return Plan(
        **dict(zip(CHUNK_ARRAYS, chunks, strict=True)),
        **dict(zip(GROUP_ARRAYS, groups, strict=True)),
        which=which,
        starts=starts,
        K=h.pops.size,
        qtab=rans_quotient_tables()[2],
        stab=rans_step_tables(tuple(step_tables))[2],
        step_dtype=np.dtype(step_dtype),
    )


def decode_part(
    data: np.ndarray, h: Header, bl: Blocks, step_dtype, step_tables: list[bytes], want=None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ranks, steps) of a part on the host on one thread: :func:`plan` and :func:`decode` in one compiled
    call (a small part's fixed cost is mostly crossings into compiled code)."""
    n = int(h.totals.sum())
    alloc = np.empty if want is None else np.zeros  # every entry written, or the unwanted chunks' left zero
    ranks, steps = alloc(n, np.int64), alloc(n, step_dtype)
    code, starts = rans_stage_kernels.decode_part(
        data,
        h.at,
        bl.sizes,
        h.pops,
        h.totals,
        len(step_tables),
        _wanted(bl.S, want),
        rans_quotient_tables()[2],
        rans_step_tables(tuple(step_tables))[2],
        8 * steps.itemsize,
        ranks,
        steps,
    )
    if code:
        raise IntegrityError(_error(int(code), len(step_tables)))
    return starts, ranks, steps


def decode(data: np.ndarray, p: Plan, workers: int = 1, pool=None) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, steps) of a plan's chunks on the host, block-major (:attr:`Plan.starts`; other chunks' entries zero):
    chunks spread over ``workers`` threads of ``pool`` (the kernel holds no GIL)."""
    alloc = np.empty if p.which.size == p.lanes.size else np.zeros  # all chunks written, or the others' left zero
    ranks, steps = alloc(p.n, np.int64), alloc(p.n, p.step_dtype)
    which, changes = p.which, np.diff(p.c_start)
    groups = (
        [which]
        if workers <= 1 or pool is None or which.size < 2
        else [
            g
            for g in np.array_split(
                which,
                np.searchsorted(np.cumsum(changes[which]), np.linspace(0, changes[which].sum(), workers + 1)[1:-1]),
            )
            if g.size
        ]
    )

    def run(g):
        return rans_stage_kernels.decode_chunks(
            data, g, p.chunk_arrays(), p.K, p.group_arrays(), p.qtab, p.stab, p.itembits, ranks, steps
        )

    codes = list(pool.map(run, groups)) if len(groups) > 1 else [run(g) for g in groups]
    if any(codes):
        raise IntegrityError(_error(min(codes)))
    p.check_continuations(ranks)
    return ranks, steps


__all__ = [
    "CHUNK_CHANGES",
    "LANES",
    "MAGIC",
    "Plan",
    "decode",
    "encode",
    "gap_params",
    "plan",
    "rans_quotient_tables",
    "rans_step_tables",
]
