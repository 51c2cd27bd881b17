"""CPU benchmark: apply one sparse update to an MoE layer with many experts, four ways, side by side.

    .venv/bin/python bench/moe_apply_bench.py [--experts 128] [--intermediate 256] [--hidden 512]
                                              [--density 0.01] [--reps 7]

Why: an MoE checkpoint holds ``3 * E`` small tensors per layer
(``model.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight``) that the engine packs into
two parameters, ``w13`` [E, 2*I, H] (gate rows then up rows of each expert) and ``w2``
[E, H, I]. An apply that costs a fixed overhead per checkpoint tensor pays it ``3 * E``
times per layer, so how the update is batched matters more than for a dense model.

The layer here is a plain module holding the two bf16 parameters as vLLM's ``FusedMoE``
does, and a loader that does what its ``weight_loader`` does at TP=1 (``_load_w13`` /
``_load_w2``): take ``param.data[e]``, ``narrow`` it to the gate, up or down shard and
``copy_`` the checkpoint tensor into it. The update is what an RL step produces: fp32
masters, small noise added to a random ``density`` of each tensor's elements, cast to
bf16; only elements whose bf16 bits change are in the delta (their count is printed).

Methods (all from the same base weights, all must end at bitwise the expected new
weights: checked after every run, and the layer is reset to the base between runs):
  fused            ``engine_ext.server.apply.apply_delta(all 3*E deltas, maps, undo=False)``: one call
                   (``backend="auto"``: the torch path on CPU tensors; the fused Triton kernel,
                   one launch per dtype width, is what it picks on CUDA; not measured here)
  fused+undo       the same with ``undo=True`` (production: old bits kept for rollback)
  per-expert       ``apply_delta([d], maps, undo=False)`` once per checkpoint tensor (3*E calls),
                   as an engine that applies expert tensors one by one would
  per-expert+undo  the same with ``undo=True``
  vllm             vLLM's ``load_checkpoint_weight_patches(layer, patches)``, one call with one
                   sparse ``CheckpointWeightPatch(name, shape, bf16, values, indices)`` per
                   checkpoint tensor (checkpoint coordinates: flat indices into the checkpoint
                   tensor, new values there). It needs only ``model.load_weights([(name, t)])``:
                   per patch it builds a NaN-filled checkpoint-shaped tensor, scatters the new
                   values into it, and runs the model's loader with ``torch.Tensor.copy_``
                   patched to ``torch.where(isnan(src), dst, src, out=dst)``. No vLLM model or
                   config is needed: this layer's ``load_weights`` is that interface, the same
                   loader ``probe_layout`` watched.
  dense            baseline: the loader re-run for every checkpoint tensor with the full new
                   tensor (a non-sparse refit, excluding reading the checkpoint)

Maps come from :func:`engine_ext.server.layout.probe_layout` on the loader; deltas from
:func:`engine_ext.format.delta.diff_tensor` (mode ABS: sorted int64 positions, new bits as int16).
Each method is warmed up once, then ``--reps`` rounds run every method once, in an order
that rotates per round, so the ratios come from one run on one machine state. Reported:
median wall and CPU (process) time per method and their ratios to ``fused``. On a shared
machine CPU time is the steadier number (one torch thread by default).
"""
from __future__ import annotations

import argparse
import gc
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine_ext.server.apply import apply_delta  # noqa: E402
from engine_ext.format.delta import ABS, TensorDelta, diff_tensor  # noqa: E402
from engine_ext.server.layout import probe_layout  # noqa: E402
from engine_ext.server.maps import TensorMap  # noqa: E402

CKPT = "model.layers.0.mlp.experts.{e}.{proj}_proj.weight"
PROJS = ("gate", "up", "down")


class MoELayer(torch.nn.Module):
    """``w13`` [E, 2I, H] and ``w2`` [E, H, I] in bf16, loaded per expert tensor like vLLM's FusedMoE."""

    def __init__(self, experts: int, inter: int, hidden: int):
        super().__init__()
        self.inter = inter
        self.w13 = torch.nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.empty(experts, hidden, inter, dtype=torch.bfloat16), requires_grad=False)
        self.route = {CKPT.format(e=e, proj=p): (e, p) for e in range(experts) for p in PROJS}

    def load(self, name: str, t: torch.Tensor) -> None:
        """FusedMoE ``_load_w13`` / ``_load_w2`` at TP=1: narrow the expert's shard, ``copy_``."""
        e, proj = self.route[name]
        if proj == "down":
            dst = self.w2.data[e]
        else:
            dst = self.w13.data[e].narrow(0, 0 if proj == "gate" else self.inter, self.inter)
        dst.copy_(t)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's model interface: what ``load_checkpoint_weight_patches`` calls."""
        for name, t in weights:
            self.load(name, t)
        return {name for name, _ in weights}


