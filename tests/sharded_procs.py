"""Trainer processes for the sharded-publishing tests: real torch.distributed (gloo) ranks, a model
under FSDP2 ``fully_shard`` on the CPU, AdamW steps between versions, a ShardedPublisher per rank.

:func:`run` starts ``world`` processes (spawn) and waits for them; each initialises gloo,
builds the model (a small LLM-shaped module, or a tiny HF checkpoint), shards it, patches
``DTensor.full_tensor`` to raise (the publisher must never gather), trains, and publishes a
version after every step. For the checks, each rank writes what it holds of every version
(its local rows, cast to the served dtype) to ``out/rank{R}.v{V}.pt`` (the test reassembles
the model from these files, not through any collective) and a summary ``out/rank{R}.json``.

Faults (``fault``): ``{"rank": R, "version": V, "kind": "kill"}`` makes rank R SIGKILL itself
when it comes to write its blobs of version V (its cells encoded); ``"raise"`` makes its store
refuse them (an OSError, as a full disk would).
"""
from __future__ import annotations

import json
import math
import os
import resource
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, cfg: dict, timeout: float = 240.0) -> list[int]:
    """Run ``train`` on ``world`` spawned ranks; their exit codes (a rank still alive at the timeout is killed)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(rank, world, port, cfg), daemon=False) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():  # ours: stop it by its PID
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    return [p.exitcode for p in procs]


def _entry(rank: int, world: int, port: int, cfg: dict) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.update(cfg.get("env", {}))
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # ranks share 2 cores: more threads than cores stall the kernels
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.get("timeout_s", 60)))
    out = Path(cfg["out"])
    summary = {"rank": rank, "world": world}
    try:
        train(rank, world, cfg, summary)
    except BaseException as e:  # noqa: BLE001 - recorded for the test
        summary["error"] = f"{type(e).__name__}: {e}"
        summary["traceback"] = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps(summary, indent=1))
    if "error" not in summary:
        dist.destroy_process_group()
    os._exit(0)  # a peer may be gone: leave without waiting on the group


class ToyLayer(torch.nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.input_layernorm = torch.nn.RMSNorm(hidden)
        self.self_attn = torch.nn.Module()
        self.self_attn.q_proj = torch.nn.Linear(hidden, hidden)
        self.self_attn.k_proj = torch.nn.Linear(hidden, 6)
        self.self_attn.o_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.mlp = torch.nn.Module()
        self.mlp.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.mlp.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.mlp.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        h, a, m = self.input_layernorm(x), self.self_attn, self.mlp
        x = x + a.o_proj(torch.tanh(a.q_proj(h)) * a.k_proj(h).mean(-1, keepdim=True))
        return x + m.down_proj(torch.nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))


class ToyLM(torch.nn.Module):
    """An LLM-shaped module with checkpoint-style names: embeddings, attention and MLP projections
    (one of 6 rows: at world 4 the last rank holds none), norms, an untied head."""

    def __init__(self, vocab: int = 1000, hidden: int = 64, inter: int = 160, layers: int = 2):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.model.layers = torch.nn.ModuleList(ToyLayer(hidden, inter) for _ in range(layers))
        self.model.norm = torch.nn.RMSNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def _model(cfg: dict):
    if cfg.get("hf_model"):  # fp32 master weights loaded from the served bf16 checkpoint (exact)
        import transformers

        m = transformers.AutoModelForCausalLM.from_pretrained(cfg["hf_model"], dtype=torch.float32)
        return m, m.config.vocab_size, list(m.model.layers)
    torch.manual_seed(cfg.get("seed", 0))  # the same initial weights on every rank, before sharding
    m = ToyLM()
    return m, 1000, list(m.model.layers)


class FaultyStore:
    """The rank's store, failing on cue while it writes its blobs of one version."""

    def __init__(self, inner, version: int, kind: str):
        self.inner, self.tag, self.kind = inner, f"v{version:08d}.", kind

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def create_file(self, key, path):
        if key.startswith(self.tag):
            if self.kind == "raise":
                raise OSError("no space left on device (injected)")
            os.kill(os.getpid(), signal.SIGKILL)  # mid-part: its cells encoded, its blobs not yet written
        return self.inner.create_file(key, path)


