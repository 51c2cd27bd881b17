"""The costs that grow with the model, end to end on a synthetic bf16 model of ~1 B parameters,
each beside its dense alternative, measured in one run (machines are shared and noisy).

    python bench/scale_bench.py                      # ~1.1 B params (24 layers), 2 rounds, ~6 GB of RAM
    python bench/scale_bench.py --layers 8 --rounds 1  # ~0.4 B, a quick look
    python bench/scale_bench.py --publish-only --rounds 5  # the trainer's rows alone (no ranks)

Steps (one version step = 1 % of the bf16 elements change, as an RL step at lr ~3e-6):

* publish the anchor (the copy the next diff needs, then in the background: fingerprints,
  safetensors shards written and hashed once) vs ``safetensors.torch.save_file`` of the same
  state dict, and vs ``save_file`` + fsync (a store keeps what it wrote: engine_ext fsyncs);
  both write into warm page cache (:func:`warm_page_cache`), the publisher's kernels are
  loaded first (:func:`bench.common.warm_up_publisher`: once per trainer process), and the
  background is timed with no sync in its middle;
* publish a 1 % delta (on the training thread: the diff; in the background: fingerprint
  update, encode, hash, write) vs ``save_file``: the first delta after the anchor, and (the
  median of ``--deltas`` - 1) a delta after a delta, as an RL run publishes all but one in
  ``anchor_every`` (the first delta's working memory is new to the process: on a VM whose
  fresh pages cost ~40 us each, ``bench/delta_phases.py`` shows the difference as page faults);
  both as the time the training step waits for (``publish`` returning) and until published;
* per rank at TP 1 and TP 2 (rows of every matrix split between the ranks): fetch, verify
  and decode the rank's part of the delta from the local store vs ``load_file`` of the
  checkpoint (a dense sync reads it all); apply in place with undo vs copying the rank's
  dense tensors into its parameters (what a reload does after reading); the start-up
  check (layout probe, live fingerprints, checkpoint re-read through the maps) vs
  ``load_file`` of the checkpoint with every byte read (what loading the model reads anyway).

Every delta result is checked against the manifest's fingerprint before its time counts.
Prints a table (medians of ``--rounds``) and writes ``--out`` as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_shape_args, shapes_of, signed_rounds, warm_up_publisher  # noqa: E402


def timed(fn):
    """Seconds ``fn`` takes, from a clean page cache state (dirty pages of the previous step written
    back first: otherwise one step's writes throttle the next one's), and its result."""
    os.sync()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def warm_page_cache(work: Path, sd: dict, copies: int) -> None:
    """Write and delete ``copies`` files of the model, untimed: the first write of fresh memory pays for
    page-cache growth (on this VM, memory freed goes back to the host and is faulted in again at
    ~0.6 GB/s: an anchor written on cold pages took 6.2 s, on pages a deleted file left 2.7 s). Every
    timed step then writes into pages the kernel already holds: the dense file's and the store's alike."""
    from safetensors.torch import save_file

    paths = [work / f"warm{i}.safetensors" for i in range(copies)]
    for path in paths:
        save_file(sd, str(path))
    for path in paths:
        path.unlink()


def untimed_sync(fn) -> float:
    """Seconds ``fn`` takes, with no sync before: the rest of a step already under way (a sync
    in the middle of a background write stalls that write until the sync ends)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rl_step(sd: dict, gen: torch.Generator, frac: float, in_place: bool = False) -> dict:
    """A new version: ``frac`` of each tensor's bf16 elements move by one step of their bits (``in_place``:
    ``sd``'s own tensors move)."""
    out = {}
    for name, t in sd.items():
        bits = t.view(torch.int16).reshape(-1)
        bits = bits if in_place else bits.clone()
        hit = torch.rand(bits.numel(), generator=gen) < frac
        bits[hit] += 1
        out[name] = bits.view(torch.bfloat16).reshape(t.shape)
    return out


