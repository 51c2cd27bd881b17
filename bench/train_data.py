"""Weight versions from real training: a small Qwen2 trained with AdamW on real text.

    python bench/train_data.py [--lr 1e-6 3e-6] [--steps 8] [--settle 20] [--warmup 200]

Why: the synthetic steps of tests/support/synthetic.py move every element of a tensor by draws
from one distribution. Real training does not: gradients differ per tensor and per row,
embedding rows of tokens absent from a batch get no gradient, Adam's second moments are
shaped by a real loss, and (what fp8 quantisation depends on) a tile's maximum is one
particular element that moves only when that element does. This module produces such
versions offline: a Qwen2-shaped model (transformers) trained with ``torch.optim.AdamW``
on fp32 master weights, on the Python standard library's own source files.

Schedule: ``warmup`` steps at ``warmup_lr`` (a pre-trained starting point; Adam's moments
and bias correction settle), then, with the same optimizer, ``settle`` steps at an
RL-like ``lr`` that are not versions, then ``steps`` more. The settle steps matter:
after the learning-rate drop the model stops moving, consecutive gradients agree, and
Adam's first moment grows over ~1/(1 - beta1) = 10 steps; measured on the defaults, the
bf16 density per step rises from 1.4 % to a plateau of ~2.3 % (lr 3e-6) after about 20
steps. Version 0 is the model after the settle steps; version i, i steps later. Tokens: the
``vocab - 256`` most frequent aligned byte pairs get their own id, every other pair is
two byte ids (a one-merge byte-pair vocabulary: Zipf-like token counts, no download).

Deterministic given the parameters (one torch thread; each step's batch comes from its
own seeded generator). Results are cached under ``~/.cache/engine_ext/train_data/`` as
safetensors files keyed by every parameter: the warm-up state (weights + Adam moments,
shared by all lrs) and each run's fp32 masters.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

CACHE = Path.home() / ".cache" / "engine_ext" / "train_data"
FORMAT = 1  # bump when the recipe changes, so old cache entries are not reused


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything a run depends on (the cache key)."""
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 4096
    batch: int = 8
    seq: int = 128
    warmup: int = 200
    warmup_lr: float = 1e-3
    seed: int = 0
    weight_decay: float = 0.0
    data_bytes: int = 4 << 20

    def key(self, **extra) -> str:
        d = dataclasses.asdict(self) | extra | {"format": FORMAT, "python": sys.version.split()[0],
                                                "torch": torch.__version__.split("+")[0]}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def stdlib_bytes(max_bytes: int) -> np.ndarray:
    """The first ``max_bytes`` of the standard library's ``*.py`` files (sorted paths, site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "dist-packages" in p.parts:
            continue
        try:
            b = p.read_bytes()
        except OSError:
            continue
        out.append(b)
        n += len(b)
        if n >= max_bytes:
            break
    return np.frombuffer(b"\n".join(out)[:max_bytes], dtype=np.uint8)


def pair_tokenize(data: np.ndarray, vocab: int) -> np.ndarray:
    """Token ids: each aligned byte pair among the ``vocab - 256`` most frequent is one id
    (256 + rank), every other pair is its two byte ids."""
    data = data[: len(data) // 2 * 2].astype(np.int64)
    pairs = data[0::2] * 256 + data[1::2]
    counts = np.bincount(pairs, minlength=65536)
    top = np.argsort(-counts, kind="stable")[: vocab - 256]
    pair_id = np.full(65536, -1, dtype=np.int64)
    pair_id[top] = 256 + np.arange(len(top))
    ids = pair_id[pairs]
    two = np.stack([np.where(ids >= 0, ids, data[0::2]), np.where(ids >= 0, -1, data[1::2])], axis=1).reshape(-1)
    return two[two >= 0]


def build_model(spec: Spec) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(spec.seed)
    cfg = Qwen2Config(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate,
                      vocab_size=spec.vocab, max_position_embeddings=spec.seq, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).float()


def batch(tokens: torch.Tensor, spec: Spec, step: int) -> torch.Tensor:
    """The ``step``-th batch of random windows (its own generator: the same wherever training resumes)."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
    start = torch.randint(0, len(tokens) - spec.seq, (spec.batch,), generator=g)
    return tokens[start[:, None] + torch.arange(spec.seq)]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, spec: Spec,
          first_step: int, n: int, after_step=None) -> float:
    """``n`` AdamW steps (global step numbers from ``first_step``); returns the last loss."""
    loss = float("nan")
    for step in range(first_step, first_step + n):
        x = batch(tokens, spec, step)
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        loss = out.loss.item()
        if after_step is not None:
            after_step(step)
    return loss


