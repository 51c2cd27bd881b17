"""The probability models of the context coder, which publisher and ranks both build.

:mod:`engine_ext.format.context.codec` lays out the streams; this module says what each
symbol means and with which probabilities it is coded: the exponent field of each float
dtype and the classes over it, the step symbols, the version's shared step tables, and
the Golomb laws of gaps and counts. Every probability a decoder uses is built from
integers and IEEE ``+ - * /`` only (no ``exp``, ``log`` or ``pow``), so that every host
builds bit-identical models; what only the encoder computes (a table's codes, the choice
of a table) may use anything.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from .symbols import EXACT, EXPONENT, ITEMSIZE, MAX_STEP_TABLES, STEP_TABLE_MIN, alphabet

QMAX = 48  # Golomb quotients >= QMAX escape to 48 raw bits
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
INT = {1: np.int8, 2: np.int16, 4: np.int32}
# 2^(i/8) * 2^16, rounded: a step table's one-byte codes as exact integer weights
_POW8 = (65536, 71468, 77936, 84990, 92682, 101070, 110218, 120194)


def exponents(bits: np.ndarray, dtype_name: str) -> np.ndarray:
    shift, mask = EXPONENT[dtype_name]
    return ((bits.view(UINT[bits.itemsize]) >> shift) & mask).astype(np.uint8)


def class_lut(edges, dtype_name: str) -> np.ndarray:
    """uint8 class of every exponent value: the number of edges at or below it."""
    _, mask = EXPONENT[dtype_name]
    return np.searchsorted(np.asarray(edges, np.int64), np.arange(mask + 1), side="right").astype(np.uint8)


WIDE_MIN = 1 << 20  # parts this big look classes up by the top 16 bits of an element (one shift, no mask)


def class_key(edges, dtype_name: str, numel: int) -> tuple[int, int, np.ndarray]:
    """(shift, mask, lookup table): an element's class is ``lut[(bits >> shift) & mask]``. Big
    parts of 16- and 32-bit floats use a table over the top 16 bits (sign, exponent, a few
    mantissa bits): the pass then does one shift per element; small ones the exponent's."""
    shift, mask = EXPONENT[dtype_name]
    lut = class_lut(edges, dtype_name)
    if numel < WIDE_MIN or ITEMSIZE[dtype_name] == 1:
        return shift, mask, lut
    top = 8 * ITEMSIZE[dtype_name] - 16
    keys = np.arange(1 << 16, dtype=np.int64) << top
    return top, 0xFFFF, lut[(keys >> shift) & mask]


def zigzag(steps: np.ndarray, itemsize: int) -> np.ndarray:
    w = 8 * itemsize
    s = steps.astype(np.int64)
    return ((s << 1) ^ (s >> (w - 1))) & ((1 << w) - 1)


def unzigzag(z: np.ndarray, itemsize: int) -> np.ndarray:
    return ((z >> 1) ^ -(z & 1)).astype(INT[itemsize])


def bit_length(x: np.ndarray) -> np.ndarray:
    """Bit length of non-negative int64s below 2^53 (frexp is exact)."""
    return np.frexp(x.astype(np.float64))[1].astype(np.int64)