def ckpt_shapes(experts: int, inter: int, hidden: int) -> dict[str, tuple[int, int]]:
    shape = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return {CKPT.format(e=e, proj=p): shape[p] for e in range(experts) for p in PROJS}


def rl_step(shape: tuple[int, ...], density: float, noise: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) bf16: fp32 masters, noise on a random ``density`` of elements, both cast to bf16."""
    master = 0.02 * torch.randn(shape, generator=g)
    hit = torch.rand(shape, generator=g) < density
    moved = master + hit * (noise * torch.randn(shape, generator=g))
    return master.to(torch.bfloat16), moved.to(torch.bfloat16)


def checkpoint(p13: torch.Tensor, p2: torch.Tensor, inter: int) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (contiguous copies) of parameters laid out as w13 / w2."""
    out = {}
    for e in range(p13.shape[0]):
        out[CKPT.format(e=e, proj="gate")] = p13[e, :inter].clone()
        out[CKPT.format(e=e, proj="up")] = p13[e, inter:].clone()
        out[CKPT.format(e=e, proj="down")] = p2[e].clone()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16)


@dataclass
class Setup:
    layer: MoELayer
    base: tuple[torch.Tensor, torch.Tensor]  # w13, w2 before the update
    expected: tuple[torch.Tensor, torch.Tensor]  # w13, w2 after it (built without the loader)
    old: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor]


def build(experts: int, inter: int, hidden: int, density: float, noise: float, seed: int) -> Setup:
    g = torch.Generator().manual_seed(seed)
    old13, new13 = rl_step((experts, 2 * inter, hidden), density, noise, g)
    old2, new2 = rl_step((experts, hidden, inter), density, noise, g)
    layer = MoELayer(experts, inter, hidden)
    old, new = checkpoint(old13, old2, inter), checkpoint(new13, new2, inter)
    with torch.no_grad():
        layer.load_weights(list(old.items()))
    assert torch.equal(bits(layer.w13), bits(old13)) and torch.equal(bits(layer.w2), bits(old2)), "loader misplaces rows"
    return Setup(layer, (old13, old2), (new13, new2), old, new)


def reset(s: Setup) -> None:
    with torch.no_grad():
        s.layer.w13.data.copy_(s.base[0])
        s.layer.w2.data.copy_(s.base[1])


