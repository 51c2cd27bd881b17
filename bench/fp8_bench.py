"""fp8 deltas against bf16 deltas of the same training run: density and published bytes.

    python bench/fp8_bench.py [--lr 1e-6 3e-6] [--steps 8] [--settle 20] [sizes: see bench/train_data.py]

Why: a trainer that serves an fp8-block checkpoint (DeepSeek-V3 / Qwen3-FP8 layout) could
publish deltas of the fp8 bytes and scales instead of bf16 ones. fp8 e4m3 has 3 mantissa
bits against bf16's 7, so an element's rounding boundary is crossed far less often; but
every tile's scale is its float32 ``amax / 448``, and a new scale re-divides the whole
tile. Which effect wins depends on how often tile maxima move, which synthetic steps do
not model, so this measures real AdamW training (bench/train_data.py).

Three checkpoints per version of one run, each published with the real
:class:`~engine_ext.trainer.publisher.DeltaPublisher` into a local store (anchor at version 0,
then one delta per step); every number comes from the published manifests and blobs:

* **bf16**: the bf16 cast of the fp32 masters.
* **fp8 (fp32 masters)**: ``fp8_block_state_dict`` of the fp32 masters (how a trainer
  would quantise); the tensors it leaves unquantised (embeddings, lm_head, norms, biases)
  as bf16, as in the bf16 checkpoint.
* **fp8 (bf16 cast)**: the same recipe applied to the bf16 cast.

Each is published twice, with codec v1 (``ENGINE_EXT_CONTEXT_CODER=0``) and with v2 (bytes
first, ``ENGINE_EXT_READER_MBPS=0``: the context coder where it saves 10 %). Delta bytes = the delta's ``v*.bin``
blobs + its manifest. Checkpoint bytes = 2 B per bf16 element, 1 B per fp8 element, 4 B
per scale.
"""
from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.train_data import run_args, spec_kwargs, versions  # noqa: E402
from engine_ext import settings  # noqa: E402
from engine_ext.format.manifest import Manifest, manifest_key  # noqa: E402
from engine_ext.trainer.publisher import DeltaPublisher  # noqa: E402
from engine_ext.format.quantize import BLOCK, FP8, SCALE_SUFFIX, fp8_block_state_dict, quantizes, scale_name  # noqa: E402

PARTS = ("linear", "scale", "other")  # quantisable linear weights, their scales, everything else


def part_of(name: str, linear_names: set[str]) -> str:
    return "scale" if name.endswith(SCALE_SUFFIX) else "linear" if name in linear_names else "other"


def fp8_checkpoint(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp8-block checkpoint of ``sd``; tensors the recipe keeps are cast to bf16."""
    return {n: t if t.dtype == FP8 or n.endswith(SCALE_SUFFIX) else t.to(torch.bfloat16)
            for n, t in fp8_block_state_dict(sd).items()}


def bf16_checkpoint(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in sd.items()}


def publish(vs: list[dict[str, torch.Tensor]], root: Path) -> list[tuple[Manifest, int]]:
    """Publish the versions (anchor, then deltas); each delta's manifest and its size in bytes."""
    # dtype=None: the versions are the checkpoints as served (an fp8 one keeps its float32 scales; the
    # publisher's default would cast them to bf16, which no server holds)
    with DeltaPublisher(str(root), model="m", anchor_every=0, workers=1, dtype=None) as pub:
        for sd in vs:
            pub.publish(sd)
    out = []
    for v in range(1, len(vs)):
        raw = (root / manifest_key(v)).read_bytes()
        out.append((Manifest.from_json(raw), len(raw)))
    return out


@dataclass
class Step:
    """One delta's numbers: per part, changed elements and payload bytes (positions + values)."""
    nnz: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    payload: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    blobs: int = 0
    manifest: int = 0

    @property
    def bytes(self) -> int:
        return self.blobs + self.manifest


def step_of(m: Manifest, manifest_bytes: int, linear_names: set[str]) -> Step:
    s = Step(blobs=sum(b.size for b in m.blobs), manifest=manifest_bytes)
    for t in m.tensors:
        part = part_of(t.name, linear_names)
        s.nnz[part] += t.nnz
        s.payload[part] += sum(c.length for c in t.chunks) if t.chunks else t.length
    return s


def numel_by_part(sd: dict[str, torch.Tensor], linear_names: set[str]) -> dict[str, int]:
    out = dict.fromkeys(PARTS, 0)
    for n, t in sd.items():
        out[part_of(n, linear_names)] += t.numel()
    return out


def tile_changes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], block: int = BLOCK) -> torch.Tensor:
    """Over all quantised weights of two fp8 checkpoints: [tiles, tiles with a new scale,
    elements and changed elements in tiles with a new scale, the same in tiles with the same scale]."""
    acc = torch.zeros(6, dtype=torch.int64)
    for name, q1 in new.items():
        if q1.dtype != FP8:
            continue
        q0, s0, s1 = old[name], old[scale_name(name)], new[scale_name(name)]
        (n, k), (nb, kb) = q1.shape, s1.shape
        grid = torch.zeros(2, nb * block, kb * block, dtype=torch.int64)
        grid[0, :n, :k] = 1
        grid[1, :n, :k] = q0.view(torch.uint8) != q1.view(torch.uint8)
        elems, changed = grid.view(2, nb, block, kb, block).sum((2, 4))
        new_scale = s0.view(torch.int32) != s1.view(torch.int32)
        acc += torch.stack([torch.tensor(new_scale.numel()), new_scale.sum(), elems[new_scale].sum(),
                            changed[new_scale].sum(), elems[~new_scale].sum(), changed[~new_scale].sum()])
    return acc