def step_bins(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(symbol, low-bit count) of zigzag steps: ``z`` below EXACT is its own symbol; else
    symbol ``EXACT + log2(z) - 3`` and the ``log2(z)`` bits below the leading one."""
    lg = bit_length(z) - 1
    big = z >= EXACT
    return np.where(big, EXACT + lg - 3, z), np.where(big, lg, 0)


# ---------------------------------------------------------------- step tables (model level)
@functools.lru_cache(maxsize=256)
def table_weights(codes: bytes) -> np.ndarray:
    """The exact integer weights (as float64) of a step table's one-byte codes: ``2^((code - 1) / 8)``."""
    c = np.frombuffer(bytes(codes), dtype=np.uint8).astype(np.int64) - 1
    return (np.array(_POW8, dtype=np.int64)[c % 8] << (c // 8)).astype(np.float64)


def table_codes(hist: np.ndarray) -> bytes:
    return np.minimum(255, 1 + np.round(8 * np.log2(hist + 1.0))).astype(np.uint8).tobytes()


def step_tables(dtype_name: str, exps: np.ndarray, steps: np.ndarray) -> list[bytes]:
    """A version's step tables for one dtype, from the exponents and steps of all its changes:
    one per exponent with ``STEP_TABLE_MIN`` changes or more (rarer ones join their neighbours),
    at most ``MAX_STEP_TABLES``. Every symbol gets a nonzero weight. Encoder only."""
    return tables_from_histogram(dtype_name, step_histogram(dtype_name, exps, steps))


def step_histogram(dtype_name: str, exps: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """[exponent, step symbol] counts of changes: all the step tables depend on. Histograms add
    up, so the ranks of a sharded trainer sum theirs and build the same tables. Encoder only."""
    A = alphabet(dtype_name)
    sym, _ = step_bins(zigzag(steps, ITEMSIZE[dtype_name]))
    n_exp = EXPONENT[dtype_name][1] + 1
    return np.bincount(exps.astype(np.int64) * A + sym, minlength=n_exp * A).reshape(n_exp, A)


def tables_from_histogram(dtype_name: str, by_exp: np.ndarray) -> list[bytes]:
    """:func:`step_tables` from a (summed) :func:`step_histogram`. Encoder only."""
    A = alphabet(dtype_name)
    n_exp = EXPONENT[dtype_name][1] + 1
    by_exp = np.asarray(by_exp, dtype=np.int64).reshape(n_exp, A)
    need = max(STEP_TABLE_MIN, -(-int(by_exp.sum()) // MAX_STEP_TABLES))
    tables, acc = [], np.zeros(A, dtype=np.int64)
    for e in range(n_exp):
        acc += by_exp[e]
        if acc.sum() >= need:
            tables.append(acc)
            acc = np.zeros(A, dtype=np.int64)
    if acc.sum() or not tables:
        if tables and acc.sum() < need:
            tables[-1] = tables[-1] + acc
        else:
            tables.append(acc)
    return [table_codes(t) for t in tables[:MAX_STEP_TABLES]]


@functools.lru_cache(maxsize=64)
def table_bits(tables: tuple[bytes, ...]) -> np.ndarray:
    """[tables, symbols]: the bits each table spends on each symbol. Encoder only."""
    w = np.stack([table_weights(t) for t in tables])
    return -np.log2(w / w.sum(axis=1, keepdims=True))


def best_table(hist: np.ndarray, tables: list[bytes]) -> int:
    """The table under which a class's symbol histogram costs the fewest bits. Encoder only."""
    return int(np.argmin(table_bits(tuple(tables)) @ hist))


# ---------------------------------------------------------------- Golomb laws
@numba.njit(cache=True, nogil=True)
def golomb_param(k, n):  # pragma: no cover - compiled
    """(low bits b, quotient table key) of gaps between ``k`` changes among ``n`` elements:
    ``2^b`` near ``n / (2 k)`` (so that ``x = 2^b k / n`` lies in (1/4, 1/2], or (1/4, 1] when
    b = 0), and the key names the quotient law's level of ``x`` (1/16 steps). Integers only."""
    k = max(k, 1)
    x, length = n // k, 0
    while x:
        length += 1
        x >>= 1
    b = max(0, length - 2)
    level = min(max((k << (b + 4)) // max(n, 1) - 4, 0), 12)
    return b, min(b, 4) * 16 + level


@numba.njit(cache=True, nogil=True)
def count_spread(expected):  # pragma: no cover - compiled
    """The spread (~ its square root) a block's count deviates from its expectation by (IEEE sqrt: exact everywhere)."""
    return 1 + (8 * np.int64(np.floor(np.sqrt(np.float64(expected))))) // 5


@numba.njit(cache=True, nogil=True)
def _golomb_params(k, n, b, key):  # pragma: no cover - compiled
    for i in range(k.shape[0]):
        b[i], key[i] = golomb_param(k[i], n[i])


def golomb_params(k: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`golomb_param` of arrays (any shape)."""
    k, n = np.broadcast_arrays(np.asarray(k, np.int64), np.asarray(n, np.int64))
    b, key = np.empty(k.shape, np.int64), np.empty(k.shape, np.int64)
    _golomb_params(
        np.ascontiguousarray(k).reshape(-1), np.ascontiguousarray(n).reshape(-1), b.reshape(-1), key.reshape(-1)
    )
    return b, key


@functools.cache
def quotient_probs(key: int) -> np.ndarray:
    """The geometric law of Golomb quotients ``0..QMAX-1`` plus the escape, for a table key:
    ``rho = (1 - x / 2^b)^(2^b)`` by squaring (b capped at 4: the law barely moves above)."""
    b, level = divmod(key, 16)
    p = min((level + 4.5) / 16 / (1 << b), 0.96875)
    rho = 1.0 - p
    for _ in range(b):
        rho = rho * rho
    probs, acc = np.empty(QMAX + 1), 1.0
    for j in range(QMAX):
        probs[j] = (1.0 - rho) * acc
        acc = acc * rho
    probs[QMAX] = max(acc, 1e-9)
    return probs


def count_params(expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Golomb parameters of zigzag deviations from an expected count (:func:`count_spread`)."""
    expected = np.asarray(expected, np.int64)
    spread = np.array([count_spread(e) for e in expected.reshape(-1).tolist()], np.int64).reshape(expected.shape)
    return golomb_params(np.ones_like(spread), spread + 1)
