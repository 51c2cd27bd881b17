"""One anchor publish taken apart, phase by phase, beside ``save_file`` + fsync of the same tensors.

    python bench/anchor_profile.py                 # scale_bench's 1.12 B bf16 model, 3 rounds
    python bench/anchor_profile.py --layers 8      # ~0.4 B, a quick look

Each round, on scale_bench's synthetic model (page cache warmed, the publisher's kernels loaded
first, ``os.sync()`` before each timed step):

* ``save_file`` + fsync of the state dict (the dense floor);
* one real ``DeltaPublisher`` anchor (``publish`` + ``wait``) with its phases instrumented in
  place: the thread time (user + system, summed over the threads that ran it) of the kept copy,
  the file writes, the blob's SHA-256 (format 8: its header's only, the blob's digest being
  over its pieces'), the tensors' (pieces') SHA-256, the fingerprint, the
  writer's fsync, the store's link (fsync + link + directory sync) and the commit (manifest,
  signature, LATEST); wall of the whole and of the background;
* each primitive alone, on one thread, over the same bytes: a copy, a SHA-256 pass, the
  fingerprint, and (for the per-core rates) what one SHA-256 pass costs next to two.

Prints one line per round and the per-phase table of the median round; ``--out`` gets the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_shape_args, shapes_of, signed_rounds, warm_up_publisher  # noqa: E402
from bench.scale_bench import fsync_file, warm_page_cache  # noqa: E402


class Phases:
    """Thread time and wall per phase, summed over every thread that entered it."""

    def __init__(self):
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, name: str):
        c, w = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            dc, dw = time.thread_time() - c, time.perf_counter() - w
            with self._lock:
                self.cpu[name] += dc
                self.wall[name] += dw

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            with self(name):
                return fn(*a, **k)
        return timed


@contextlib.contextmanager
def instrumented(ph: Phases):
    """Time the anchor's phases where they run (module attributes swapped for timing wrappers)."""
    from engine_ext.format import fingerprint as fpr
    from engine_ext.store import checkpoint
    from engine_ext.store.local import LocalStore
    from engine_ext.trainer import builder, publisher

    class TimedHash:
        def __init__(self, h, phase):
            self.h, self.phase = h, phase

        def update(self, b):
            with ph(self.phase):
                self.h.update(b)

        def hexdigest(self):
            return self.h.hexdigest()

        def digest(self):
            return self.h.digest()

        def copy(self):
            return TimedHash(self.h.copy(), self.phase)

    class TimedFile:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            with ph("write"):
                return self.f.write(b)

        def __getattr__(self, k):
            return getattr(self.f, k)

    class TimedHashlib:  # the writer's: hashlib.sha256(head) the blob's (before format 8) or its header's, hashlib.sha256() a tensor's or piece's
        @staticmethod
        def sha256(data=None):
            return TimedHash(hashlib.sha256(data), "sha_blob") if data is not None else TimedHash(hashlib.sha256(), "sha_tensor")

        def __getattr__(self, k):
            return getattr(hashlib, k)

    def close(self, *a, _close=checkpoint.SafetensorsWriter.close, **k):
        with ph("writer close (+ fsync if it syncs)"):
            return _close(self, *a, **k)

    saved = [(checkpoint, "hashlib", checkpoint.hashlib), (checkpoint.SafetensorsWriter, "close", checkpoint.SafetensorsWriter.close),
             (fpr, "buffer_fingerprint", fpr.buffer_fingerprint), (LocalStore, "create_file", LocalStore.create_file),
             (builder, "commit", builder.commit), (publisher.DeltaPublisher, "_remember", publisher.DeltaPublisher._remember)]
    checkpoint.hashlib = TimedHashlib()
    checkpoint.open = lambda *a, **k: TimedFile(open(*a, **k))
    checkpoint.SafetensorsWriter.close = close
    fpr.buffer_fingerprint = ph.wrap("fingerprint", fpr.buffer_fingerprint)
    LocalStore.create_file = ph.wrap("store link (fsync + link + dir sync)", LocalStore.create_file)
    builder.commit = ph.wrap("commit (incl. store link)", builder.commit)
    publisher.DeltaPublisher._remember = ph.wrap("kept copy (training thread)", publisher.DeltaPublisher._remember)
    try:
        yield
    finally:
        for obj, k, v in saved:
            setattr(obj, k, v)
        del checkpoint.open


