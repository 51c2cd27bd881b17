"""The golden store: fixed inputs published once, committed, and checked byte for byte by tests/test_golden.py.

    python tests/golden/make_golden.py        # rewrites tests/golden/store (only when a format change is meant)

Three versions of a small model whose tensors reach every coder the publisher writes: an anchor
(``raw`` values, cut into cells: format 6), a delta of few changes per tensor (``zstd`` and
``pco`` gaps and values, ``all`` positions, an unchanged tensor), and a delta of many changes
(``ctx-rans``, codec v2, with step tables) whose entries and cells sit in tables (format 12: binary
tensor tables behind a name index, the cut q_proj's chunk records in cell sections for 8 TP shares). v1's
entries are inline (format 5); the anchor, in tables too (format 10: its cells are rows, none in sections),
is hashed by pieces. ``store-f8``, ``store-f9`` and ``store-f10`` hold the same inputs as this script wrote
them before format 9 (``ctx`` in format 7's tables), before format 10 (format 7's JSON tables, formats 8 and
9) and before format 12 (its cut matrix named ``a.weight``, which places no shard dimension: format 10),
kept as committed so that readers keep reading them. The signing key is committed with it (a test key, signing nothing
else). The inputs come from a seeded generator; nothing here depends on the clock.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
STORE = HERE / "store"
FORMAT_8 = HERE / "store-f8"  # written before format 9 (format 5's ctx streams); never rewritten
FORMAT_9 = HERE / "store-f9"  # written before format 10 (format 7's JSON tensor tables); never rewritten
FORMAT_10 = HERE / "store-f10"  # written before format 12 (no cell sections: "a.weight"); never rewritten
SECTIONED = "model.layers.0.self_attn.q_proj.weight"  # "a.weight" today: a matrix the engines shard along 0
KEY = HERE / "golden.key"
PUBLISHER = dict(model="golden", anchor_every=0, chunk_min_cell=1024, dtype=None, workers=1)
INLINE_ENTRIES = {0: 4, 1: 4096, 2: 4}  # ENGINE_EXT_INLINE_ENTRIES per version


def states(sectioned: bool = True) -> list[dict[str, torch.Tensor]]:
    """v0, v1, v2: fixed inputs (a seeded generator), in the dtypes they are published in; ``sectioned``:
    ``a.weight`` named :data:`SECTIONED` (the stores written before format 12 name it ``a.weight``)."""
    rng = np.random.default_rng(20261203)
    a = torch.from_numpy(rng.normal(0, 0.02, (96, 128)).astype(np.float32))
    v0 = {"a.weight": a.to(torch.bfloat16),
          "b.weight": torch.from_numpy(rng.normal(0, 1.0, 4096).astype(np.float32)).to(torch.bfloat16),
          "c.bias": torch.from_numpy(rng.normal(0, 0.1, 64).astype(np.float32)),
          "d.weight": torch.from_numpy(rng.normal(0, 0.5, (32, 64)).astype(np.float32)).to(torch.float8_e4m3fn),
          "e.index": torch.arange(16, dtype=torch.int32),
          "f.weight": torch.from_numpy(rng.normal(0, 1.0, 1024).astype(np.float32)).to(torch.bfloat16)}
    v1 = dict(v0)
    few = torch.from_numpy(rng.choice(96 * 128, 40, replace=False))
    flat = v0["a.weight"].float().reshape(-1).clone()
    flat[few] += 0.01
    v1["a.weight"] = flat.reshape(96, 128).to(torch.bfloat16)
    many = torch.from_numpy(rng.choice(4096, 600, replace=False))
    b = v0["b.weight"].float().clone()
    b[many] *= 1.01
    v1["b.weight"] = b.to(torch.bfloat16)
    v1["c.bias"] = v0["c.bias"] + 1e-3  # every element
    f = v0["f.weight"].float().clone()
    f[torch.from_numpy(rng.choice(1024, 5, replace=False))] *= -1.0  # a handful: zstd's gaps and values
    v1["f.weight"] = f.to(torch.bfloat16)
    v2 = dict(v1)
    master = v1["a.weight"].float()
    step = torch.from_numpy(rng.normal(0, 2e-4, (96, 128)).astype(np.float32))
    v2["a.weight"] = (master + step).to(torch.bfloat16)  # an Adam-like step: a share of the bf16 elements moves
    d = v1["d.weight"].float().clone()
    d[::3] *= 1.25
    v2["d.weight"] = d.to(torch.float8_e4m3fn)
    if not sectioned:
        return [v0, v1, v2]
    return [{SECTIONED if n == "a.weight" else n: t for n, t in v.items()} for v in (v0, v1, v2)]


def publish(store: Path, key: Path) -> None:
    """The publisher's writing of :func:`states` into ``store`` (what the test repeats and compares)."""
    from engine_ext import settings
    from engine_ext.trainer.publisher import DeltaPublisher

    # bytes first (v2 wherever it saves 10 %); a manifest of more entries than INLINE_ENTRIES[v] keeps them in
    # tables (format 10; 12 with q_proj's cells in sections; an anchor hashed by pieces is format 8 either way), v1
    # inline (format 5); delta blobs laid out for 8 TP shares (engine_ext/trainer/blob_layout.py: q_proj's cells by
    # share, the other names place no shard dimension: their parts in the common section, in encoding order)
    with DeltaPublisher(str(store), signing_key=str(key), **PUBLISHER) as pub:
        for v, sd in enumerate(states()):
            with settings.override(reader_mbps=0.0, inline_entries=INLINE_ENTRIES[v], reader_tp=8):
                pub.publish(sd, version=v)
                pub.wait()


def main() -> None:
    sys.path.insert(0, str(HERE.parents[1]))
    from engine_ext.store.signing import generate_key

    if not KEY.exists():
        generate_key(KEY)
    shutil.rmtree(STORE, ignore_errors=True)
    publish(STORE, KEY)
    for lock in STORE.glob(".engine-ext-tmp-*"):  # a writer's lock file, not part of the store
        lock.unlink()
    print(f"wrote {STORE}: {sorted(p.name for p in STORE.iterdir())}")


if __name__ == "__main__":
    main()
