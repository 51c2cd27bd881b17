"""verl with the engine_ext checkpoint engine: what each version costs against verl's own backends.

    python bench/verl_bench.py                  # 52 M-param tied Qwen2 shape, 3 AdamW steps of verl's FSDP2 engine, a vLLM CPU replica, ~3 min
    python bench/verl_bench.py --no-server      # the trainer side only

The actor side is verl 0.9.1's own ``ActorRolloutRefWorker.update_weights`` (tests/verl_actor.py)
on verl's real FSDP2 engine on one rank (tests/verl_fsdp.py: fp32 masters, AdamW steps through its
``train_batch`` on random tokens, at an RL learning rate), handing the backend its gathered
``get_per_tensor_param()``; the sync is
:class:`~engine_ext.integrations.verl.EngineExtCheckpointManager`'s, into a real vLLM CPU server.
Per version it prints the share of bf16 elements that changed and, side by side on the same tensors:

* ``engine_ext``: the bytes the version stored (what a replica one version behind fetches), the
  publish time (verl's update_weights on the actor: gather, cast, diff, encode, sign, write) and the
  apply time (every replica fetched, verified, applied in place);
* ``delta_sharded``: verl's own wire bytes for the same change, from verl's own encoder
  (``delta_sync.sparse_gather.shard_delta_indices`` on each bf16 tensor against the last version,
  assembled into ``delta_sync.DeltaFlush`` as ``_assemble_flush`` does: int32 positions and raw
  values; its first sync is the dense seed, values only), and that encoder's time on this CPU;
* ``nccl``: the dense bf16 model, which verl's ``nccl`` backend broadcasts every version.

The store is a local directory (no network): times are this CPU's, not a link's.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench.common import add_tiny_model_args, signed_run, tiny_model  # noqa: E402


def delta_sharded_wire(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor] | None) -> tuple[int, float]:
    """verl's ``delta_sharded`` wire bytes for ``new`` after ``old`` (None: the seed), and its encode seconds."""
    from verl.checkpoint_engine.delta_sync import DeltaFlush, checksum
    from verl.checkpoint_engine.delta_sync.sparse_gather import shard_delta_indices

    t = time.perf_counter()
    if old is None:  # _send_full_seed: every tensor's values, no positions
        return sum(v.numel() * v.element_size() for v in new.values()), time.perf_counter() - t
    idx, vals = [], []
    for name, v in new.items():
        i, x = shard_delta_indices(v.reshape(-1), old[name].reshape(-1), 0)
        idx.append(i.to(torch.int32))
        vals.append(x)
    positions = torch.cat(idx).contiguous().view(torch.uint8)
    values = torch.cat(vals)
    flush = DeltaFlush(encoding="indices", params=[], positions_cpu=positions, values_gpu=values,
                       checksum=checksum(positions, values))
    return flush.wire_bytes, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tiny_model_args(ap)
    ap.add_argument("--no-server", action="store_true", help="publish only; no replica")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args()

    import ray

    from verl_actor import Replica, VerlActor, manager_for, verl_config

    run = signed_run(args.workdir, "engine_ext_verl_bench_")
    os.environ["ENGINE_EXT_TOKEN"] = secrets.token_hex(16)
    work = run.work
    store = run.store
    model_dir = tiny_model(args, work, "qwen2-tied")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {**{k: v for k, v in os.environ.items() if k.startswith("ENGINE_EXT_")},
                                       "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}})
    actor = ray.remote(VerlActor).remote(str(model_dir), {"store": str(store), "anchor_every": 0}, lr=args.lr)
    server = None
    if not args.no_server:
        from engine_ext.engines.vllm.launcher import VllmServer

        server = VllmServer(model_dir, sources=str(store), log=work / "server.log", startup_s=900)
    rows, old = [], None
    try:
        replicas = [Replica(0, server.url)] if server else []
        manager = manager_for(verl_config(str(store), abort_requests=False), actor, replicas)
        for step in range(args.steps + 1):
            if step:
                ray.get(actor.train_step.remote())
            if server:
                m = manager.update_weights(step)
            else:  # the actor's half only: verl's update_weights on the actor
                m = ray.get(actor.update_weights.remote(global_steps=step, mode="engine_ext"))
                m = {k: v for k, v in m.items() if isinstance(v, (int, float))}
            served = ray.get(actor.served.remote())
            wire, encode_s = delta_sharded_wire(served, old)
            old = served
            rows.append({"version": step, "changed": m["engine_ext/changed_share"] if step else 1.0,
                         "stored_bytes": m["engine_ext/stored_bytes"], "fetched_bytes": m.get("engine_ext/fetched_bytes"),
                         "publish_s": m["engine_ext/publish_s"], "apply_s": m.get("engine_ext/apply_s"),
                         "pause_ms": m.get("engine_ext/pause_ms"), "delta_sharded_bytes": wire,
                         "delta_sharded_encode_s": encode_s, "nccl_bytes": m["engine_ext/dense_bytes"]})
    finally:
        if server:
            server.stop()
        ray.shutdown()

    params = rows[0]["nccl_bytes"] // 2
    print(f"model: {params / 1e6:.1f} M params in bf16 (tied Qwen2, hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}), AdamW lr {args.lr:g} on fp32 masters, {'a vLLM CPU replica' if server else 'no replica'}")
    print(f"{'version':>7} {'changed':>8} {'engine_ext MiB':>14} {'delta_sharded MiB':>17} {'nccl MiB':>9} "
          f"{'vs delta_sharded':>16} {'vs nccl':>8} {'publish s':>9} {'apply s':>8} {'d_s encode s':>12}")
    for r in rows:
        print(f"{r['version']:>7} {r['changed']:>8.2%} {r['stored_bytes'] / 2**20:>14.3f} {r['delta_sharded_bytes'] / 2**20:>17.3f} "
              f"{r['nccl_bytes'] / 2**20:>9.1f} {r['delta_sharded_bytes'] / max(r['stored_bytes'], 1):>15.1f}x "
              f"{r['nccl_bytes'] / max(r['stored_bytes'], 1):>7.1f}x {r['publish_s']:>9.3f} "
              f"{(r['apply_s'] or 0):>8.3f} {r['delta_sharded_encode_s']:>12.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"params": params, "lr": args.lr, "versions": rows}, indent=1))


if __name__ == "__main__":
    main()
