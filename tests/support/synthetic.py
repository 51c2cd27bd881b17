"""Synthetic RL steps: fp32 master weights, Adam at an RL learning rate, bf16 casts.

Shaped like a small LLM so that per-tensor densities vary as they do in practice
(norm weights near 1.0 change rarely, projections ~N(0, 0.02) change more).
"""
from __future__ import annotations

import torch


def llm_shapes(hidden: int = 896, layers: int = 4, vocab: int = 32768, inter: int = 4864, kv: int = 128):
    """Parameter shapes of a Qwen2-like decoder (defaults: a 4-layer slice of Qwen2.5-0.5B)."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def add_shape_args(ap) -> None:
    """The model-shape options of the scale benchmarks (defaults: a ~1.1 B Qwen2-like decoder)."""
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--kv", type=int, default=256)


def shapes_of(args) -> dict:
    """:func:`llm_shapes` for the options :func:`add_shape_args` added."""
    return llm_shapes(hidden=args.hidden, layers=args.layers, vocab=args.vocab, inter=args.inter, kv=args.kv)


class AdamRL:
    """fp32 master weights trained by Adam on noisy gradients; ``step()`` returns bf16 weights."""

    def __init__(self, shapes: dict, lr: float = 3e-6, seed: int = 0, noise: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        self.gen, self.lr, self.noise = g, lr, noise
        self.master = {}
        for n, s in shapes.items():
            if n.endswith("norm.weight"):
                w = 1.0 + 0.05 * torch.randn(s, generator=g)
            elif n.endswith(".bias"):
                w = 0.05 * torch.randn(s, generator=g)
            else:
                w = 0.02 * torch.randn(s, generator=g)
            self.master[n] = w
        self.signal = {n: torch.randn(w.shape, generator=g) * 0.3 for n, w in self.master.items()}
        self.m = {n: torch.zeros_like(w) for n, w in self.master.items()}
        self.v = {n: torch.zeros_like(w) for n, w in self.master.items()}
        self.t = 0

    def weights(self) -> dict:
        return {n: w.to(torch.bfloat16) for n, w in self.master.items()}

    def step(self, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> dict:
        self.t += 1
        for n, w in self.master.items():
            grad = self.signal[n] + self.noise * torch.randn(w.shape, generator=self.gen)
            self.m[n].mul_(b1).add_(grad, alpha=1 - b1)
            self.v[n].mul_(b2).addcmul_(grad, grad, value=1 - b2)
            mhat = self.m[n] / (1 - b1**self.t)
            vhat = self.v[n] / (1 - b2**self.t)
            w.sub_(self.lr * mhat / (vhat.sqrt() + eps))
        return self.weights()


def warm_up_publisher(work, signing_key=None) -> None:
    """Publish a small LLM-shaped model (an anchor and a 1 % delta) into ``work``, untimed: the
    first use of each compiled kernel in a process (numba loads it from its disk cache: ~1 s in
    all, under a second per kernel) is paid once per trainer process, not per version, so a
    bench that times one version must not charge it to that version."""
    import shutil
    from pathlib import Path

    from engine_ext.trainer.publisher import DeltaPublisher

    work = Path(work) / "warm-up-store"
    g = torch.Generator().manual_seed(0)
    sd = {n: (0.02 * torch.randn(s, generator=g)).to(torch.bfloat16)
          for n, s in llm_shapes(hidden=256, layers=2, vocab=4096, inter=512, kv=64).items()}
    nxt = {}
    for n, t in sd.items():
        bits = t.view(torch.int16).reshape(-1).clone()
        bits[torch.rand(bits.numel(), generator=g) < 0.01] += 1
        nxt[n] = bits.view(torch.bfloat16).reshape(t.shape)
    with DeltaPublisher(str(work), anchor_every=0, signing_key=signing_key, chunk_min_cell=1 << 16) as pub:
        pub.publish(sd)
        pub.wait()
        pub.publish(nxt)
    shutil.rmtree(work, ignore_errors=True)


def signed_rounds(args, run_round, prefix: str, line) -> list[dict]:
    """``args.rounds`` results of ``run_round(args, work, key)``, each round in a fresh directory, all
    signed with one key made for the run; ``line(result)`` is printed after each round."""
    import tempfile
    from pathlib import Path

    from engine_ext.store.signing import generate_key

    rounds = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        key = Path(tmp) / "k"
        generate_key(key)
        for i in range(args.rounds):
            work = Path(tmp) / f"r{i}"
            work.mkdir()
            rounds.append(run_round(args, work, key))
            print(f"round {i + 1}: {line(rounds[-1])}", flush=True)
    return rounds
