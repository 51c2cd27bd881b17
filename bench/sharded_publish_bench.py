"""Sharded publishing at model scale: time and peak memory per trainer rank at world 1, 2 and 4,
each rank beside ``save_file`` of its own shard, measured in one run.

    python bench/sharded_publish_bench.py                       # ~1.1 B bf16 params, worlds 1, 2, 4 (~10 GB RAM)
    python bench/sharded_publish_bench.py --layers 8 --worlds 1,2 # a quick look

Each world is a set of real gloo ranks (spawned processes). Every rank holds rows
``[r * n / W, ...)`` of every tensor as a ``DTensor`` ``Shard(0)`` (FSDP2's layout; what
``fully_shard`` gives, without a model to train), and publishes through its own
``ShardedPublisher``. All ranks start each step together (a barrier), so a step's time is
that of the slowest rank, and ``save_file`` of each rank's shard runs side by side the same
way (the dense alternative: every rank saving its own shard). Steps:

* anchor: ``publish`` returning (the copy of the rank's rows that the next diff needs), and
  until it is in the store (every rank's safetensors slice written, hashed, fsynced; rank 0's
  manifest and LATEST), against ``save_file`` of the rank's shard (+ fsync);
* a 1 % delta (1 % of the bf16 elements move by one step of their bits): ``publish``
  returning (the diff) and until it is in the store (encode, write, commit);
* peak memory: the rank's peak RSS over the run minus its RSS with its shard and the next
  version's shard in memory (what the publisher adds: the kept rows, and the encoder's
  working set), and the kept bits alone.

Each rank loads the publisher's kernels first (``warm_up_publisher``: once per trainer
process, not per version). Every committed version is read back (manifest fingerprint against the model the ranks
held) before its time counts. On a machine with fewer cores than ranks the ranks share
cores (each rank's torch and numba threads are its share, at least one): times then grow
with the world; memory per rank is what the world divides.
Prints a table and writes ``--out`` (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_shape_args, shapes_of, warm_up_publisher  # noqa: E402


def rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def fsync_file(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_main(rank: int, world: int, port: int, args, work: str, key: str, q) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from engine_ext.format import fingerprint as fpr
    from engine_ext.trainer.sharded import ShardedPublisher

    import numba

    cores = max(1, (os.cpu_count() or 1) // world)  # each rank its share of the cores, as on a real trainer
    torch.set_num_threads(cores)
    numba.set_num_threads(cores)  # more threads than cores: numba's parallel kernels (the diff) stall each other
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    shapes = shapes_of(args)
    local, nxt, partial_fps = {}, {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        n0 = shape[0]
        per = -(-n0 // world)  # FSDP2's rows per rank (the last ones may hold fewer, or none)
        a, b = min(n0, rank * per), min(n0, (rank + 1) * per)
        g = torch.Generator().manual_seed(i * 1000 + rank)
        t = (0.02 * torch.randn((b - a, *shape[1:]), generator=g)).to(torch.bfloat16)
        bits = t.view(torch.int16).reshape(-1).clone()
        bits[torch.rand(bits.numel(), generator=g) < args.density] += 1
        stride = tuple(int(torch.Size(shape[d + 1:]).numel()) for d in range(len(shape)))
        local[name] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
        nxt[name] = DTensor.from_local(bits.view(torch.bfloat16).reshape(t.shape), mesh, [Shard(0)], run_check=False,
                                       shape=torch.Size(shape), stride=stride)
        row = int(torch.Size(shape[1:]).numel())
        partial_fps[name] = fpr.range_fingerprint(bits.view(torch.int16), a * row)
    shard_bytes = sum(d.to_local().numel() * 2 for d in local.values())
    out = {"rank": rank, "world": world, "shard_gb": shard_bytes / 1e9}
    mine = Path(work) / f"rank{rank}"
    mine.mkdir(parents=True)

    def step(fn):
        dist.barrier()
        os.sync()
        dist.barrier()
        t = time.perf_counter()
        r = fn()
        return time.perf_counter() - t, r

    plain = {n: d.to_local() for n, d in local.items()}
    save_file(plain, str(mine / "warm.safetensors"))  # the first write of a run pays for page-cache growth
    (mine / "warm.safetensors").unlink()
    out["save_file"], _ = step(lambda: save_file(plain, str(mine / "a.safetensors")))
    (mine / "a.safetensors").unlink()
    out["save_file_fsync"], _ = step(lambda: (save_file(plain, str(mine / "a.safetensors")), fsync_file(mine / "a.safetensors")))
    (mine / "a.safetensors").unlink()
    del plain
    warm_up_publisher(mine, key)  # the kernels' first use in this process: once per trainer rank, not per version
    base_rss = rss_kb()
    pub = ShardedPublisher(str(Path(work) / "store"), "bench", anchor_every=0, signing_key=key, timeout_s=3600)
    out["anchor_blocks"], _ = step(lambda: pub.publish(local))
    out["anchor_stored"] = out["anchor_blocks"] + step(pub.wait)[0]
    out["delta_blocks"], _ = step(lambda: pub.publish(nxt))
    out["delta_stored"] = out["delta_blocks"] + step(pub.wait)[0]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["peak_overhead_gb"] = max(0, peak - base_rss) * 1024 / 1e9
    out["peak_rss_gb"] = peak * 1024 / 1e9
    out["kept_gb"] = sum(t.numel() * t.element_size() for t in pub._prev.values()) / 1e9
    out["aborted"] = dict(pub.aborted)
    fps = [None] * world
    dist.all_gather_object(fps, partial_fps)
    want = fpr.model_fingerprint({n: sum(f[n] for f in fps) & fpr.MASK64 for n in partial_fps})
    assert pub.fingerprint == want, "the committed version's fingerprint differs from the ranks' weights"
    pub.close()
    q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, args, key: str) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix=f"engine_ext_sharded_w{world}_", dir=args.dir)
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, work, key, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    shutil.rmtree(work, ignore_errors=True)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--dir", default=None, help="where the stores go (default: the temp directory)")
    ap.add_argument("--out", default="sharded_publish_bench.json")
    args = ap.parse_args()
    from engine_ext.store.signing import generate_key

    params = sum(int(torch.Size(s).numel()) for s in shapes_of(args).values())
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        key = str(Path(tmp) / "k")
        generate_key(key)
        for w in (int(x) for x in args.worlds.split(",")):
            rows[w] = run_world(w, args, key)
            print(f"world {w}: " + json.dumps(rows[w]), flush=True)
    print(f"\n{params / 1e9:.2f} B parameters (bf16, {2 * params / 1e9:.1f} GB), {os.cpu_count()} cores; "
          "per rank: the slowest rank's time, the largest rank's memory\n")
    print("| world | shard GB | `save_file` s | + fsync s | anchor: step waits s | anchor: stored s | stored / save_file+fsync "
          "| 1 % delta: step waits s | 1 % delta: stored s | stored / save_file | kept GB | peak RSS added GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w, rs in rows.items():
        m = {k: max(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
        print(f"| {w} | {m['shard_gb']:.2f} | {m['save_file']:.2f} | {m['save_file_fsync']:.2f} | {m['anchor_blocks']:.2f} | "
              f"{m['anchor_stored']:.2f} | {m['anchor_stored'] / m['save_file_fsync']:.2f}x | {m['delta_blocks']:.2f} | "
              f"{m['delta_stored']:.2f} | {m['delta_stored'] / m['save_file']:.2f}x | {m['kept_gb']:.2f} | "
              f"{m['peak_overhead_gb']:.2f} |")
    Path(args.out).write_text(json.dumps({"args": vars(args), "params": params, "worlds": rows}, indent=1))


if __name__ == "__main__":
    main()
