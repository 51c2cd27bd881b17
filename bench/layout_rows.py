"""What converting a rank's rows to the checkpoint layout costs a sharded trainer's step, per publish.

    python bench/layout_rows.py              # a tiny-width Qwen3-MoE of 48 layers (531 in-memory tensors)

Every in-memory tensor goes through :func:`engine_ext.trainer.checkpoint_layout.rows_in_checkpoint_layout`
as one rank holding all its rows would (the per-publish path of a ShardedPublisher given a transformers 5
model), beside transformers' own ``revert_weight_conversion`` of the whole state dict (the single-process
path). The first round fills the per-model cache; the widths are tiny, so this times the per-tensor overhead.
"""
from __future__ import annotations

import time

from engine_ext.tiny_models import build
from engine_ext.trainer import checkpoint_layout as cl


def main() -> None:
    model = build("qwen3-moe", vocab=64, hidden=32, layers=48, heads=4, kv_heads=2, seed=0, std=0.02)
    sd = {n: p.detach() for n, p in model.named_parameters()}
    for r in range(3):
        t = time.perf_counter()
        for n, x in sd.items():
            cl.rows_in_checkpoint_layout(model, n, x, tuple(x.shape), 0)
        rows = time.perf_counter() - t
        t = time.perf_counter()
        cl.to_checkpoint_layout(dict(sd), model)
        whole = time.perf_counter() - t
        print(f"round {r}: {len(sd)} tensors, rows_in_checkpoint_layout {rows:.3f} s, whole-model revert {whole:.3f} s")


if __name__ == "__main__":
    main()
