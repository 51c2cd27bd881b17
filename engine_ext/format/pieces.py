"""A blob's digest over its pieces' digests (format 8, ``digest: "pieces"``; spec in docs/FORMAT.md).

A flat SHA-256 of an anchor blob is a second pass over bytes the writer already hashes piece
by piece (each tensor or cell, for range readers): 1.3 s of a core per 2.25 GB. A *pieces*
digest is the SHA-256 of the concatenated 32-byte SHA-256 digests of the blob's *segments*:
the blob cut at 0, its size and both ends of every byte range the manifest lists into it, so
every byte lies in exactly one segment (the safetensors header and any gap are segments of
their own). The writer hashes each piece once; a reader checks the segments, in parallel
(hashlib releases the GIL), which is also faster than one serial pass.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

PIECES = "pieces"  # a Blob's ``digest`` when its sha256 is a pieces digest


def cuts(size: int, ranges: Iterable[tuple[int, int]]) -> list[int]:
    """The segment boundaries of a blob of ``size`` bytes with byte ranges ``(offset, length)`` listed
    into it: 0, ``size`` and both ends of every range, ascending, each once (an empty blob: [0])."""
    points = {0, size}
    for offset, length in ranges:
        points.update((offset, offset + length))
    return sorted(points)


def combine(digests: Iterable[bytes]) -> str:
    """The pieces digest (hex) from the segments' 32-byte SHA-256 digests, in offset order."""
    return hashlib.sha256(b"".join(digests)).hexdigest()


def pieces_sha256(data, bounds: list[int], workers: int = 1) -> str:
    """The pieces digest of ``data`` cut at ``bounds`` (from :func:`cuts`), its segments hashed by
    up to ``workers`` threads, each a run of neighbouring segments of about equal bytes."""
    view = memoryview(data).cast("B")
    if bounds[-1] != len(view):
        raise ValueError(f"segments end at {bounds[-1]}, the blob at {len(view)}")
    segments = list(itertools.pairwise(bounds))
    runs: list[list[tuple[int, int]]] = [[]]
    per = max(1, len(view) // max(1, workers))  # bytes a thread's run holds, about
    for a, b in segments:  # contiguous runs, one per thread, so many small tensors do not cost a hand-off each
        if runs[-1] and runs[-1][0][0] + per <= a:
            runs.append([])
        runs[-1].append((a, b))

    def run(segs):
        return [hashlib.sha256(view[a:b]).digest() for a, b in segs]

    if len(runs) == 1:
        return combine(run(runs[0]))
    with ThreadPoolExecutor(min(workers, len(runs))) as pool:
        return combine(d for ds in pool.map(run, runs) for d in ds)