def pct(x: float) -> str:
    return f"{100 * x:.3f} %"


def run_lr(lr: float, steps: int, settle: int, kw: dict, log=print) -> None:
    t0 = time.perf_counter()
    masters = versions(lr, steps, settle=settle, masters=True, log=log, **kw)
    linear_names = {n for n, t in masters[0].items() if quantizes(n, t)}
    bf16 = [bf16_checkpoint(m) for m in masters]
    checkpoints = {"bf16": bf16, "fp8 (fp32 masters)": [fp8_checkpoint(m) for m in masters],
                   "fp8 (bf16 cast)": [fp8_checkpoint(m) for m in bf16]}
    kinds = {f"{k} {coder}": (vs, coder) for k, vs in checkpoints.items() for coder in ("v1", "v2")}
    rows, parts, tiles, linear = [], [], [], {}
    for kind, (vs, coder) in kinds.items():
        with tempfile.TemporaryDirectory(prefix="fp8-bench-") as d, settings.override(context_coder=coder == "v2", reader_mbps=0):  # v2: bytes first
            manifests = publish(vs, Path(d))
        numel = numel_by_part(vs[0], linear_names)
        total = sum(numel.values())
        ckpt = sum(t.numel() * t.element_size() for t in vs[0].values())
        st = [step_of(m, size, linear_names) for m, size in manifests]
        nnz = {p: sum(s.nnz[p] for s in st) / steps for p in PARTS}
        payload = {p: sum(s.payload[p] for s in st) / steps for p in PARTS}
        changed = sum(nnz.values())
        dbytes = sum(s.bytes for s in st) / steps
        manifest = sum(s.manifest for s in st) / steps
        blobs = sum(s.blobs for s in st) / steps
        rows.append(f"| {kind} | {pct(changed / total)} | {pct(nnz['linear'] / numel['linear'])} | "
                    + (f"{pct(nnz['scale'] / numel['scale'])}" if numel["scale"] else "-")
                    + f" | {pct(nnz['other'] / numel['other'])} | {dbytes / 1e3:.1f} kB | {manifest / 1e3:.1f} kB | "
                      f"{pct(dbytes / ckpt)} | {pct(blobs / ckpt)} | {dbytes / changed:.3f} | {blobs / changed:.3f} |")
        linear[kind] = (nnz["linear"], payload["linear"] + payload["scale"])
        parts.append(f"| {kind} | {ckpt / 1e6:.2f} MB | "
                     + " | ".join(f"{payload[p] / nnz[p]:.3f} ({payload[p]:,.0f} B)" if nnz[p] else "-" for p in PARTS) + " |")
        if numel["scale"] and coder == "v2":
            t = sum(tile_changes(a, b) for a, b in itertools.pairwise(vs)).tolist()
            tiles.append(f"| {kind} | {t[0] // steps} | {pct(t[1] / t[0])} | "
                         + (f"{pct(t[3] / t[2])}" if t[2] else "-") + f" | {pct(t[5] / t[4]) if t[4] else '-'} |")
    n_params = sum(t.numel() for t in masters[0].values())
    print(f"\n### lr {lr:g}\n\n{n_params / 1e6:.2f} M parameters ({numel['linear'] / 1e6:.2f} M in quantised linear "
          f"weights, {numel['scale']} scales), {steps} steps; averages per step.\n")
    print("| checkpoint | changed elements | linear weights changed | scales changed | other tensors changed | "
          "delta bytes | of which manifest | delta / checkpoint | blobs / checkpoint | B per changed element | "
          "blob B per changed element |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for coder in ("v1", "v2"):
        b_nnz, b_bytes = linear[f"bf16 {coder}"]
        print(f"\nLinear weights alone, against bf16 {coder} (fp8 bytes include the scales): " + "; ".join(
            f"{k}: {b_nnz / n:.1f}x fewer changed weights, {b_bytes / b:.1f}x fewer payload bytes"
            for k, (n, b) in linear.items() if k.endswith(coder) and not k.startswith("bf16")))
    print("\nPayload (positions + values) per changed element, and per step, by part:\n")
    print("| checkpoint | checkpoint bytes | linear weights | scales | other tensors |")
    print("|---|---|---|---|---|")
    print("\n".join(parts))
    print("\nTiles of the quantised weights (128x128):\n")
    print("| checkpoint | tiles | tiles with a new scale | fp8 changed in tiles with a new scale | fp8 changed in tiles with the same scale |")
    print("|---|---|---|---|---|")
    print("\n".join(tiles))
    log(f"\n(lr {lr:g}: {time.perf_counter() - t0:.1f} s)")


def main() -> None:
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    run_args(p)  # bench/train_data.py's
    a = p.parse_args()
    print("command: " + shlex.join(["python", "bench/fp8_bench.py", *sys.argv[1:]]))
    t0 = time.perf_counter()
    for lr in a.lr:
        run_lr(lr, a.steps, a.settle, spec_kwargs(a))
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
