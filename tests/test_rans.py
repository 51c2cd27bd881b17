"""The static interleaved rANS coder (engine_ext/format/context/rans.py): round trips at every lane count and
alphabet, integer-only normalisation that every host computes alike, and readers that refuse a short,
long or altered stream (a lane must end at the encoder's initial state)."""
from __future__ import annotations

import numpy as np
import pytest

from engine_ext.errors import IntegrityError
from engine_ext.format.context import rans


def skewed(rng, k: int, n: int) -> np.ndarray:
    p = rng.dirichlet(np.full(k, 0.3))
    return rng.choice(k, n, p=p)


@pytest.mark.parametrize("lanes", [1, 2, 8, 32, 64])
@pytest.mark.parametrize("k", [2, 49, 256])
def test_round_trip(lanes, k):
    rng = np.random.default_rng(k * 100 + lanes)
    for n in (0, 1, lanes - 1, lanes, 5000):
        sym = skewed(rng, k, n) if n else np.zeros(0, np.int64)
        freq = rans.normalize(np.bincount(sym, minlength=k) + (0 if n else 1))
        words, states = rans.encode(sym, freq, lanes)
        assert states.shape == (lanes,) and words.dtype == np.uint16
        assert np.array_equal(rans.decode(words, states, n, freq), sym), (lanes, k, n)


def test_bytes_near_the_entropy():
    """A static coder pays only the model's mismatch (none: exact counts) and the lanes' final states."""
    rng = np.random.default_rng(7)
    sym = skewed(rng, 49, 200_000)
    counts = np.bincount(sym, minlength=49)
    freq = rans.normalize(counts)
    words, states = rans.encode(sym, freq, 32)
    p = counts[counts > 0] / counts.sum()
    entropy_bytes = -(counts[counts > 0] * np.log2(p)).sum() / 8
    coded = words.nbytes + states.nbytes
    assert entropy_bytes <= coded <= 1.01 * entropy_bytes + 4 * 32 + 16, (coded, entropy_bytes)


def test_normalize_is_integer_only_and_exact():
    assert rans.normalize([1]).tolist() == [rans.M]
    f = rans.normalize([3, 0, 1, 1_000_000])
    assert int(f.sum()) == rans.M and f[1] == 0 and f[0] >= 1 and f[2] >= 1
    rng = np.random.default_rng(3)
    for _ in range(200):
        counts = rng.integers(0, 10**9, rng.integers(1, 300)) * (rng.random(1)[0] < 0.5 or rng.integers(0, 2, 1))
        if counts.sum() == 0:
            counts[0] = 1
        f = rans.normalize(counts)
        assert int(f.sum()) == rans.M and ((f > 0) == (counts > 0)).all()
        assert np.array_equal(f, rans.normalize(counts.tolist()))  # the same from any integer input
    # pinned: what every host computes for these counts (no float rounding involved)
    assert rans.normalize([5, 3, 1, 1]).tolist() == [2048, 1229, 410, 409]
    with pytest.raises(ValueError):
        rans.normalize([0, 0])
    with pytest.raises(ValueError):
        rans.normalize(np.ones(rans.M + 1, np.int64))


def test_readers_refuse_a_short_long_or_altered_stream():
    rng = np.random.default_rng(11)
    sym = skewed(rng, 49, 4000)
    freq = rans.normalize(np.bincount(sym, minlength=49))
    words, states = rans.encode(sym, freq, 8)
    with pytest.raises(IntegrityError, match="ends before"):
        rans.decode(words[:-3], states, sym.size, freq)
    with pytest.raises(IntegrityError, match="left over"):
        rans.decode(np.concatenate([words, words[:2]]), states, sym.size, freq)
    bad = states.copy()
    bad[3] ^= 1 << 20
    with pytest.raises(IntegrityError):
        rans.decode(words, bad, sym.size, freq)
    flipped = words.copy()
    flipped[len(words) // 2] ^= 0x0100
    with pytest.raises(IntegrityError):
        rans.decode(flipped, states, sym.size, freq)
    with pytest.raises(ValueError, match="frequency 0"):
        rans.encode(np.array([1]), rans.normalize([1, 0, 1]), 1)
    with pytest.raises(ValueError, match="outside"):
        rans.encode(np.array([5]), rans.normalize([1, 1]), 1)
