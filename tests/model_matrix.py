"""The trainer side of the conformance matrix (tests/test_models.py on vLLM, tests/test_sglang_models.py
on SGLang; the table: docs/MODELS.md).

A trainer holds a tiny random model of a real transformers class (float32 master weights,
:func:`engine_ext.tiny_models.build`) and takes two steps: three versions. The same trajectory
is published once per call path a trainer uses, each to its own store:

* ``module``: ``publish(model)`` (the README's call; ``state_dict()`` holds a tied embedding
  under both names),
* ``state_dict``: ``publish(model.state_dict())``,
* ``trl_iterator``: ``publish(model.named_parameters())``, the ``(name, tensor)`` pairs TRL's
  ``VLLMGeneration._iter_named_params`` hands to a weight transfer,
* ``checkpoint``: ``save_pretrained`` of each version (float32, the Hub's layout: transformers 5
  writes per-expert MoE weights and a VLM's ``model.``/``visual.`` names, not the names it holds
  in memory), published with the CLI (``engine-ext anchor`` / ``diff --dtype bfloat16``).

The trainer paths publish the Hub's layout too: ``publish(model)`` reverts transformers' in-memory
conversions itself, the state dict and iterator paths with ``checkpoint_layout=model``.

from the float32 masters (cast to the served bf16 by the publisher's default ``dtype``) and, where
asked, from a bf16 copy of the trainer. Every store must then hold the same versions
(same fingerprints), and the served checkpoint is the final version under the trainer's own
names (:func:`engine_ext.tiny_models.save_trainer_layout`). A VLM's vision tower is frozen:
it never moves, so the deltas carry none of it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_ext.format import fingerprint as fpr
from engine_ext.tiny_models import VLM_KINDS, finish_dir, build, save_trainer_layout
from engine_ext.trainer.publisher import DeltaPublisher

VERSIONS = 3  # an anchor and two deltas
PATHS = {"module": lambda m: m, "state_dict": lambda m: m.state_dict(), "trl_iterator": lambda m: m.named_parameters()}
TRAINER_PATHS = tuple(PATHS)  # the calls a trainer makes; "checkpoint" goes through save_pretrained and the CLI
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VOCAB = 1024


@dataclass
class Trajectory:
    kind: str
    final: Path  # the served checkpoint: the last version, trainer names, bf16
    first: Path | None = None  # the first version (v0) in the same layout: the cold-load audit's reference at v0
    stores: dict[str, Path] = field(default_factory=dict)  # "path/dtype" -> store root
    fingerprint: str = ""  # the last version's model fingerprint (every store's)
    frozen: tuple[str, ...] = ()  # tensors that never move (a VLM's vision tower)
    aliases: dict[str, str] = field(default_factory=dict)  # tied names the module path published once
    names: tuple[str, ...] = ()  # the tensors of every version
    fingerprints: dict[str, str] = field(default_factory=dict)  # "path/dtype" -> the last version's fingerprint

    def url(self, store: str, version: int) -> str:
        return str(self.stores[store] / (f"v{version:08d}.anchor.json" if version == 0 else f"v{version:08d}.json"))


def frozen_names(kind: str, model: torch.nn.Module) -> tuple[str, ...]:
    """What the trainer freezes: a VLM's vision tower."""
    return tuple(n for n, _ in model.named_parameters() if kind in VLM_KINDS and ".visual." in f".{n}")


