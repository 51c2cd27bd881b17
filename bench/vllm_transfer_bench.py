"""vLLM's weight-transfer API with the engine_ext backend: what each version costs against the dense path.

    python bench/vllm_transfer_bench.py                 # 69.2 M-param Qwen2 shape, 3 AdamW steps, TP 1, ~3-5 min
    python bench/vllm_transfer_bench.py --tp 2

Runs examples/vllm_native_transfer.py's trainer (AdamW at an RL learning rate on fp32 masters,
``WeightTransferTrainerFactory.trainer_init`` with ``DeltaTrainerInitInfo``, vLLM's
``HTTPVLLMWeightSyncClient``) against a dev-mode vLLM CPU server with the engine_ext backend,
on one machine, and prints per version: the share of bf16 elements that changed, the bytes the
version stored (what a server one version behind fetches, all ranks together), the bytes vLLM's
``nccl`` backend broadcasts for every version (the whole model in bf16), the trainer's publish
time (iterate, cast, diff, encode, sign, write) and update time (start, update: the server
plans, every rank fetches, verifies, applies; finish), the server's pause, and, as a dense
reference on the same disk, ``safetensors`` save + load of the bf16 model (the load from the
page cache: the file was just written). The store is a local directory: no network, so the
times are the CPU's, not a link's.
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
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from bench.common import add_tiny_model_args, signed_run, tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tiny_model_args(ap)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args()

    import transformers
    from safetensors.torch import load_file, save_file
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from engine_ext.engines.vllm.launcher import VllmServer
    from vllm_native_transfer import BACKEND, train

    run = signed_run(args.workdir, "engine_ext_transfer_bench_")
    os.environ["ENGINE_EXT_TOKEN"] = secrets.token_hex(16)  # the status route's token
    work = run.work
    store = run.store
    model_dir = tiny_model(args, work)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())

    served = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
    t = time.perf_counter()
    save_file(served, str(work / "dense.safetensors"))
    t_save = time.perf_counter() - t
    t = time.perf_counter()
    loaded = {n: w.clone() for n, w in load_file(str(work / "dense.safetensors")).items()}  # read, not just mapped
    t_load = time.perf_counter() - t
    del loaded

    with VllmServer(model_dir, sources=str(store), tp=args.tp, log=work / "server.log", env={"VLLM_SERVER_DEV_MODE": "1"},
                    args=["--weight-transfer-config", json.dumps({"backend": BACKEND})], startup_s=900) as server:
        sent = train(model, HTTPVLLMWeightSyncClient(server.url, timeout=900), str(store), args.steps, args.lr)
        history = {h["version"]: h for h in server.status()["history"] if h.get("ok") and "version" in h}

    rows = []
    for s in sent:
        h = history.get(s.version, {})
        rows.append({**s.__dict__, "adopted": bool(h.get("noop")), "pause_ms": h.get("pause_ms"),
                     "ratio": s.dense_bytes / max(s.payload_bytes, 1)})
    print(f"model: {params / 1e6:.1f} M params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
          f"TP {args.tp}, AdamW lr {args.lr:g}; dense bf16 {rows[0]['dense_bytes'] / 2**20:.1f} MiB; "
          f"safetensors save {t_save:.3f} s + load {t_load:.3f} s")
    print(f"{'version':>7} {'kind':>6} {'changed':>8} {'stored MiB':>10} {'nccl MiB':>9} {'ratio':>7} "
          f"{'publish s':>9} {'update s':>8} {'pause ms':>8}")
    for r in rows:
        stored = "adopted" if r["adopted"] else f"{r['payload_bytes'] / 2**20:.3f}"
        print(f"{r['version']:>7} {r['kind']:>6} {r['changed']:>8.2%} {stored:>10} {r['dense_bytes'] / 2**20:>9.1f} "
              f"{r['ratio']:>6.1f}x {r['publish_s']:>9.3f} {r['update_s']:>8.3f} {r['pause_ms'] or 0:>8.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"params": params, "tp": args.tp, "lr": args.lr, "safetensors_save_s": t_save,
                                              "safetensors_load_s": t_load, "versions": rows}, indent=1))


if __name__ == "__main__":
    main()