def masters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def warm_state(spec: Spec, tokens: torch.Tensor, log=print) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """The model and AdamW after the warm-up, from the cache or trained (then cached)."""
    model = build_model(spec)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=spec.warmup_lr, weight_decay=spec.weight_decay)
    path = CACHE / f"warmup-{spec.key()}.safetensors"
    if path.exists():
        saved = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            step = float(f.metadata()["step"])
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[f"model/{n}"])
        for n, p in params.items():
            opt.state[p] = {"step": torch.tensor(step), "exp_avg": saved[f"exp_avg/{n}"],
                            "exp_avg_sq": saved[f"exp_avg_sq/{n}"]}
        log(f"warm-up: cached {path}")
        return model, opt
    t0 = time.perf_counter()
    every = max(1, spec.warmup // 5)

    def progress(step: int) -> None:
        if (step + 1) % every == 0:
            log(f"  warm-up step {step + 1}/{spec.warmup} ({time.perf_counter() - t0:.0f} s)")

    last = train(model, opt, tokens, spec, 0, spec.warmup, progress)
    log(f"warm-up: {spec.warmup} steps at lr {spec.warmup_lr:g} in {time.perf_counter() - t0:.1f} s, loss {last:.3f}")
    tensors = {f"model/{n}": p.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        tensors[f"exp_avg/{n}"] = opt.state[p]["exp_avg"]
        tensors[f"exp_avg_sq/{n}"] = opt.state[p]["exp_avg_sq"]
    _atomic_save(tensors, path, {"step": str(int(opt.state[params[next(iter(params))]]["step"]))})
    return model, opt


def tokens_of(spec: Spec) -> torch.Tensor:
    return torch.from_numpy(pair_tokenize(stdlib_bytes(spec.data_bytes), spec.vocab))


def versions(lr: float, steps: int, *, warmup: int = Spec.warmup, settle: int = 20, seed: int = 0,
             weight_decay: float = 0.0, masters: bool = False, log=print, **sizes) -> list[dict[str, torch.Tensor]]:
    """``steps + 1`` consecutive versions (the base after ``warmup`` steps at ``warmup_lr`` and
    ``settle`` at ``lr``, then one per AdamW step at ``lr``).

    Each is ``{name: tensor}`` with the names of ``model.state_dict()``: the bf16 cast of
    the fp32 master weights, or (``masters=True``) the fp32 masters themselves.
    ``sizes``: other :class:`Spec` fields (hidden, layers, heads, kv_heads, intermediate,
    vocab, batch, seq, warmup_lr, data_bytes).
    """
    spec = Spec(warmup=warmup, seed=seed, weight_decay=weight_decay, **sizes)
    path = CACHE / f"run-{spec.key(lr=lr, settle=settle, steps=steps)}.safetensors"
    if path.exists():
        with safe_open(str(path), "pt") as f:
            names = json.loads(f.metadata()["names"])  # state_dict order
            out = [{n: f.get_tensor(f"{i}/{n}") for n in names} for i in range(steps + 1)]
        log(f"lr {lr:g}: cached {path}")
    else:
        tokens = tokens_of(spec)
        model, opt = warm_state(spec, tokens, log)
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.perf_counter()
        train(model, opt, tokens, spec, spec.warmup, settle)
        out = [masters_of(model)]
        train(model, opt, tokens, spec, spec.warmup + settle, steps, lambda s: out.append(masters_of(model)))
        log(f"lr {lr:g}: {settle} + {steps} steps in {time.perf_counter() - t0:.1f} s")
        _atomic_save({f"{i}/{n}": t for i, v in enumerate(out) for n, t in v.items()}, path,
                     {"names": json.dumps(list(out[0])),
                      "spec": json.dumps(dataclasses.asdict(spec) | {"lr": lr, "settle": settle})})
    return out if masters else [{n: t.to(torch.bfloat16) for n, t in v.items()} for v in out]


def changed_fraction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Fraction of elements whose bits differ between two state dicts of the same layout."""
    changed = sum(int((x.view(torch.int16) != b[n].view(torch.int16)).sum()) if x.element_size() == 2
                  else int((x != b[n]).sum()) for n, x in a.items())
    return changed / sum(x.numel() for x in a.values())


def size_args(p: argparse.ArgumentParser) -> None:
    """The Spec options: the model's size and its training data (part of :func:`run_args`)."""
    d = Spec()
    for f in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "batch", "seq", "warmup", "data_bytes"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f))
    p.add_argument("--warmup-lr", type=float, default=d.warmup_lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed)


def run_args(p: argparse.ArgumentParser) -> None:
    """The options of a run over real training (shared with bench/fp8_bench.py): the learning rates, the
    versions per rate, the settling steps before version 0, and the model's size (:func:`size_args`)."""
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--settle", type=int, default=20, help="steps at --lr before version 0")
    size_args(p)


def spec_kwargs(a: argparse.Namespace) -> dict:
    return {f.name: getattr(a, f.name) for f in dataclasses.fields(Spec)}


def main() -> None:
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    run_args(p)
    a = p.parse_args()
    print("command: python bench/train_data.py " + " ".join(sys.argv[1:]))
    kw = spec_kwargs(a)
    t0 = time.perf_counter()
    for lr in a.lr:
        vs = versions(lr, a.steps, settle=a.settle, **kw)
        if lr == a.lr[0]:
            print(f"model: {sum(t.numel() for t in vs[0].values()) / 1e6:.2f} M parameters, {len(vs[0])} tensors")
        fr = [changed_fraction(x, y) for x, y in itertools.pairwise(vs)]
        print(f"lr {lr:g}: bf16 elements changed per step: " + " ".join(f"{100 * f:.2f}%" for f in fr)
              + f" (mean {100 * sum(fr) / len(fr):.2f}%)")
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