def step(model: torch.nn.Module, gen: torch.Generator, frozen=(), lr: float = 1e-3) -> None:
    """An RL-sized step on the float32 masters: every trainable weight moves by ~lr of its mean size."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied parameter is listed once: it moves once
            if name not in frozen:
                p.add_(torch.randn(p.shape, generator=gen) * lr * (p.abs().mean() + 1e-3))


def trajectory(kind: str, root: Path, *, paths=TRAINER_PATHS + ("checkpoint",), dtypes=("fp32",), tied_copy: bool = False,
               layout: str = "hub", seed: int = 1) -> Trajectory:
    """Publish the trajectory of ``kind`` through every path (and trainer dtype) into ``root``/store-*;
    write the final served checkpoint to ``root``/final (and the first version to ``root``/first, the cold-load
    audit's reference at v0), in the Hub's layout (``save_pretrained``,
    what users serve; ``tied_copy``: the tied ``lm_head.weight`` stored too) or the trainer's
    (:func:`engine_ext.tiny_models.save_trainer_layout`). Asserts that every trainer path publishes
    the same versions, and the checkpoint path too where the two layouts name the same tensors."""
    model = build(kind, vocab=VOCAB)
    frozen = frozen_names(kind, model)
    gen = torch.Generator().manual_seed(seed)
    states = []
    for v in range(VERSIONS):
        if v:
            step(model, gen, frozen)
        states.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    saved = []
    for name, state in (("first", states[0]), ("final", states[-1])):
        model.load_state_dict(state)
        saved.append(save_hub_layout(root / name, model, kind, tied_copy) if layout == "hub"
                     else save_trainer_layout(root / name, model, kind=kind, tied_copy=tied_copy))
    out = Trajectory(kind, saved[1], first=saved[0], frozen=frozen)
    fps = {}
    if "checkpoint" in paths:
        fps["checkpoint/fp32"] = publish_checkpoints(kind, model, states, root, out)
    for dt in dtypes:
        trainer = model if DTYPES[dt] == torch.float32 else copy.deepcopy(model).to(DTYPES[dt])
        for path in (p for p in paths if p != "checkpoint"):
            name = f"{path}/{dt}"
            out.stores[name] = root / f"store-{path}-{dt}"
            # publish(model) finds the layout itself; a state dict or TRL's iterator carries names only, so the
            # trainer says which model's checkpoint layout they are in (transformers 5 fuses MoE experts and
            # moves a VLM's language model in memory: engine_ext/trainer/checkpoint_layout.py)
            layout = "auto" if path == "module" else trainer
            with DeltaPublisher(str(out.stores[name]), model=kind, anchor_every=0, chunk_min_cell=None,
                                checkpoint_layout=layout) as pub:
                for state in states:
                    trainer.load_state_dict(state)  # a bf16 trainer holds the masters rounded to bf16
                    pub.publish(PATHS[path](trainer))
                pub.wait()
                fps[name] = fpr.fmt(pub.fingerprint)
                if path == "module":
                    out.aliases = dict(pub.aliases)
                out.names = tuple(pub._prev)
    assert len(set(fps.values())) == 1, f"{kind}: the call paths published different versions: {fps}"
    out.fingerprint = next(iter(fps.values()))
    out.fingerprints = fps
    return out


def save_hub_layout(path: Path, model: torch.nn.Module, kind: str, tied_copy: bool = False) -> Path:
    """``save_pretrained`` of ``model`` in bf16 (the Hub's layout), tokenizer and all; ``tied_copy``: the
    tied ``lm_head.weight`` stored beside the embedding, as some Hub checkpoints have it."""
    from safetensors.torch import load_file, save_file

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.save_pretrained(str(path))
    finish_dir(path, kind, VOCAB, ())
    if tied_copy:
        sd = load_file(str(path / "model.safetensors"))
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def publish_checkpoints(kind: str, model: torch.nn.Module, states: list, root: Path, out: Trajectory) -> str:
    """Each version saved by ``save_pretrained`` (float32) and published by the CLI in bf16; the last
    fingerprint."""
    import contextlib
    import io
    import json

    from engine_ext.cli import main

    store = out.stores["checkpoint/fp32"] = root / "store-checkpoint-fp32"
    dirs = []
    for v, state in enumerate(states):
        model.load_state_dict(state)
        dirs.append(root / f"ckpt-v{v}")
        model.save_pretrained(str(dirs[-1]))
    for v, d in enumerate(dirs):
        args = ["anchor", d] if v == 0 else ["diff", dirs[v - 1], d]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main([str(a) for a in args] + ["--out", str(store), "--dtype", "bfloat16", "--model", kind])
        assert code == 0, f"{kind}: engine-ext {args[0]} failed: {err.getvalue()[-2000:]}"
    return json.loads((store / f"v{len(states) - 1:08d}.json").read_text())["fingerprint"]


def delta_names(traj: Trajectory, store: str) -> dict[str, int]:
    """{tensor: changed elements} over the deltas of ``store``."""
    import json

    out: dict[str, int] = {}
    for v in range(1, VERSIONS):
        for t in json.loads(Path(traj.url(store, v)).read_text())["tensors"]:
            out[t["name"]] = out.get(t["name"], 0) + t["nnz"]
    return out
