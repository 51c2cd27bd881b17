"""One delta pipeline: from the changes of each tensor to encoded, tabled entries of a version.

Every writer of a delta (:class:`~engine_ext.trainer.publisher.DeltaPublisher`, a sharded
trainer's rank, ``engine-ext diff``) diffs its tensors its own way, then hands the changes, one
:class:`TensorChange` per tensor, to :meth:`DeltaEncoder.write`, which:

1. decides, per tensor, whether the context coder is tried: it has a block policy and a sample of
   its base promises a gain (uniform changes skip it: no step table, no pass over the base);
2. starts the plain encodes at once (they need nothing more);
3. builds the version's step tables from the tried tensors' step histograms: ``agree`` turns the
   histograms into tables (one process: :func:`engine_ext.format.codec.step_tables_from`; a sharded
   trainer sums every rank's first, so all ranks code against the same tables);
4. encodes the tried tensors against their base with those tables;
5. adds every tensor to the :class:`~engine_ext.trainer.builder.VersionBuilder` in order, each hashed
   and appended as soon as its encoding is done (with its dtype's step tables where context coded).

The same inputs give the same bytes whichever writer runs it, and whether a tensor's encode was
started early (:meth:`DeltaEncoder.start`, while the trainer diffs the next tensors) or here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import torch

from ..format import chunks, codec
from ..format.context.blocks import shard_dim
from ..format.dtypes import DType
from .builder import VersionBuilder


@dataclass
class ContextBase:
    """Where the context coder reads a changed tensor's base from: the tensor's flat bits of either
    version (they differ only at the changes: the coder puts the old bits back part by part, so a
    publisher hands the bits it keeps without a copy)."""

    policy: int  # the tensor's block policy (:func:`engine_ext.format.codec.context_policy`)
    read: Callable[[], torch.Tensor]  # the bits: a publisher's kept bits; the command line reads OLD's tensor again
    origin: int = 0  # the first row of the tensor the bits hold (a sharded trainer's rank holds rows)
    known_to_pay: bool = False  # a sample already promised a gain (the caller held the bits then): not asked again


@dataclass
class TensorChange:
    """One tensor's changes between two versions: what its entry in the delta is made of."""

    name: str
    dtype: DType  # as served
    shape: tuple  # the whole tensor's
    positions: torch.Tensor  # CPU int64: flat indices into the whole tensor, sorted
    old_bits: torch.Tensor  # CPU raw bits at ``positions``, in the base
    new_bits: torch.Tensor  # CPU raw bits at ``positions``, in the new version
    base_fp: int  # the tensor's fingerprint in the base
    fp: int  # and in the new version
    context: ContextBase | None = None  # None: the context coder is not tried on it
    # the grid it is cut into (None: the publisher's, :meth:`DeltaEncoder.cuts`)
    cuts: list[list[int]] | None = None
    early: Future | None = None  # :meth:`DeltaEncoder.start`'s, while the next tensors were diffed

    def context_pays(self) -> bool:
        """Whether the context coder is worth trying (a sample of the base decides: cheap)."""
        if self.context is None:
            return False
        if self.context.known_to_pay:
            return True
        return codec.context_pays(self.dtype, self.context.read(), self.old_bits)

    def context_with(self, tables: dict[str, list[bytes]]) -> codec.Context | None:
        """The context coder's inputs, with the version's step tables (None: no tables for its dtype)."""
        if self.context is None or not tables.get(self.dtype.name):
            return None
        return codec.Context(
            self.context.read().reshape(-1), self.context.policy, tables[self.dtype.name], origin=self.context.origin
        )


@dataclass
class EarlyStart:
    """What :meth:`DeltaEncoder.start` learnt of a change as soon as it was diffed."""

    context_tried: bool  # then its encode waits for the version's step tables
    plain: object | None  # its plain encoding where the context coder is not tried (None: unchanged)


def _ready(value) -> Future:
    """A future already holding ``value`` (an encoding that is done)."""
    future: Future = Future()
    future.set_result(value)
    return future


@dataclass
class _Deferred:
    """An encode that runs when its result is asked for (no pool: one encoding held at a time)."""

    fn: Callable
    args: tuple

    def result(self):
        return self.fn(*self.args)


class _InOrder:
    """The executor of a writer without a pool (the command line): each encode runs when the builder
    takes its result, in the order of the tensors, so a big model's encodings are never all held."""

    def submit(self, fn: Callable, *args) -> _Deferred:
        return _Deferred(fn, args)