def matches(s: Setup, want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(bits(s.layer.w13), bits(want[0])) and torch.equal(bits(s.layer.w2), bits(want[1]))


def vllm_method(s: Setup, deltas: list[TensorDelta]) -> tuple[Callable[[], object] | None, str]:
    """The vLLM call on this layer, or None and why it cannot run."""
    try:
        import vllm
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (CheckpointWeightPatch,
                                                                                load_checkpoint_weight_patches)
    except Exception as e:  # noqa: BLE001 - any import failure means the method cannot run here
        return None, f"vLLM not importable: {type(e).__name__}: {e}"
    patches = [CheckpointWeightPatch(d.name, d.shape, torch.bfloat16, d.values.view(torch.bfloat16), d.positions)
               for d in deltas]
    return (lambda: load_checkpoint_weight_patches(s.layer, patches)), f"vLLM {vllm.__version__}"


def methods(s: Setup, deltas: list[TensorDelta], maps: dict) -> tuple[dict[str, Callable[[], object]], str]:
    new_items = list(s.new.items())
    out: dict[str, Callable[[], object]] = {
        "fused": lambda: apply_delta(deltas, maps, undo=False),
        "fused+undo": lambda: apply_delta(deltas, maps, undo=True),
        "per-expert": lambda: [apply_delta([d], maps, undo=False) for d in deltas],
        "per-expert+undo": lambda: [apply_delta([d], maps, undo=True) for d in deltas],
    }
    fn, note = vllm_method(s, deltas)
    if fn is not None:
        out["vllm"] = fn
    out["dense"] = lambda: s.layer.load_weights(new_items)
    return out, note


CALLS = {"fused": "1 apply_delta", "fused+undo": "1 apply_delta", "per-expert": "{n} apply_delta",
         "per-expert+undo": "{n} apply_delta", "vllm": "1 load_checkpoint_weight_patches ({n} patches)",
         "dense": "{n} loader calls"}


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def run(s: Setup, fns: dict[str, Callable[[], object]], reps: int) -> dict[str, tuple[list[float], list[float]]]:
    """Warm up each method, then ``reps`` rounds of every method in a rotating order; bitwise check after each."""
    names = list(fns)
    for n in names:  # warm-up (first-call costs) and a check of the undo log on the way back
        reset(s)
        out = fns[n]()
        assert matches(s, s.expected), f"{n}: wrong weights after warm-up"
        for r in out if isinstance(out, list) else [out]:
            if getattr(r, "undo", None) is not None:
                r.undo.rollback()
        if n.endswith("+undo"):
            assert matches(s, s.base), f"{n}: rollback did not restore the base bits"
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    with torch.no_grad():
        for k in range(reps):
            for n in names[k % len(names):] + names[:k % len(names)]:
                reset(s)
                wall, cpu, out = timed(fns[n])
                del out
                assert matches(s, s.expected), f"{n}: weights differ from the expected new bits"
                times[n][0].append(wall)
                times[n][1].append(cpu)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128, help="E (default 128)")
    ap.add_argument("--intermediate", type=int, default=256, help="I, per-expert intermediate size (default 256)")
    ap.add_argument("--hidden", type=int, default=512, help="H (default 512)")
    ap.add_argument("--density", type=float, default=0.01, help="fraction of each tensor's elements perturbed")
    ap.add_argument("--noise", type=float, default=1e-3, help="noise std on perturbed fp32 masters (weights: std 0.02)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: shared machine)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print("$ " + shlex.join([sys.executable] + sys.argv))
    print(f"# {vars(a)}")

    t0 = time.perf_counter()
    s = build(a.experts, a.intermediate, a.hidden, a.density, a.noise, a.seed)
    deltas = [diff_tensor(n, s.old[n], s.new[n], mode=ABS) for n in s.new]
    shapes = ckpt_shapes(a.experts, a.intermediate, a.hidden)
    t1 = time.perf_counter()
    maps = probe_layout(s.layer, s.layer.load, [(n, shapes[n], "bfloat16") for n in s.new])
    probe_s = time.perf_counter() - t1
    bad = [n for n, m in maps.items() if not isinstance(m, TensorMap)]
    assert not bad, f"unmappable: {[maps[n] for n in bad[:3]]}"
    fns, vllm_note = methods(s, deltas, maps)
    setup_s = time.perf_counter() - t0

    times = run(s, fns, a.reps)
    n_tensors = len(deltas)
    nnz = sum(d.nnz for d in deltas)
    numel = sum(d.numel for d in deltas)
    param_mb = (s.layer.w13.numel() + s.layer.w2.numel()) * 2 / 1e6
    print(f"\nE={a.experts} I={a.intermediate} H={a.hidden}: {n_tensors} checkpoint tensors, {param_mb:.1f} MB bf16; "
          f"{nnz:,} changed elements ({nnz / numel:.3%} of {numel:,}; {a.density:.2%} perturbed); "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {vllm_note}; "
          f"probe_layout {probe_s * 1e3:.0f} ms; setup {setup_s:.1f} s; {a.reps} interleaved rounds\n")
    if "vllm" not in fns:
        print(f"vllm: NOT RUN ({vllm_note})\n")
    ref_w, ref_c = (statistics.median(x) for x in times["fused"])
    print("| method | calls | median wall ms | median CPU ms | wall / fused | CPU / fused | bitwise = expected |")
    print("|---|---|---|---|---|---|---|")
    for n, (w, c) in times.items():
        mw, mc = statistics.median(w), statistics.median(c)
        print(f"| {n} | {CALLS[n].format(n=n_tensors)} | {mw * 1e3:.2f} | {mc * 1e3:.2f} | "
              f"{mw / ref_w:.2f}x | {mc / ref_c:.2f}x | yes ({len(w)}/{len(w)}) |")


if __name__ == "__main__":
    main()