def train(rank: int, world: int, cfg: dict, summary: dict) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate

    from engine_ext.store import open_store
    from engine_ext.trainer.sharded import ShardedPublisher
    from engine_ext.trainer.shards import held_tensors

    def refuse(self, *a, **k):
        raise AssertionError("DTensor.full_tensor() was called: the publisher gathered a tensor")

    DTensor.full_tensor = refuse
    model, vocab, layers = _model(cfg)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    extra = {}
    if cfg.get("replicated"):  # a replicated DTensor and a plain tensor every rank holds: each published by one rank
        mesh = next(p for p in model.parameters()).device_mesh
        extra = {"extra.replicated": DTensor.from_local(torch.arange(5, dtype=torch.float32), mesh, [Replicate()]),
                 "extra.plain": torch.full((3, 2), 7.0)}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 1e-3))
    store = open_store(cfg["store"])
    fault = cfg.get("fault") or {}
    if fault.get("rank") == rank:
        store = FaultyStore(store, fault["version"], fault["kind"])
    out = Path(cfg["out"])
    opts = dict(anchor_every=cfg.get("anchor_every", 0), chunk_min_cell=cfg.get("chunk_min_cell", 256),
                timeout_s=cfg.get("timeout_s", 60))
    send = None
    if cfg.get("via") == "vllm":  # vLLM's trainer-side API: backend engine_ext, source=ShardSource(model)
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from engine_ext.integrations.vllm_transfer import DeltaTrainerInitInfo, ShardSource

        engine = WeightTransferTrainerFactory.trainer_init(
            DeltaTrainerInitInfo(store, rank=rank, model="toy", anchor_every=opts.pop("anchor_every"), publisher=opts),
            client=HTTPVLLMWeightSyncClient(cfg["server"]), source=ShardSource(model, dtype=torch.bfloat16))
        pub, send = engine.publisher, lambda: engine.send_weights()
    elif cfg.get("via") == "trl":  # DeltaGRPOTrainer's sync under FSDP: its generation's sync_weights, TRL's transfer
        from engine_ext.integrations.trl import DeltaWeightTransfer, _delta_generation_class

        transfer = DeltaWeightTransfer(store, [cfg["server"]], token=cfg.get("token"), sharded=True, model="toy", **opts)
        if rank == 0:
            transfer.init_weight_transfer()
        # the real sync_weights of DeltaGRPOTrainer's generation; TRL's constructor (a GRPOTrainer's
        # accelerator and vLLM client) is left out: the sync reads only the transfer and the model
        generation = object.__new__(_delta_generation_class())
        generation.transfer, generation.model = transfer, model

        def send():
            generation.sync_weights()  # would walk TRL's gathering iterator (full_tensor raises) if not sharded
            return transfer.syncs[-1] if rank == 0 else None
        pub = None
    else:
        pub = ShardedPublisher(store, "toy", dtype=torch.bfloat16, **opts)
    summary["versions"], summary["rss_before_kb"] = [], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    summary["held_bytes_bf16"] = sum(math.prod(h.tensor.shape) * 2 for h in held_tensors(model).values())
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch, as data parallelism does
    try:
        for step in range(cfg["steps"] + 1):
            if step:
                ids = torch.randint(0, vocab, (4, 16), generator=g)
                logits = model(ids)
                logits = getattr(logits, "logits", logits)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), ids.roll(-1, 1).reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
            state = {n: p for n, p in model.named_parameters()} | extra
            if send is not None:
                sent = send()
                pub = pub or transfer.publisher
                uri = pub.store.key_uri(f"v{pub.version:08d}")
                if sent is not None:
                    summary.setdefault("sent", []).append(sent.version)  # SyncStats / SendStats
            elif cfg.get("shard_source"):  # vLLM's trainer-side source whose ranks publish their own shards
                from engine_ext.integrations.shard_source import ShardSource

                uri = ShardSource(model, dtype=torch.bfloat16).publish(pub)
            else:  # the module itself: its conversions give the checkpoint layout; a state dict is published as named
                uri = pub.publish(model if cfg.get("publish_module") else state)
            v = pub.version
            torch.save({n: (h.start, h.tensor.detach().to(torch.bfloat16).clone()) for n, h in held_tensors(state).items()},
                       out / f"rank{rank}.v{v}.pt")
            summary["versions"].append(v)
            if cfg.get("wait_each", True):
                pub.wait()
        pub.wait()
    finally:
        summary["uri"] = locals().get("uri")
        pub = pub or (transfer._publisher if cfg.get("via") == "trl" else None)
        if pub is not None:  # (TRL's transfer opens its publisher at the first send)
            summary["aborted"] = {str(k): v for k, v in pub.aborted.items()}
            summary["committed"] = sorted(pub._committed)
            summary["fingerprint"] = None if pub.fingerprint is None else f"{pub.fingerprint:016x}"
            summary["kept_bytes"] = sum(t.numel() * t.element_size() for t in pub._prev.values())
            summary["rss_peak_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            summary["resumed"] = str(pub.resumed) if pub.resumed else None
            if pub._broken is None:
                pub.close()