def byte_views(sd: dict) -> list[memoryview]:
    return [memoryview(t.view(torch.int16).reshape(-1).numpy()).cast("B") for t in sd.values()]


def chunked(views, size=4 << 20):
    for v in views:
        for c in range(0, len(v), size):
            yield v[c:c + size]


def primitives(sd: dict, nbytes: int) -> dict:
    """Per-core rates (GB/s of model bytes) of each primitive alone, on this thread."""
    from engine_ext.format import fingerprint as fpr

    views, out = byte_views(sd), {}

    def rate(name, fn):
        os.sync()
        c, w = time.thread_time(), time.perf_counter()
        fn()
        out[name + " s"] = time.perf_counter() - w
        out[name + " cpu s"] = time.thread_time() - c
        out[name + " GB/s"] = nbytes / 1e9 / out[name + " s"]

    rate("copy (clone)", lambda: [t.clone() for t in sd.values()])

    def sha(n):
        hs = [hashlib.sha256() for _ in range(n)]
        for chunk in chunked(views):
            for h in hs:
                h.update(chunk)
    rate("sha256 x1", lambda: sha(1))
    rate("sha256 x2", lambda: sha(2))
    rate("fingerprint (buffer, 4 MB chunks)", lambda: [fpr.buffer_fingerprint(c, 2) for c in chunked(views)])
    return out


def run_round(args, work: Path, key: Path) -> dict:
    from safetensors.torch import save_file

    from engine_ext import DeltaPublisher

    gen = torch.Generator().manual_seed(0)
    sd = {n: (0.02 * torch.randn(s, generator=gen)).to(torch.bfloat16) for n, s in shapes_of(args).items()}
    nbytes = sum(t.numel() * 2 for t in sd.values())
    warm_page_cache(work, sd, 2)
    warm_up_publisher(work, str(key))
    out = {"GB": nbytes / 1e9}
    dense = work / "dense.safetensors"
    os.sync()
    w = time.perf_counter()
    c = time.thread_time()
    save_file(sd, str(dense))
    out["save_file s"] = time.perf_counter() - w
    out["save_file cpu s"] = time.thread_time() - c
    fsync_file(dense)
    out["save_file + fsync s"] = time.perf_counter() - w
    dense.unlink()

    ph = Phases()
    store = work / "store"
    with instrumented(ph):
        pub = DeltaPublisher(str(store), anchor_every=0, signing_key=str(key))
        os.sync()
        w = time.perf_counter()
        with ph("publish() call (training thread)"):
            pub.publish(sd)
        out["anchor: publish() returns s"] = time.perf_counter() - w
        pub.wait()
        out["anchor until stored s"] = time.perf_counter() - w
        pub.close()
    out.update({f"[cpu] {k}": v for k, v in ph.cpu.items()})
    out.update({f"[wall] {k}": v for k, v in ph.wall.items()})
    out["ratio"] = out["anchor until stored s"] / out["save_file + fsync s"]
    import shutil
    shutil.rmtree(store)
    if not args.no_primitives:
        out.update(primitives(sd, nbytes))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-primitives", action="store_true", help="skip the one-thread rates of each primitive")
    ap.add_argument("--out", default="anchor_profile.json")
    args = ap.parse_args()
    rounds = signed_rounds(args, run_round, "engine_ext_anchor_", lambda r: (
        f"save_file + fsync {r['save_file + fsync s']:.2f} s, anchor until stored {r['anchor until stored s']:.2f} s "
        f"({r['ratio']:.2f}x)"))
    keys = [k for k in rounds[0] if all(k in r for r in rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in keys}
    print(f"\n{med['GB']:.2f} GB of bf16, {os.cpu_count()} cores, median of {args.rounds} round(s) (per round: min-max)\n")
    for k in keys:
        vals = [r[k] for r in rounds]
        print(f"{k:55s} {med[k]:8.3f}   ({min(vals):.3f}-{max(vals):.3f})")
    Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rounds, "median": med}, indent=1))


if __name__ == "__main__":
    main()