class Rank(torch.nn.Module):
    """Rows [r * n / tp, (r + 1) * n / tp) of every matrix, all of every vector (a row-parallel shard)."""

    def __init__(self, sd: dict, r: int, tp: int):
        super().__init__()
        self.r, self.tp = r, tp
        self.names = {}
        for i, (name, t) in enumerate(sd.items()):
            shape = (t.shape[0] // tp, *t.shape[1:]) if t.dim() == 2 else tuple(t.shape)
            attr = f"p{i}"
            self.names[name] = attr
            self.register_parameter(attr, torch.nn.Parameter(torch.zeros(shape, dtype=t.dtype), requires_grad=False))

    def part(self, name: str, t: torch.Tensor) -> torch.Tensor:
        rows = t.shape[0] // self.tp
        return t[self.r * rows:(self.r + 1) * rows] if t.dim() == 2 else t

    def load(self, name: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            getattr(self, self.names[name]).copy_(self.part(name, t))


def run_round(args, work: Path, key: Path) -> dict:
    from safetensors.torch import load_file, save_file

    from engine_ext import DeltaPublisher
    from engine_ext.format.dtypes import BY_TORCH
    from engine_ext.server.rank import RankUpdater
    from engine_ext.store.checkpoint import CheckpointDir

    gen = torch.Generator().manual_seed(0)
    shapes = shapes_of(args)
    sd = {n: (0.02 * torch.randn(s, generator=gen)).to(torch.bfloat16) for n, s in shapes.items()}
    params = sum(t.numel() for t in sd.values())
    nxt = rl_step(sd, gen, args.density)
    out: dict = {"params": params}
    dense = work / "dense.safetensors"
    warm_page_cache(work, sd, 2)
    warm_up_publisher(work, str(key))  # the kernels' first use in a process: once per trainer, not per version
    out["save_file"], _ = timed(lambda: save_file(sd, str(dense)))
    dense.unlink()
    out["save_file_fsync"], _ = timed(lambda: (save_file(sd, str(dense)), fsync_file(dense)))

    def dense_read():  # load_file maps the file: every byte is read (and copied) only when used
        return {k: v.clone() for k, v in load_file(str(dense)).items()}
    store = work / "store"
    pub = DeltaPublisher(str(store), anchor_every=0, signing_key=str(key))
    out["anchor_blocks"], _ = timed(lambda: pub.publish(sd))  # what the training step waits for
    out["publish_anchor"] = out["anchor_blocks"] + untimed_sync(pub.wait)  # ... and until it is in the store
    out["delta_blocks"], uri = timed(lambda: pub.publish(nxt))
    out["publish_delta"] = out["delta_blocks"] + untimed_sync(pub.wait)
    blocks, stored = [], []  # deltas after a delta (the steady state of an RL run), each made in place from the last
    v = {n: t.clone() for n, t in nxt.items()} if args.deltas > 1 else {}  # (a version more held would crowd the anchor)
    for _ in range(args.deltas - 1):
        rl_step(v, gen, args.density, in_place=True)  # publish() has returned: the publisher holds its own copy
        blocks.append(timed(lambda: pub.publish(v))[0])
        stored.append(blocks[-1] + untimed_sync(pub.wait))
    if blocks:
        out["next_delta_blocks"], out["publish_next_delta"] = statistics.median(blocks), statistics.median(stored)
    pub.close()
    v.clear()  # its tensors freed before the ranks load theirs
    if args.publish_only:
        dense.unlink()
        shutil.rmtree(store)
        return out
    ckpt_dir = work / "ckpt"
    ckpt_dir.mkdir()
    shutil.copy(dense, ckpt_dir / "model.safetensors")
    ckpt = CheckpointDir(ckpt_dir)
    specs = {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in sd.items()}
    for tp in (1, 2):
        ranks = [Rank(sd, r, tp) for r in range(tp)]
        for rank in ranks:
            for name, t in sd.items():
                rank.load(name, t)
        ups = [RankUpdater(m, m.load, specs, ckpt.load, rank=m.r) for m in ranks]
        out[f"tp{tp}_startup"] = max(timed(lambda u=u: u.setup())[0] for u in ups)
        out[f"tp{tp}_dense_read"], _ = timed(dense_read)
        fetch, apply, copy = [], [], []
        for u, m in zip(ups, ranks):
            txn = f"t{u.rank}"
            route = [{"key": Path(uri).name, "sha256": _sha(Path(uri)), "max_bytes": 64 << 20}]
            t, _ = timed(lambda: (u.fetch(txn, str(store), route, 600), _join(u, txn)))
            fetch.append(t)
            t, reply = timed(lambda: u.apply(txn=txn))
            apply.append(t)
            u.commit(1)
            want = {e["name"]: e["fingerprint"] for e in json.loads(Path(uri).read_text())["tensors"]}
            got = {n: f"{r.fingerprint:016x}" for n, r in reply.fingerprints.items()}
            if tp == 1:
                assert all(got[n] == want[n] for n in got), "a rank's result differs from the manifest's fingerprint"
            t, _ = timed(lambda: [m.load(n, x) for n, x in nxt.items()])
            copy.append(t)
        out[f"tp{tp}_fetch_decode"], out[f"tp{tp}_apply"], out[f"tp{tp}_dense_copy"] = max(fetch), max(apply), max(copy)
        del ranks, ups
    shutil.rmtree(work / "ckpt")
    dense.unlink()
    shutil.rmtree(store)
    return out


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _join(u, txn: str) -> None:
    u._fetches[txn].thread.join()
    u.fetched(txn)


ROWS = [  # (label, ours, dense alternative)
    ("publish the anchor: the training step waits", "anchor_blocks", "save_file"),
    ("publish the anchor: until it is in the store", "publish_anchor", "save_file"),
    ("publish the anchor: until it is in the store", "publish_anchor", "save_file_fsync"),
    ("publish the first 1 % delta (after the anchor): the training step waits", "delta_blocks", "save_file"),
    ("publish the first 1 % delta (after the anchor): until it is in the store", "publish_delta", "save_file"),
    ("publish a 1 % delta after a delta: the training step waits", "next_delta_blocks", "save_file"),
    ("publish a 1 % delta after a delta: until it is in the store", "publish_next_delta", "save_file"),
    ("TP 1 rank: fetch + verify + decode", "tp1_fetch_decode", "tp1_dense_read"),
    ("TP 1 rank: apply in place (undo, fingerprints)", "tp1_apply", "tp1_dense_copy"),
    ("TP 1 rank: start-up check", "tp1_startup", "tp1_dense_read"),
    ("TP 2 rank: fetch + verify + decode", "tp2_fetch_decode", "tp2_dense_read"),
    ("TP 2 rank: apply in place (undo, fingerprints)", "tp2_apply", "tp2_dense_copy"),
    ("TP 2 rank: start-up check", "tp2_startup", "tp2_dense_read"),
]
DENSE = {"save_file": "`save_file`", "save_file_fsync": "`save_file` + fsync", "tp1_dense_read": "`load_file`, every byte read",
         "tp2_dense_read": "`load_file`, every byte read", "tp1_dense_copy": "copy of the rank's dense tensors",
         "tp2_dense_copy": "copy of the rank's dense tensors"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="scale_bench.json")
    ap.add_argument("--publish-only", action="store_true", help="only the trainer's rows (anchor and delta), no ranks")
    ap.add_argument("--deltas", type=int, default=3,
                    help="deltas published after the anchor: the first, and the median of the others (after a delta)")
    args = ap.parse_args()
    rounds = signed_rounds(args, run_round, "engine_ext_scale_",
                           lambda r: ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "params"))
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"\n{med['params'] / 1e9:.2f} B parameters (bf16, {2 * med['params'] / 1e9:.1f} GB), {os.cpu_count()} cores, "
          f"median of {args.rounds} round(s)\n")
    print("| step | engine_ext s | dense alternative | dense s | ratio | ratio in each round |\n|---|---|---|---|---|---|")
    for label, ours, dense in ROWS:
        if ours not in med:
            continue
        each = ", ".join(f"{r[ours] / r[dense]:.2f}x" for r in rounds)  # side by side: the host's noise hits both alike
        print(f"| {label} | {med[ours]:.2f} | {DENSE[dense]} | {med[dense]:.2f} | {med[ours] / med[dense]:.2f}x | {each} |")
    Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rounds, "median": med}, indent=1))


if __name__ == "__main__":
    main()
