"""A trainer written against vLLM's weight-transfer API; engine_ext is one backend name away.

    python examples/vllm_native_transfer.py              # a dev-mode vLLM CPU server, 4 AdamW steps
    python examples/vllm_native_transfer.py --offline    # vllm.LLM in this process instead

:func:`train` is what a trainer on vLLM's API looks like: ``WeightTransferTrainerFactory.trainer_init``
with a ``ModuleSource`` and a ``VLLMWeightSyncClient``, then ``send_weights()`` after every
optimizer step. On vLLM's dense path it names ``nccl`` (the whole model over NCCL every
version, CUDA only, trainer and servers in one NCCL world); here it names ``engine_ext``: each
version is published to a store as a signed delta, and the servers fetch only the changed
elements, verify them and apply them in place. The server side is vLLM's own:

    ENGINE_EXT_SOURCES=STORE ENGINE_EXT_TRUSTED_KEYS=publisher.key.pub VLLM_SERVER_DEV_MODE=1 VLLM_PLUGINS=engine_ext \\
        vllm serve MODEL --weight-transfer-config '{"backend": "engine_ext"}'

(CPU build: ``python -m vllm.entrypoints.openai.api_server --model MODEL ...``.) What the
example sets up around it: a tiny random Qwen2 (bf16 checkpoint; the trainer keeps fp32
masters), a signing key, a local store, and the server (or the ``LLM``). It prints one line
per version (what crossed the network against the dense bytes ``nccl`` would broadcast, and
the times) and checks that the server serves the trainer's weights, bit for bit.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
from pathlib import Path

import torch

BACKEND = "engine_ext"  # a trainer on vLLM's dense path says "nccl" here: that is the change


def init_info(backend: str, rank: int, store: str):
    """The backend's trainer init info (each backend has its own fields; ``rank`` is vLLM's)."""
    if backend == "nccl":  # vLLM's dense path: the trainer opens a NCCL group with the workers
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29500, world_size=2, rank=rank)
    from engine_ext.integrations.vllm_transfer import DeltaTrainerInitInfo  # importing it registers the backend

    return DeltaTrainerInitInfo(store, rank=rank)  # signed with ENGINE_EXT_SIGNING_KEY


def train(model: torch.nn.Module, client, store: str, steps: int, lr: float, rank: int = 0,
          backend: str = BACKEND) -> list:
    """AdamW on a language-modelling loss; the weights go to the servers after every step. Every
    trainer rank runs this (rank 0 sends). Returns what each version cost (engine_ext's figures)."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    engine = WeightTransferTrainerFactory.trainer_init(init_info(backend, rank, store), client=client,
                                                       source=ModuleSource(model))
    sent = [engine.send_weights()]  # the servers loaded the same checkpoint: adopted, nothing fetched
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    for _ in range(steps):
        batch = torch.randint(0, vocab, (4, 32), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        sent.append(engine.send_weights())
    engine.shutdown()
    return sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="vllm_native_out")
    ap.add_argument("--offline", action="store_true", help="vllm.LLM in this process instead of a server")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()

    import transformers

    from engine_ext.store.signing import generate_key
    from engine_ext.tiny_models import make_model

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model_dir = make_model(out / "model", "qwen2", hidden=args.hidden, layers=args.layers, vocab=args.vocab)
    generate_key(out / "publisher.key")
    store = str(out / "store")
    os.environ.update(ENGINE_EXT_SIGNING_KEY=str(out / "publisher.key"), ENGINE_EXT_TRUSTED_KEYS=str(out / "publisher.key.pub"),
                      ENGINE_EXT_SOURCES=store, VLLM_PLUGINS="engine_ext", VLLM_CPU_KVCACHE_SPACE="1",
                      ENGINE_EXT_TOKEN=secrets.token_hex(16))  # guards /update_weights_delta (its status, here)
    if args.tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(args.tp))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    if args.offline:
        from vllm import LLM

        llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True, tensor_parallel_size=args.tp,
                  weight_transfer_config={"backend": BACKEND})
        sent = train(model, llm, store, args.steps, args.lr)
        served = llm.collective_rpc("engine_ext", args=("status",))[0]
        print(f"LLM serves v{served['version']} (weight version {llm.get_weight_version()!r})")
    else:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        from engine_ext.engines.vllm.launcher import VllmServer

        print("starting a vLLM CPU server in dev mode with the engine_ext backend (about a minute)...", flush=True)
        with VllmServer(model_dir, sources=store, tp=args.tp, log=out / "server.log",
                        env={"VLLM_SERVER_DEV_MODE": "1"},
                        args=["--weight-transfer-config", json.dumps({"backend": BACKEND})]) as server:
            sent = train(model, HTTPVLLMWeightSyncClient(server.url), store, args.steps, args.lr)
            status = server.status()
        from engine_ext.format import fingerprint as fpr

        want = fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(p.detach().to(torch.bfloat16))
                                              for n, p in model.named_parameters()}))
        assert status["fingerprint"] == want, (status["fingerprint"], want)
        print(f"server serves v{status['version']} (weight version {status['weight_version']!r}), "
              f"the trainer's weights in bf16 bit for bit (fingerprint {want})")
    print(f"{'version':>7} {'kind':>6} {'changed':>8} {'store B':>10} {'nccl B':>10} {'ratio':>7} {'publish s':>9} {'update s':>8}")
    for s in sent:
        print(f"{s.version:>7} {s.kind:>6} {s.changed:>8.2%} {s.payload_bytes:>10} {s.dense_bytes:>10} "
              f"{s.dense_bytes / max(s.payload_bytes, 1):>6.1f}x {s.publish_s:>9.3f} {s.update_s:>8.3f}")
    (out / "sent.json").write_text(json.dumps([dataclasses.asdict(s) for s in sent], indent=1))


if __name__ == "__main__":
    main()
