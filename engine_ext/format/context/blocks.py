"""The blocks a context-coded part is cut into, where tensor parallelism cuts its tensor.

Why: the context coder (:mod:`engine_ext.format.context.codec`) numbers a part's changes
by their rank among the part's elements of the same class, which a rank can only count
over elements it holds. Cutting the part into *blocks* (ranks restart in each) at every
place an engine's shard may end lets each rank decode the blocks it holds from its own
base alone. Where the shards end depends on the layer (column- or row-parallel, a padded
vocabulary, fused experts), which the tensor's name tells: :func:`block_policy`. A
policy is one byte in the part's header, so the decoder needs no name.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from ..chunks import Box

SHARD_WAYS = (2, 4, 8)  # tensor-parallel sizes whose cuts fall on block edges
VOCAB_PAD = 64  # vLLM and SGLang pad a vocabulary to a multiple of this before splitting it
MAX_POLICY = 0b11111

# A part's *block policy* (one byte in its header) says which dimensions its blocks are cut
# along: bit d (d = 0, 1, 2) cuts dimension d at the equal shares of 2, 4 and 8 ranks; bit 3
# also cuts dimension 0 at the shares of a vocabulary padded to a multiple of VOCAB_PAD; bit 4
# also cuts dimension 1 at 16 shares (two fused halves, gate and up, each split 8 ways).
GENERIC = {1: 0b0001, 2: 0b1011}  # by rank; 3 and more dimensions: 0b0111
COLUMN_PARALLEL = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "fc1", "dense_h_to_4h"}
ROW_PARALLEL = {"o_proj", "down_proj", "w2", "out_proj", "fc2", "dense_4h_to_h"}
VOCAB = {"embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out"}
# checkpoint tensors an engine splits into several ranges per rank (q, k and v fused; Conv1D transposed)
SPLIT_UNEVENLY = {"qkv_proj", "c_attn", "query_key_value", "W_pack", "c_fc", "c_proj"}


def module_of(name: str) -> str:
    """The layer a checkpoint tensor belongs to, as the sets above name it: ``o_proj`` of
    ``model.layers.0.self_attn.o_proj.weight``."""
    parts = name.split(".")
    if len(parts) > 1 and parts[-1] in ("weight", "bias", "weight_scale_inv", "weight_scale"):
        return parts[-2]
    return parts[-1]


def shard_dim(name: str, shape) -> int | None:
    """The dimension tensor parallelism cuts a checkpoint tensor along, as the engines shard the layer its
    name says (:func:`block_policy` reads them alike): 0 for column-parallel matrices and vocabularies, 1 for
    row-parallel ones; for fused experts [E, out, in] 1 on the column-parallel side, else 0 (the experts).
    None where the name does not say (norms, unknown layers, tensors of one dimension)."""
    module, nd = module_of(name), len(shape)
    if nd >= 3:
        return 1 if module in COLUMN_PARALLEL or module == "gate_up_proj" else 0
    if nd != 2:
        return None
    if module in ROW_PARALLEL:
        return 1
    return 0 if module in COLUMN_PARALLEL or module in VOCAB else None


def block_policy(name: str, shape) -> int | None:
    """The block policy of a tensor from its name, as the engines shard it: column-parallel
    layers along dimension 0, row-parallel ones along 1 (their bias whole), vocabularies along
    0 padded, fused experts [E, out, in] along the experts and the sharded side; norms whole;
    any other tensor along both leading dimensions. None: never context coded (a tensor a
    rank holds several ranges of)."""
    module = module_of(name)
    nd = len(shape)
    if module in SPLIT_UNEVENLY or (nd == 2 and module == "gate_up_proj"):
        return None
    if nd >= 3:
        if module == "gate_up_proj":
            return 0b10011
        return 0b0011 if module in COLUMN_PARALLEL else 0b0101 if module in ROW_PARALLEL else 0b0111
    if module in VOCAB:
        return 0b1001
    if module in COLUMN_PARALLEL:
        return 0b0001
    if module in ROW_PARALLEL:
        return 0b0010 if nd == 2 else 0
    if nd <= 1 and "norm" in name:
        return 0
    return GENERIC.get(nd, 0b0001)


def shard_cuts(n: int, padded_vocab: bool = False, halves: bool = False) -> list[int]:
    """Where tensor parallelism cuts a dimension of ``n``: equal shares of 2, 4 and 8 ranks
    (where they divide ``n``; 16 too for two fused halves) and, for a vocabulary, the shares
    of ``n`` padded to a multiple of ``VOCAB_PAD`` (vLLM's and SGLang's VocabParallelEmbedding)."""
    cuts = set()
    for ways in SHARD_WAYS + ((16,) if halves else ()):
        if n % ways == 0:
            cuts.update(k * n // ways for k in range(1, ways))
        if padded_vocab:
            padded = -(-n // VOCAB_PAD) * VOCAB_PAD
            cuts.update(k * padded // ways for k in range(1, ways))
    return sorted(c for c in cuts if 0 < c < n)


@dataclass(frozen=True)
class Blocks:
    """A part's blocks (row-major over the grid of cuts), each a box of the part (``boxes``,
    part-local) whose elements lie in runs along the last dimension: block ``b`` is the runs
    ``rows[row_ptr[b] : row_ptr[b + 1]]`` (part-flat starts, ascending) of ``run[b]`` elements."""

    shape: tuple
    boxes: list
    sizes: np.ndarray
    rows: np.ndarray
    row_ptr: np.ndarray
    run: np.ndarray
    cuts: list  # per dimension, the interior cuts (empty: not cut)

    @property
    def S(self) -> int:
        return len(self.boxes)

    @property
    def numel(self) -> int:
        return int(self.sizes.sum())

    def block_of(self, pos: np.ndarray) -> np.ndarray:
        """The block of each part-flat position."""
        coords = np.unravel_index(pos, self.shape)
        out = np.zeros(pos.size, dtype=np.int64)
        for d, c in enumerate(self.cuts):
            out = out * (len(c) + 1) + np.searchsorted(np.asarray(c, np.int64), coords[d], side="right")
        return out


def _runs(shape, box) -> np.ndarray:
    """Part-flat starts of a box's runs along the last dimension, ascending."""
    strides = np.array([math.prod(shape[d + 1 :]) for d in range(len(shape))], dtype=np.int64)
    starts = np.array([box[0][-1]], dtype=np.int64)
    for d in range(len(shape) - 2, -1, -1):
        starts = (np.arange(box[0][d], box[1][d], dtype=np.int64)[:, None] * strides[d] + starts[None, :]).reshape(-1)
    return starts


