"""Synthetic RL steps: fp32 master weights, Adam at an RL learning rate, bf16 casts.

Shaped like a small LLM so that per-tensor densities vary as they do in practice
(norm weights near 1.0 change rarely, projections ~N(0, 0.02) change more).

Test support, used by the tests (publishing, the CLI, reliability) and by the benchmarks alike: a test never
imports a benchmark, and the benchmarks' own helpers (model-size options, warm-ups) are in bench/common.py.
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
