"""What several benchmarks do the same way, in one place: the model-size options, a signed run's work
directory, versions published by sign steps, the publisher's warm-up and rounds in fresh directories.

Only helpers that measure nothing themselves live here: each benchmark keeps its own timing and table.
The synthetic training data (``llm_shapes``, ``AdamRL``) is test support (tests/support/synthetic.py),
shared with the tests; this module reaches it the way a benchmark does, with ``tests/`` on the path.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # support.synthetic (tests/support)

from engine_ext.store.signing import generate_key  # noqa: E402
from engine_ext.tiny_models import load_state_dict, make_model  # noqa: E402
from engine_ext.trainer.publisher import DeltaPublisher  # noqa: E402
from support.synthetic import llm_shapes  # noqa: E402


# ----------------------------------------------------------------------------- the scale benchmarks (1 B shapes)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The model-shape options of the scale benchmarks (defaults: a ~1.1 B Qwen2-like decoder)."""
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--kv", type=int, default=256)


def shapes_of(args: argparse.Namespace) -> dict:
    """:func:`llm_shapes` for the options :func:`add_shape_args` added."""
    return llm_shapes(hidden=args.hidden, layers=args.layers, vocab=args.vocab, inter=args.inter, kv=args.kv)


def warm_up_publisher(work, signing_key=None) -> None:
    """Publish a small LLM-shaped model (an anchor and a 1 % delta) into ``work``, untimed: the
    first use of each compiled kernel in a process (numba loads it from its disk cache: ~1 s in
    all, under a second per kernel) is paid once per trainer process, not per version, so a
    bench that times one version must not charge it to that version."""
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


# ----------------------------------------------------------------------------- the served benchmarks (a tiny model)


def add_tiny_model_args(ap: argparse.ArgumentParser) -> None:
    """The options of the benchmarks that serve a tiny random Qwen2 and publish ``--steps`` versions at ``--lr``."""
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-6)


@dataclass(frozen=True)
class SignedRun:
    """A benchmark's work directory: the key it signs with and the local store it publishes to."""

    work: Path
    key: Path
    store: Path


def signed_run(workdir: str | None, prefix: str) -> SignedRun:
    """``workdir`` (or a fresh temporary directory) with a signing key, and the variables that make this process
    and every process it starts sign with it, trust it and read its store: signed and verified, as in production,
    set before anything reads the settings."""
    work = Path(workdir or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    key = work / "publisher.key"
    if not key.exists():
        generate_key(key)
    store = work / "store"
    os.environ.update(ENGINE_EXT_SIGNING_KEY=str(key), ENGINE_EXT_TRUSTED_KEYS=f"{key}.pub", ENGINE_EXT_SOURCES=str(store))
    return SignedRun(work=work, key=key, store=store)


def tiny_model(args: argparse.Namespace, work: Path, arch: str = "qwen2", heads: int | None = None,
               kv_heads: int | None = None) -> Path:
    """A tiny random model of :func:`add_tiny_model_args`' size in ``work/model`` (heads: one per 128 of hidden, at
    least 4; KV heads one per 512, at least 2)."""
    return make_model(work / "model", arch, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                      heads=heads or max(4, args.hidden // 128), kv_heads=kv_heads or max(2, args.hidden // 512))


def publish_sign_steps(model_dir: Path, store: Path, steps: int, lr: float, seed: int = 0,
                       full_dir: Path | None = None) -> list[dict]:
    """Publish v0 (anchor) .. v{steps}: Adam-like steps (size ``lr``, random sign) on fp32 masters, cast to bf16;
    every version also saved whole into ``full_dir`` when given (what a cold start loads)."""
    master = {n: t.float() for n, t in load_state_dict(model_dir).items()}
    g = torch.Generator().manual_seed(seed)
    versions = []
    with DeltaPublisher(str(store), anchor_every=0) as pub:
        for v in range(steps + 1):
            if v:
                for t in master.values():
                    t.add_(torch.sign(torch.randn(t.shape, generator=g)) * lr)
            sd = {n: t.to(torch.bfloat16) for n, t in master.items()}
            pub.publish(sd)
            if full_dir is not None:
                full_dir.mkdir(exist_ok=True)
                save_file(sd, str(full_dir / f"v{v:08d}.safetensors"))
            versions.append(sd)
    return versions