def part_blocks(tensor_shape, box: Box | None, policy: int) -> Blocks:
    """The blocks of a part (``box`` of the tensor, None: all of it) under a block policy. Cached: a model's
    layers repeat a few shapes, and a reader asks for every part's blocks (read-only arrays)."""
    full = tuple(int(s) for s in tensor_shape) or (1,)
    return _blocks(full, None if box is None else (tuple(map(int, box[0])), tuple(map(int, box[1]))), int(policy))


@functools.lru_cache(maxsize=4096)
def _blocks(full: tuple, box: Box | None, policy: int) -> Blocks:
    box = box or ((0,) * len(full), full)
    shape = tuple(b - a for a, b in zip(*box))
    cuts = []
    for d in range(len(full)):
        tensor_cuts = (
            shard_cuts(full[d], d == 0 and bool(policy & 8), d == 1 and bool(policy & 16))
            if d < 3 and policy >> d & 1
            else []
        )
        cuts.append([c - box[0][d] for c in tensor_cuts if box[0][d] < c < box[1][d]])
    edges = [[0, *c, n] for c, n in zip(cuts, shape)]
    boxes = [((), ())]
    for e in edges:
        boxes = [(s + (a,), t + (b,)) for s, t in boxes for a, b in itertools.pairwise(e)]
    runs = [_runs(shape, b) for b in boxes]
    row_ptr = np.concatenate([[0], np.cumsum([r.size for r in runs])]).astype(np.int64)
    run = np.array([b[1][-1] - b[0][-1] for b in boxes], dtype=np.int64)
    sizes = np.array([math.prod(t - s for s, t in zip(*b)) for b in boxes], dtype=np.int64)
    out = Blocks(shape, boxes, sizes, np.concatenate(runs).astype(np.int64), row_ptr, run, cuts)
    for a in (out.sizes, out.rows, out.row_ptr, out.run):
        a.flags.writeable = False
    return out


def box_of(flat: np.ndarray, shape, box: Box) -> np.ndarray:
    """The elements of a part's flat row-major array that lie in ``box``, in the box's row-major order."""
    shape = tuple(int(s) for s in shape) or (1,)
    return flat.reshape(shape)[tuple(slice(a, b) for a, b in zip(*box))].reshape(-1)
