"""pcodec's configurations on the sequences the codec codes, side by side on real AdamW steps.

    python bench/train_data.py          # once: trains and caches the versions (~2.5 min)
    python bench/codec_configs.py       # ~1 min on cached data

Why: the codec (engine_ext.format.codec) codes every changed part as two integer sequences,
the gaps of its changed positions and its values (the new bits, ``abs``, or the ordered-space
steps from the old, ``rel``), with pcodec. pcodec's default configuration searches a delta
order and a mode per chunk; the publisher pays that search on every part of every version.
This prints, per sequence and per configuration, the bits per change (all parts summed) and
the single-thread time (best of ``--repeat``), on the parts a publisher codes: each tensor
cut into runs of ``MIN_CELL`` elements (about what the grid cells hold), for the bf16 cast,
the fp32 masters and the fp8 block quantisation of the same runs (bench/train_data.py, both
learning rates, 8 steps each).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pcodec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.train_data import versions  # noqa: E402
from engine_ext.format.chunks import MIN_CELL  # noqa: E402
from engine_ext.format.dtypes import step_between  # noqa: E402
from engine_ext.format.quantize import fp8_block_state_dict  # noqa: E402

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_NO_SEARCH = dict(delta_spec=pcodec.DeltaSpec.no_op(), mode_spec=pcodec.ModeSpec.classic())
CONFIGS = {  # name: ChunkConfig
    "default (search), level 8": pcodec.ChunkConfig(),
    "no delta, classic, level 8 (the codec's)": pcodec.ChunkConfig(**_NO_SEARCH),
    "no delta, classic, level 6": pcodec.ChunkConfig(compression_level=6, **_NO_SEARCH),
    "no delta, classic, level 4": pcodec.ChunkConfig(compression_level=4, **_NO_SEARCH),
}


def sequences(pairs) -> dict[str, list[np.ndarray]]:
    """The gaps, abs values and rel values of every changed run of ``MIN_CELL`` elements."""
    out = {"gaps": [], "abs": [], "rel": []}
    for old, new in pairs:
        for name, o in old.items():
            it = _INT[o.element_size()]
            o, w = o.reshape(-1).view(it), new[name].reshape(-1).view(it)
            for a in range(0, o.numel(), MIN_CELL):
                oo, ww = o[a:a + MIN_CELL], w[a:a + MIN_CELL]
                pos = torch.nonzero(oo != ww).reshape(-1)
                if pos.numel() < 2:
                    continue
                values, steps = ww[pos].numpy(), step_between(oo[pos], ww[pos], old[name].dtype.is_floating_point).numpy()
                if values.itemsize == 1:  # as the codec widens 8-bit sequences for pco
                    values, steps = values.astype(np.int16), steps.astype(np.int16)
                out["gaps"].append(np.diff(pos.numpy(), prepend=0).astype(np.uint32))
                out["abs"].append(np.ascontiguousarray(values))
                out["rel"].append(np.ascontiguousarray(steps))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    quiet = lambda *a: None  # noqa: E731
    runs = {"bf16": lambda v: v, "fp32 masters": lambda v: v, "fp8 block (of the masters)": fp8_block_state_dict}
    print("| versions | sequence | configuration | bits per change | ms (one thread) |\n|---|---|---|---:|---:|")
    for label, convert in runs.items():
        pairs = []
        for lr in (1e-6, 3e-6):
            vs = [convert(v) for v in versions(lr, 8, masters=label != "bf16", log=quiet)]
            pairs += list(zip(vs[:-1], vs[1:]))
        seqs = sequences(pairs)
        changes = sum(g.size for g in seqs["gaps"])
        for seq, arrays in seqs.items():
            for name, config in CONFIGS.items():
                best, size = float("inf"), 0
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    size = sum(len(pcodec.standalone.simple_compress(a, config)) for a in arrays)
                    best = min(best, time.perf_counter() - t)
                print(f"| {label} ({changes} changes) | {seq} | {name} | {8 * size / changes:.4f} | {1e3 * best:.1f} |")
    print("command: python bench/codec_configs.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