class DeltaEncoder:
    """Encodes the changes of a version's tensors into a :class:`VersionBuilder` (module docstring).

    Args:
        mode: None (the smaller of abs/rel values per tensor), "abs" or "rel".
        chunk_min_cell: big tensors are encoded per grid cell of at least this many elements
            (None: never cut; a change's own ``cuts`` impose its grid).
        pool: where the encodes run (all cores); None: one after another, as the builder takes them.
    """

    def __init__(
        self, mode: str | None = None, chunk_min_cell: int | None = chunks.MIN_CELL, pool: Executor | None = None
    ):
        self.mode = mode
        self.chunk_min_cell = chunk_min_cell
        self.pool = pool

    def encode(self, change: TensorChange, context: codec.Context | None = None):
        """A change's encoding (None: unchanged), as :func:`engine_ext.format.codec.encode_tensor` gives it."""
        if change.positions.numel() == 0:
            return None
        return codec.encode_tensor(
            change.dtype,
            change.shape,
            change.positions,
            change.new_bits,
            change.old_bits,
            self.mode,
            self.chunk_min_cell,
            context,
            self.cuts(change),
        )

    def cuts(self, change: TensorChange) -> list[list[int]] | None:
        """The grid a change is cut into: its own (a sharded trainer's rows), else the default grid with its
        parts along the dimension the engines shard the tensor, where its name says which
        (:func:`engine_ext.format.chunks.grid`'s ``along``: a TP rank then fetches its share, not twice it)."""
        if change.cuts is not None or self.chunk_min_cell is None:
            return change.cuts
        return chunks.grid(change.shape, self.chunk_min_cell, along=shard_dim(change.name, change.shape))

    def start(self, change: TensorChange) -> None:
        """Start a change's encode on the pool as soon as it is diffed (it overlaps the next tensors' diff).
        A change the context coder is tried on only learns that here: it waits for the version's step
        tables, built from every tensor's changes (:meth:`write`)."""
        change.early = self.pool.submit(self._start, change)

    def _start(self, change: TensorChange) -> EarlyStart:
        if change.context_pays():
            return EarlyStart(True, None)
        return EarlyStart(False, self.encode(change))

    def _encode_in_context(self, change: TensorChange, tables: dict[str, list[bytes]]):
        # The base is read where the encode runs: a writer without a pool reads one tensor's base at a time.
        return self.encode(change, change.context_with(tables))

    def write(
        self,
        builder: VersionBuilder,
        changes: list[TensorChange],
        agree: Callable[[dict], dict[str, list[bytes]]] = codec.step_tables_from,
    ) -> None:
        """Encode every change into ``builder``, each hashed and appended in order as soon as it is encoded;
        ``agree(histograms)`` gives the step tables. An encode started early gives the bytes encoding here
        would: the same function of the same inputs (only context-coded tensors need the tables)."""
        executor = self.pool if self.pool is not None else _InOrder()
        starts = [None if c.early is None else c.early.result() for c in changes]
        # Whether the context coder is tried on each: known where it started early, else a sample of each (cheap).
        tried = [c.context_pays() if s is None else s.context_tried for c, s in zip(changes, starts)]
        # The plain encodes start now, and go on while the tables are agreed.
        pending: list = []
        for c, s, t in zip(changes, starts, tried):
            if t:
                pending.append(None)
            elif s is None:
                pending.append(executor.submit(self.encode, c, None))
            else:
                pending.append(_ready(s.plain))
        # The step tables come from the tensors whose sample promises a gain (none where changes are uniform).
        histograms = codec.step_histograms((c.dtype, c.old_bits, c.new_bits) for c, t in zip(changes, tried) if t)
        tables = agree(histograms)
        for i, (c, t) in enumerate(zip(changes, tried)):
            if t:
                pending[i] = executor.submit(self._encode_in_context, c, tables)
        for c, p in zip(changes, pending):
            encoding = p.result()
            if encoding is None:
                builder.add_unchanged(c.name, c.dtype, c.shape, c.fp)
            else:
                builder.add_encoded(c.name, c.dtype, c.shape, c.positions.numel(), encoding, c.base_fp, c.fp)
                if codec.uses_context(encoding):
                    builder.add_step_tables(c.dtype.name, tables[c.dtype.name])
            c.early = None  # its encoding is in the builder: not held twice
