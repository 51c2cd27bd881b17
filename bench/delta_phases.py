"""Where one 1 % delta publish spends its time, phase by phase, on scale_bench's synthetic model.

    python bench/delta_phases.py                 # ~1.1 B params (24 layers), 2 deltas
    python bench/delta_phases.py --layers 8      # a quick look

The publisher's functions are wrapped with timers (thread time summed over the calls, so
phases on the encode pool can add up to more than the wall time) and one anchor then
``--deltas`` 1 % deltas are published into a local store, after a warm-up
(:func:`bench.common.warm_up_publisher`). Prints, per delta: the wall time the training
step waits (``publish``) and until stored (``wait``), and the seconds in each phase.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_shape_args, shapes_of, warm_up_publisher  # noqa: E402
from bench.scale_bench import rl_step, warm_page_cache  # noqa: E402

SPENT: dict = collections.defaultdict(float)
CALLS: dict = collections.defaultdict(int)
_LOCK = threading.Lock()


def _timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with _LOCK:
                SPENT[label] += time.perf_counter() - t
                CALLS[label] += 1
    return wrapper


def instrument() -> None:
    """Wrap the phases of a delta publish (module attributes looked up at call time)."""
    from engine_ext.format import cell_kernels, codec, chunks, manifest
    from engine_ext.store import local, signing
    from engine_ext.trainer import builder, delta_pipeline, publisher

    P = publisher.DeltaPublisher
    for label, owner, name in [
        ("train: clean_state_dict (+cast)", publisher, "clean_state_dict"),
        ("train: _snapshot_delta (all)", P, "_snapshot_delta"),
        ("train:   diff (changed_bits)", publisher, "changed_bits"),
        ("train:   fingerprint update", publisher.fpr, "update_fingerprint"),
        ("train:   context_policy", codec, "context_policy"),
        ("bg: _build (all)", P, "_build"),
        ("bg:   DeltaEncoder.write (all)", delta_pipeline.DeltaEncoder, "write"),
        ("bg:     context_pays (pool)", codec, "context_pays"),
        ("bg:     step_histograms", codec, "step_histograms"),
        ("bg:     encode_tensor (pool)", codec, "encode_tensor"),
        ("bg:       cell_kernels.group (pool)", cell_kernels, "group"),
        ("bg:       encode_gaps (pool)", codec, "encode_gaps"),
        ("bg:       encode_positions (pool)", codec, "encode_positions"),
        ("bg:       _value_modes (pool)", codec, "_value_modes"),
        ("bg:       encode_values (pool)", codec, "encode_values"),
        ("bg:       _sampled_mode (pool)", codec, "_sampled_mode"),
        ("bg:       chunks.split (pool)", chunks, "split"),
        ("bg:       chunks.to_local (pool)", chunks, "to_local"),
        ("bg:     builder add_encoded (hash+append)", builder.VersionBuilder, "add_encoded"),
        ("bg:   commit (all)", builder, "commit"),
        ("bg:     Manifest.validate", manifest.Manifest, "validate"),
        ("bg:     Manifest.to_json", manifest.Manifest, "to_json"),
        ("bg:     sign", signing.Signer, "sign_detached"),
        ("bg:     publish_version (all)", builder, "publish_version"),
        ("bg:       store create_file (blob: fsync, link)", local.LocalStore, "create_file"),
        ("bg:       store create (claim, sig, manifest)", local.LocalStore, "create"),
        ("bg:       store write_if (LATEST)", local.LocalStore, "write_if"),
    ]:
        setattr(owner, name, _timed(label, getattr(owner, name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--deltas", type=int, default=2)
    ap.add_argument("--gap", type=float, default=0.0,
                    help="seconds between deltas (a training step's length: memory freed that long ago may be cold again)")
    args = ap.parse_args()
    from engine_ext import DeltaPublisher

    instrument()
    gen = torch.Generator().manual_seed(0)
    sd = {n: (0.02 * torch.randn(s, generator=gen)).to(torch.bfloat16) for n, s in shapes_of(args).items()}
    params = sum(t.numel() for t in sd.values())
    versions = [sd]
    for _ in range(args.deltas):
        versions.append(rl_step(versions[-1], gen, args.density))
    with tempfile.TemporaryDirectory(prefix="engine_ext_phases_") as tmp:
        work = Path(tmp)
        warm_page_cache(work, sd, 2)
        warm_up_publisher(work)
        with DeltaPublisher(str(work / "store"), anchor_every=0) as pub:
            pub.publish(sd)
            pub.wait()
            print(f"{params / 1e9:.2f} B parameters, {os.cpu_count()} cores")
            for i, v in enumerate(versions[1:]):
                SPENT.clear()
                CALLS.clear()
                time.sleep(args.gap)
                os.sync()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                pub.publish(v)
                t1 = time.perf_counter()
                pub.wait()
                t2 = time.perf_counter()
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                print(f"\ndelta {i + 1}: {pub.last_changed} changes; the step waits {t1 - t0:.3f} s, "
                      f"until stored {t2 - t0:.3f} s (background after publish returned {t2 - t1:.3f} s); "
                      f"CPU {r1.ru_utime - r0.ru_utime:.2f} s user, {r1.ru_stime - r0.ru_stime:.2f} s system, "
                      f"{r1.ru_minflt - r0.ru_minflt} page faults")
                for label, s in SPENT.items():
                    print(f"  {label:<45} {s:7.3f} s  ({CALLS[label]} calls)")


if __name__ == "__main__":
    main()
