"""Fireworks' hot-load delta codec (``arc_v3``), measurable side by side with ours.

Package: ``fireworks-delta-compression`` 0.1.0 on PyPI (MIT, pure Python + numpy; its
``zstd`` dependency is the python-zstd C extension, *not* ``zstandard``). It is not a
dependency of this project; install it into a separate virtualenv, e.g.::

    /work/main/.venv/bin/python -m venv /work/bench-venv
    echo /work/main/.venv/lib/python3.11/site-packages \\
        > /work/bench-venv/lib/python3.11/site-packages/main_venv.pth   # reuse torch/numpy
    /work/bench-venv/bin/pip install --no-deps fireworks-delta-compression==0.1.0 'zstd>=1.5,<2'
    /work/bench-venv/bin/python bench/fireworks_codec.py                 # self-test below

(its other deps, torch, numpy, safetensors, packaging, come from the .pth). Where it
is not importable, ``available()`` is False and the other functions raise ImportError.

API used (paths inside the package):

* ``fireworks_delta_compression.delta_compress(src=old, dst=new, compression_format="arc_v3")``
  -> ``(blob: uint8 tensor, checksum: str)`` (``compression.py``; dispatches to
  ``backends/arc3.py::Arc3Backend.compress``). The blob is self-describing:
  ``b"ARC3_ENVELOPE\\0"`` + pickle ``{"codec", "data"}`` where ``data`` is zstd (level 1)
  or bz2 (level 9) of a pickled dict (shape, dtype, adler32, strategy
  ``mantissa_xor``: changed-index stream + mantissa stream + exceptions). Indices are
  delta-coded either ``flat`` (gaps downcast to the narrowest uint over the whole
  tensor) or ``row`` (per-row counts + per-row gaps). Changed elements whose
  sign/exponent are unchanged store only the mantissa transform (best of raw / XOR /
  zigzag difference), packed as 3-bit codes into a 7-entry codebook with escapes
  (``codebook3``); the rest are "exceptions" stored as full raw values.
  ``compress`` runs 5 candidates in a thread pool (flat/row x zstd/bz2, plus an
  ``arc_v2`` fallback = whole-tensor XOR + zstd level 3 in a safetensors blob) and
  returns the smallest among those done within 1.5x the time of the first finisher
  (``ARC3_CANDIDATE_WAIT_MULTIPLIER``), so its output size depends on timing.
* ``fireworks_delta_compression.delta_decompress(src=old, compressed_diff=blob,
  checksum=checksum, compression_format="arc_v3")`` -> new tensor
  (``Arc3Backend.decompress``; verifies the adler32 both in the payload and the one
  passed in).

Sizes here count ``len(blob) + len(checksum)``: the blob carries its own per-tensor
header (envelope, pickled shape/dtype/strategy/etc.); the checksum string (decimal
adler32, <= 10 bytes) is required to decode and in their file format is stored in the
safetensors ``__metadata__``. Not counted: the safetensors per-tensor JSON entry (name,
dtype, shape, offsets), as with our own codec's container.

Determinism: by default (``wait_all=True``) we raise the candidate-wait multiplier so
every candidate finishes and the smallest is taken, i.e. the best size arc_v3 can
produce (deterministic, favourable to Fireworks). ``wait_all=False`` keeps the
package's timing-dependent choice.

Threads: the package does not let you set thread counts (a 6-worker pool per backend,
a 3-worker pool for the mantissa transforms, python-zstd's ``compress`` with
``threads=0`` = one per core). ``arc_v3_encode_decode_seconds`` therefore pins the
calling thread (and the threads it spawns, which inherit the mask) to a single CPU and
sets ``torch.set_num_threads(1)`` while timing.

Other caveats: CPU only (decode calls ``.numpy()`` on the output; inputs are moved to
CPU here); the mantissa path covers float32/float16/bfloat16/fp8 only, other dtypes use
the arc_v2 fallback; decoding ``pickle.loads`` the blob, so never decode untrusted
deltas with it.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

_PKG = "fireworks-delta-compression"
_FORMAT = "arc_v3"
_WAIT_ALL_MULTIPLIER = 1e6  # finite: Event.wait(inf) raises OverflowError


def available() -> bool:
    """True when fireworks_delta_compression (and its python-zstd dep) import."""
    try:
        _mods()
    except ImportError:
        return False
    return True


def version() -> str | None:
    try:
        from importlib.metadata import version as _v

        return _v(_PKG)
    except Exception:
        return None


def _mods():
    import fireworks_delta_compression as fdc
    from fireworks_delta_compression.backends import arc3

    return fdc, arc3


def _prep(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"old/new differ: {old.shape} {old.dtype} vs {new.shape} {new.dtype}")
    return old.detach().cpu().contiguous(), new.detach().cpu().contiguous()


@contextlib.contextmanager
def _wait_multiplier(wait_all: bool):
    _, arc3 = _mods()
    saved = arc3._CANDIDATE_WAIT_MULTIPLIER
    if wait_all:
        arc3._CANDIDATE_WAIT_MULTIPLIER = _WAIT_ALL_MULTIPLIER
    try:
        yield
    finally:
        arc3._CANDIDATE_WAIT_MULTIPLIER = saved


def _encode(old: torch.Tensor, new: torch.Tensor, wait_all: bool):
    fdc, _ = _mods()
    with _wait_multiplier(wait_all):
        return fdc.delta_compress(src=old, dst=new, compression_format=_FORMAT)


def _decode(old: torch.Tensor, blob: torch.Tensor, checksum: str) -> torch.Tensor:
    fdc, _ = _mods()
    return fdc.delta_decompress(src=old, compressed_diff=blob, checksum=checksum, compression_format=_FORMAT)


def arc3_describe(blob: torch.Tensor, checksum: str) -> dict:
    """Which candidate won and how big each part is (for reports)."""
    _, arc3 = _mods()
    raw = bytes(blob.numpy().tobytes())
    out = {"blob_bytes": len(raw), "checksum_bytes": len(checksum)}
    if raw.startswith(arc3._ARC3_ENVELOPE_PREFIX):
        import pickle

        env = pickle.loads(raw[len(arc3._ARC3_ENVELOPE_PREFIX):])
        payload = arc3._unpack_payload(raw)
        out.update(candidate="arc3", codec=env["codec"], compressed_payload_bytes=len(env["data"]),
                   strategy=payload["strategy"])
        if payload["strategy"] == "mantissa_xor":
            ms = payload["mantissa_stream"]
            out.update(index_mode=payload["indices"]["kind"], transform=payload["transform"],
                       mantissa_kind=ms["kind"], exceptions=int(payload["exception_positions"]["count"]))
    else:
        out.update(candidate="arc_v2 fallback (whole-tensor XOR + zstd)")
    return out


def arc_v3_encode(old: torch.Tensor, new: torch.Tensor, *, wait_all: bool = True):
    """(blob uint8 tensor, checksum str) as the package produces them."""
    old, new = _prep(old, new)
    return _encode(old, new, wait_all)


def arc_v3_bytes(old: torch.Tensor, new: torch.Tensor, *, wait_all: bool = True) -> int:
    """Bytes of the arc_v3 encoding of old -> new: blob (with its header) + checksum string."""
    blob, checksum = arc_v3_encode(old, new, wait_all=wait_all)
    return blob.numel() + len(checksum.encode())


def arc_v3_roundtrip(old: torch.Tensor, new: torch.Tensor, *, wait_all: bool = True) -> bool:
    """Encode, decode against old, and check the result is bit-identical to new."""
    old, new = _prep(old, new)
    blob, checksum = _encode(old, new, wait_all)
    try:
        got = _decode(old, blob, checksum)
    except ValueError:  # their checksum checks raise on mismatch
        return False
    if got.shape != new.shape or got.dtype != new.dtype:
        return False
    return bool(torch.equal(got.reshape(-1).view(torch.uint8), new.reshape(-1).view(torch.uint8)))


@contextlib.contextmanager
def _single_cpu():
    """Pin this thread (threads it spawns inherit the mask) and torch to one CPU."""
    saved_aff = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if saved_aff:
        os.sched_setaffinity(0, {min(saved_aff)})
    try:
        yield
    finally:
        if saved_aff:
            os.sched_setaffinity(0, saved_aff)
        torch.set_num_threads(saved_threads)


def arc_v3_encode_decode_seconds(old: torch.Tensor, new: torch.Tensor, *, repeat: int = 3,
                                 wait_all: bool = True, single_cpu: bool = True) -> tuple[float, float]:
    """(encode_s, decode_s), best of ``repeat`` wall-clock runs, pinned to one CPU by default.

    Encode is ``delta_compress`` (all candidates when wait_all, so it does the work of
    five encoders); decode is ``delta_decompress`` including its two adler32 checks.
    """
    old, new = _prep(old, new)
    ctx = _single_cpu() if single_cpu else contextlib.nullcontext()
    enc_s = dec_s = float("inf")
    with ctx:
        for _ in range(max(1, repeat)):
            t0 = time.perf_counter()
            blob, checksum = _encode(old, new, wait_all)
            t1 = time.perf_counter()
            _decode(old, blob, checksum)
            t2 = time.perf_counter()
            enc_s, dec_s = min(enc_s, t1 - t0), min(dec_s, t2 - t1)
    return enc_s, dec_s


def perturb_ulp(old: torch.Tensor, frac: float, seed: int = 0) -> tuple[torch.Tensor, int]:
    """old with ~frac of its elements moved by +-1 in their int16 bit pattern (bf16/fp16)."""
    g = torch.Generator().manual_seed(seed)
    bits = old.contiguous().view(torch.int16).reshape(-1).clone()
    k = int(round(frac * bits.numel()))
    pos = torch.randperm(bits.numel(), generator=g)[:k]
    sign = torch.randint(0, 2, (k,), generator=g, dtype=torch.int16) * 2 - 1
    bits[pos] += sign
    return bits.view(old.dtype).reshape(old.shape), k


def _selftest() -> None:
    if not available():
        print(f"{_PKG} not importable: arc_v3 unavailable")
        return
    g = torch.Generator().manual_seed(0)
    old = (torch.randn(1024, 1024, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    new, k = perturb_ulp(old, 0.01, seed=1)
    changed = int((old.view(torch.int16) != new.view(torch.int16)).sum())
    print(f"{_PKG} {version()}  tensor {tuple(old.shape)} bf16, changed {changed} ({changed / old.numel():.2%})")
    for wait_all in (True, False):
        blob, cs = arc_v3_encode(old, new, wait_all=wait_all)
        n = blob.numel() + len(cs)
        print(f"  wait_all={wait_all}: {n} B = {n / changed:.3f} B/changed elem "
              f"({8 * n / changed:.2f} bits)  {arc3_describe(blob, cs)}")
    print(f"  roundtrip bit-exact: {arc_v3_roundtrip(old, new)}")
    enc, dec = arc_v3_encode_decode_seconds(old, new)
    mb = old.numel() * 2 / 1e6
    print(f"  1 CPU: encode {enc * 1e3:.1f} ms ({mb / enc:.0f} MB/s of bf16), "
          f"decode {dec * 1e3:.1f} ms ({mb / dec:.0f} MB/s)")
    enc, dec = arc_v3_encode_decode_seconds(old, new, single_cpu=False)
    print(f"  all CPUs ({len(os.sched_getaffinity(0))}): encode {enc * 1e3:.1f} ms, decode {dec * 1e3:.1f} ms")


if __name__ == "__main__":
    _selftest()
