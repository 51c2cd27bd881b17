"""A trainer that scales out: every rank publishes the rows it holds, nobody gathers the model.

One :class:`ShardedPublisher` per trainer rank (FSDP2 ``fully_shard``, pipeline or expert
parallel, or a mix: :mod:`engine_ext.trainer.shards`). Each keeps the bits of its own
rows only (``model / world`` in the served dtype), diffs them on their own device and
encodes in the background, like :class:`~engine_ext.trainer.publisher.DeltaPublisher`,
whose snapshot, diff, encode and anchor code it runs on what the rank holds (its
:class:`~engine_ext.trainer.holdings.RankRows`: a tensor several ranks hold is cut at their row
boundaries, every cell inside one rank's rows: docs/FORMAT.md, "Sharded versions"); what differs
is how a version is committed:

1. every rank tells the others what it will publish of the version (an anchor, a delta
   on which base): a part is published only where all ranks have it, on a committed base;
2. for a delta, the ranks sum their step histograms, so all code against the same
   step tables;
3. each rank writes its blobs (keys ``…r{rank}…``) and sends rank 0 its part of the
   manifest (partial fingerprints, its chunks); rank 0 joins them
   (:func:`~engine_ext.trainer.builder.merge_parts`) and writes the one signed manifest
   and ``LATEST`` only when every rank's part is in. A version of more entries than a
   manifest inlines is tabled by the ranks instead: each validates the tensors it publishes
   whole and writes their tables into a blob of its own, and sends rank 0 only their
   references, name keys and its share of the model fingerprints; rank 0 joins the split
   tensors alone and writes the name index (:mod:`~engine_ext.trainer.table_parts`: a
   Kimi-K2 commit no longer touches a million chunks on one rank);
4. rank 0 tells every rank whether the version was committed.

These run on each publisher's background thread, in version order, over a gloo process
group of its own (the training thread's collectives on the default group go on at the
same time). Another publisher that took a version of the store (a ConflictError at rank 0's
commit) stops every rank for good, as it stops a DeltaPublisher. A rank that fails its part
(an exception) aborts the version on every rank:
nothing is committed, ``LATEST`` stays, and the next version is an anchor (deltas queued
on the aborted version are dropped: their base was never published). A rank that dies
or hangs breaks the group: its peers' collectives fail (or time out after ``timeout_s``),
nothing more is committed, and :meth:`ShardedPublisher.publish` raises on every survivor;
a restarted trainer (of any world size) continues after the store's highest version with a
delta against LATEST, where every rank can rebuild its rows of LATEST from the store and the
ranks' partial fingerprints prove them, else with an anchor.
"""

from __future__ import annotations

import functools
import math
from datetime import timedelta

import numpy as np
import torch

from .. import settings
from ..errors import ConflictError, DeltaError
from ..format import codec
from ..format import fingerprint as fpr
from ..format.dtypes import dtype_by_name, served_as
from ..format.manifest import ANCHOR, DELTA, manifest_key
from . import lineage, table_parts
from .blob_layout import section_dim
from .builder import blob_tag, commit, merge_parts
from .checkpoint_layout import checkpoint_names, transformers_model
from .holdings import RankRows
from .publisher import DeltaPublisher, log
from .shards import Placement, agree, held_tensors, in_checkpoint_layout, rows
from .upload_worker import UploadJob

SHARDED = "sharded"


class GroupFailed(DeltaError):
    """The publishers' process group failed (a rank died, hung past the timeout, or left): no more
    versions can be committed by this trainer; restart it (it resumes after the store's LATEST)."""


class ShardedPublisher(DeltaPublisher):
    """Publish versions of a model whose ranks each hold part of it: one instance per rank.

    Construct it on every rank of the default process group at the same point (it creates
    its own gloo group: a collective), then call :meth:`publish` with the rank's model or
    state dict after every optimizer step, on every rank, in the same order. Without an
    initialised process group it publishes alone (world 1), like a DeltaPublisher.

    Args (besides :class:`DeltaPublisher`'s, which apply per rank):
        group: the process group of the publishers (default: a new gloo group over all ranks).
        timeout_s: how long a rank waits for the others at each step of a commit.
        (``checkpoint_layout`` is DeltaPublisher's, applied per rank and row by row: publishing a
        transformers model converts its rows to the layout the engines load, e.g. a transformers 5
        MoE's fused experts to the Hub's per-expert tensors; a state dict is published as named
        unless ``checkpoint_layout=model``.)
        (``dtype``, the served dtype, is DeltaPublisher's: bf16 by default; the held tensors are cast
        to it one tensor at a time, on the training thread.)
    """

    def __init__(self, store, model: str = "model", *, group=None, timeout_s: float = 1800.0, **kwargs):
        import torch.distributed as dist

        if kwargs.get("quantize") is not None:
            raise ValueError("quantize is not supported by the sharded publisher (fp8 blocks span the ranks' rows)")
        if kwargs.get("catch_up_spans"):
            raise ValueError(
                "catch_up_spans is not supported by the sharded publisher (a catch-up is one manifest over every "
                "rank's rows): run `engine-ext compact STORE --spans ...` beside the trainer instead"
            )
        self.group = None
        self._own_group = group is None
        self.rank = 0
        self.world = 1
        if dist.is_available() and dist.is_initialized():
            if group is None:
                group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.group = group
            self.rank = dist.get_rank(self.group)
            self.world = dist.get_world_size(self.group)
        self.layout: dict[str, Placement] | None = None  # agreed at the first publish
        self._views: list | None = None  # every rank's view of what it holds (Held.describe), at the first publish
        self._committed: set[int] = set()  # versions with a committed manifest (the same on every rank)
        self.committed_fingerprint: int | None = None  # the model fingerprint of the last version committed
        self.aborted: dict[int, str] = {}  # version -> why it was not committed
        self._needs_anchor = False
        self._broken: GroupFailed | None = None
        self._split: frozenset[str] | None = None  # the tensors several ranks publish rows of (from the layout)
        self._keys: np.ndarray | None = None  # every tensor's name key, sorted (rank 0, once)
        super().__init__(store, model, **kwargs)
        # every rank continues from rank 0's view of the store
        self.head, self.next_version = self._broadcast((self.head, self.next_version))

    # -- trainer-facing -------------------------------------------------------
    def publish(self, model_or_state_dict, version: int | None = None) -> str:
        """Snapshot this rank's changes since the last version and queue them; returns the URI the
        version's manifest will have (committed only if every rank's part is written)."""
        if self._broken is not None:
            raise RuntimeError(f"publishing failed: {self._broken}") from self._broken
        self._uploads.raise_pending()
        in_memory = held_tensors(model_or_state_dict)
        model = self.checkpoint_layout
        if model == "auto":
            model = transformers_model(model_or_state_dict)
        held = in_checkpoint_layout(in_memory, model)
        if self.layout is None:
            self._agree_layout(held)  # a collective on the training thread: no job is queued yet
            published = set()
            for h in in_memory.values():
                published.update(checkpoint_names(model, h.name, h.shape, h.tensor.dtype))
            missing = published - set(self.layout)
            if missing:
                raise ValueError(
                    f"{len(missing)} checkpoint tensor(s) of what this rank holds are published by no "
                    f"rank: {sorted(missing)[:5]} (the ranks' rows do not cover the model)"
                )
        sd = self._owned(held)
        self.last_numel = sum(t.numel() for t in sd.values())  # what this rank publishes (in the served dtype)
        self.last_nbytes = sum(t.numel() * self._holding.describe(n, t).dtype.itemsize for n, t in sd.items())
        version = self.next_version if version is None else version
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} must be above the last published {self.version}")
        if version < self.head.next_version:
            raise ValueError(
                f"version {version}: {self.store.uri} already holds versions up to v{self.head.next_version - 1}"
            )
        if self.version is None and self.head.latest is not None:
            self._resume_from_rows(sd, version)  # a collective: every rank rebuilds its rows of LATEST, or none does
        first = self.version is None
        if not first:
            self._kept.wait_free()  # an anchor may still be being written from the kept bits
            self._uploads.raise_pending()
            first = not self._fps  # the first anchor was never written, nor were its fingerprints computed
        forced = self._needs_anchor or self._uploads.restart_chain  # a version failed (aborted, or raised here)
        self._uploads.restart_chain = False
        anchor = first or forced or bool(self.anchor_every and version % self.anchor_every == 0)
        delta = None
        if first:
            self._remember(sd)
            self.last_changed = sum(t.numel() for t in sd.values())
        else:
            delta = self._snapshot_delta(sd, version)  # the kept bits and fingerprints move to this version
            if forced:  # the last version was not committed: this one is an anchor, its delta has no base
                for _ in range(delta.holds):
                    self._kept.release()
                delta = None
        a = None
        if anchor:
            self.anchor_version = version
            a = self._snapshot_anchor(sd, version, first)
        holds = (a.holds if a else 0) + (delta.holds if delta else 0)
        job = UploadJob(SHARDED, version, self.version, self.anchor_version, (a, delta), holds)
        self.version = version
        self.next_version = version + 1
        self._uploads.put(job)  # blocks when uploads fall behind: backpressure
        return self.store.key_uri(manifest_key(version, DELTA if delta is not None else ANCHOR))

    def _resume_from_rows(self, sd: dict, version: int) -> None:
        """Before the first version on a store that holds versions: every rank rebuilds the rows it
        publishes of LATEST's weights from the store (:func:`~engine_ext.trainer.lineage.rebuild_rows`:
        only the cells that meet them, whatever world size wrote them), and the ranks' partial
        fingerprints, summed, must give every tensor's fingerprint in LATEST's manifest; then the
        first version is a delta against LATEST on every rank. Otherwise (a rank could not, or
        ``resume='anchor'``) it is an anchor on every rank. Records which in :attr:`resumed`."""
        latest = self.head.latest
        mine = None  # this rank's partial fingerprints of LATEST's rows, or why it could not rebuild them
        why = None  # why the first version is an anchor
        if self.resume != "anchor":
            try:
                spans = {}
                for n, t in sd.items():
                    d = self._holding.describe(n, t)
                    spans[n] = lineage.Span(d.shape, d.dtype, d.first_row, d.first_row + rows(t.shape))
                rebuilt = lineage.rebuild_rows(self.store, latest, self.trust, spans)
                mine = rebuilt.fingerprints
            except DeltaError as e:
                mine = f"rank {self.rank}: {str(e)[:300]}"
        views = self._all_gather(mine, "resuming")  # every rank read the same LATEST (rank 0's, broadcast)
        if self.resume == "anchor":
            why = "resume='anchor'"
        elif failed := [v for v in views if isinstance(v, str)]:
            why = "; ".join(failed)[:2000]
        else:
            total: dict[str, int] = {}
            for partial in views:
                for n, fp in partial.items():
                    total[n] = (total.get(n, 0) + fp) & fpr.MASK64
            want = {t.name: fpr.parse(t.fingerprint) for t in rebuilt.target.manifest.tensors}
            if total != want:
                differ = sorted(n for n in set(total) | set(want) if total.get(n) != want.get(n))
                why = f"{len(differ)} tensor(s) rebuilt from the ranks' rows differ from LATEST's: {differ[:5]}"
        if why is not None:
            if self.resume == "delta":
                raise ValueError(f"cannot resume {self.store.uri} with a delta against v{latest.version}: {why}")
            if self.resume != "anchor":
                why = f"LATEST's weights cannot serve as the base: {why}"
            self.resumed = lineage.Resumed(latest.version, version, "anchor", why)
            return
        for n, t in sd.items():  # the kept bits: the rows' raw bits in the served dtype, where _remember keeps them
            self._prev[n] = rebuilt.bits[n].to("cpu" if self.keep_on_cpu else t.device)
        self._fps = dict(rebuilt.fingerprints)
        self.version = latest.version
        self.anchor_version = rebuilt.target.manifest.anchor_version
        self._manifest_shas[latest.version] = list(rebuilt.manifests)
        self._committed = {latest.version}
        self.committed_fingerprint = fpr.parse(rebuilt.target.manifest.fingerprint)
        self.resumed = lineage.Resumed(
            latest.version,
            version,
            "delta",
            "LATEST's rows rebuilt from the store on "
            "every rank, every tensor's fingerprint proven by the ranks' partials",
        )

    @property
    def fingerprint(self) -> int | None:
        """The model fingerprint of the last version committed (after :meth:`wait`; None before any)."""
        return self.committed_fingerprint

    def close(self) -> None:
        import torch.distributed as dist

        super().close()
        if self.group is not None and self._own_group and self._broken is None:
            dist.destroy_process_group(self.group)
            self.group = None

    # -- what this rank holds and publishes ----------------------------------------
    def _agree_layout(self, held: dict) -> None:
        """Agree with the other ranks who publishes which rows (a collective), and hold those rows."""
        self._views = self._all_gather([h.describe() for h in held.values()], "the first publish")
        self.layout = agree(self._views)
        starts = {name: h.start for name, h in held.items() if self.layout[name].owned(self.rank, h.start)}
        self._holding = RankRows(self.layout, starts, self.dtype, self.chunk_min_cell)

    def _owned(self, held: dict) -> dict[str, torch.Tensor]:
        """The tensors (local rows) this rank publishes; the same tensors, rows and dtypes every version."""
        view = [h.describe() for h in held.values()]
        if view != self._views[self.rank]:
            raise ValueError(
                "the tensors this rank holds changed since the first version (names, shapes, rows or "
                "dtypes): a new layout needs a new publisher"
            )
        return {name: h.tensor for name, h in held.items() if self.layout[name].owned(self.rank, h.start)}

    @property
    def model_nbytes(self) -> int:
        """The whole model in the served dtype, every rank's rows (what a dense sync sends per version)."""
        return sum(
            math.prod(p.shape) * served_as(dtype_by_name(p.dtype), self.dtype).itemsize
            for p in (self.layout or {}).values()
        )

    # -- background: one job per version, the same collectives on every rank -------------
    def _build(self, job: UploadJob) -> None:
        if self._broken is not None:
            raise self._broken
        try:
            self._commit_version(job)
        except GroupFailed as e:
            self._broken = e
            self._needs_anchor = True
            raise

    def _commit_version(self, job: UploadJob) -> None:
        anchor, delta = job.payload
        views = self._all_gather(
            (job.version, anchor is not None, None if delta is None else delta.base_version), f"v{job.version}"
        )
        if any(v[0] != job.version for v in views):
            raise GroupFailed(f"the ranks published different versions at once: {sorted({v[0] for v in views})}")
        if any(v[1] for v in views):
            if all(v[1] for v in views):
                self._part(job.version, ANCHOR, lambda: self._anchor_part(anchor))
            else:
                self._abort(
                    job.version, "an anchor, but not on every rank (some had not yet learnt that a version failed)"
                )
        if any(v[2] is not None for v in views):
            bases = {v[2] for v in views}
            if len(bases) == 1 and None not in bases and bases <= self._committed:
                self._part(job.version, DELTA, lambda: self._delta_part(delta))
            else:
                self._abort(
                    job.version,
                    f"a delta on a base that was not committed (v{min(bases, key=str)}) or not on every rank",
                )

    def _anchor_part(self, anchor: UploadJob):
        b = self._builder(anchor, part=self._part_no())
        self._write_anchor(b, anchor)
        return b

    def _delta_part(self, delta: UploadJob):
        agreed = []

        def tables(histograms: dict) -> dict:
            agreed.append(True)
            return self._sum_tables(histograms, delta.version)

        try:
            b = self._builder(delta, part=self._part_no())
            self._encoder.write(b, delta.payload, tables)
            return b
        except GroupFailed:
            raise
        except Exception:
            if not agreed:
                self._sum_tables(None, delta.version)  # the others wait for this rank's share of the histograms
            raise

    def _sum_tables(self, histograms: dict | None, version: int) -> dict:
        """The version's step tables, from every rank's step histograms summed (None: this rank failed
        before it had any; the others still get theirs)."""
        total: dict = {}
        for h in self._all_gather(histograms, f"v{version}'s step tables"):
            for dtype, counts in (h or {}).items():
                total[dtype] = counts if dtype not in total else total[dtype] + counts
        return codec.step_tables_from(total)

    def _part(self, version: int, kind: str, write) -> None:
        """Write this rank's part (``write()``: its builder, blobs spooled, or an exception), upload it and
        hand it to rank 0, which commits the version when every part is in; every rank learns the outcome.
        A version of more entries than a manifest inlines (the parts' entries and chunks summed) is
        published in tables, each rank writing those of the tensors it publishes whole
        (:mod:`~engine_ext.trainer.table_parts`)."""
        b, mine = None, None
        try:
            b = write()
            b.name_blobs()
            m = b.manifest
            whole = any(not self.layout[t.name].split for t in m.tensors)
            shared = any(t.chunks is not None and section_dim(t.name, t.shape, t.grid) is not None for t in m.tensors)
            view = (len(m.blobs), m.entries, whole, settings.current().inline_entries, shared)
        except GroupFailed:
            raise
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which aborts the version on every rank
            log.error("engine_ext: rank %d failed its part of v%d (%s): %s", self.rank, version, kind, e)
            b, view, mine = None, None, f"rank {self.rank}: {type(e).__name__}: {e}"
        views = self._all_gather(view, f"v{version} ({kind})'s parts")
        if b is not None and None not in views:  # else another rank failed: this one uploads nothing
            try:
                mine = b.upload(self.store, write_tables=self._table_writer(views, version, kind))
            except Exception as e:  # noqa: BLE001 - as above
                log.error("engine_ext: rank %d failed its part of v%d (%s): %s", self.rank, version, kind, e)
                mine = f"rank {self.rank}: {type(e).__name__}: {e}"
        elif b is not None:
            b.tmp.cleanup()
        parts = self._gather(mine, f"v{version} ({kind})")
        outcome = None
        if self.rank == 0:
            outcome = self._commit_parts(parts, version, kind)
        ok, why, fingerprint, lost = self._broadcast(outcome, f"v{version} ({kind})")
        if lost:  # another publisher holds this store's version: every rank stops (DeltaPublisher's rule)
            self._abort(version, why)
            raise ConflictError(why)
        if ok:
            self._committed = {v for v in self._committed if v > version - 16} | {version}  # bases are recent
            self.committed_fingerprint = fingerprint
            if kind == ANCHOR:
                self._needs_anchor = False
        else:
            self._abort(version, why)

    def _table_writer(self, views: list[tuple], version: int, kind: str):
        """How this rank writes its tables of a version whose parts are ``views`` (every rank's blob count,
        entries, whether it publishes a tensor whole, its inline limit, and whether it has cells to share out
        by TP share): None where the version is published inline. Every rank decides by rank 0's limit and
        ``ENGINE_EXT_READER_TP``, and shares cells out if any rank has some (format 12), so all decide alike."""
        if sum(v[1] for v in views) <= views[0][3]:
            return None
        shift = sum(v[0] + bool(v[2]) for v in views[: self.rank])  # the blobs of the ranks before
        return functools.partial(
            table_parts.write_part,
            split=self._split_names(),
            shift=shift,
            tag=blob_tag(version, kind, self._part_no()),
            per=table_parts.per_table(len(self.layout), self.world),
            shares=settings.current().reader_tp if any(v[4] for v in views) else 0,
        )

    def _commit_parts(self, parts: list, version: int, kind: str) -> tuple:
        failed = [p for p in parts if isinstance(p, str)]
        if failed or None in parts:
            return False, "; ".join(failed)[:2000] or "a rank did not upload its part", None, False
        try:
            with self._heartbeat.moving_latest():
                if isinstance(parts[0], table_parts.TablesPart):
                    _, sha, latest = table_parts.commit_tables(
                        self.store,
                        parts,
                        [n for n in self.layout if n in self._split_names()],
                        self._model_keys(),
                        self.signer,
                        self.latest_ttl_s,
                        table_parts.per_table(len(self.layout), self.world),
                    )
                else:
                    _, sha, latest = commit(
                        self.store, merge_parts(parts, list(self.layout)), self.signer, self.latest_ttl_s
                    )
                self._heartbeat.wrote(latest)
            self._published(version, sha)
            return True, "", fpr.parse(latest.fingerprint), False
        except Exception as e:  # noqa: BLE001 - nothing (or, past the manifest, a stale LATEST) was written
            log.error("engine_ext: committing v%d (%s) failed: %s", version, kind, e)
            return False, f"rank 0 could not commit: {type(e).__name__}: {e}", None, isinstance(e, ConflictError)

    def _split_names(self) -> frozenset[str]:
        """The tensors several ranks publish rows of (rank 0 joins them)."""
        if self._split is None:
            self._split = frozenset(n for n, p in self.layout.items() if p.split)
        return self._split

    def _model_keys(self) -> np.ndarray:
        """Every tensor's name key, sorted: what the ranks' tables must list (made once: 140 k names at K2 size)."""
        if self._keys is None:
            self._keys = np.sort(fpr.name_keys(list(self.layout)))
        return self._keys

    def _abort(self, version: int, why: str) -> None:
        """A part of ``version`` was not committed: unless its other part was (its anchor, published
        beside the delta), nothing holds its bits, so the next version is an anchor."""
        self.aborted[version] = why
        if version not in self._committed:
            self._needs_anchor = True
            log.error("engine_ext: v%d was not published (%s); the next version is an anchor", version, why)
        else:
            log.error("engine_ext: v%d's delta was not published (%s); its anchor was", version, why)

    def _part_no(self) -> int | None:
        return self.rank if self.world > 1 else None

    # -- collectives on the publishers' own group (background thread, version order) -------
    def _collective(self, what: str, fn):
        if self.group is None:
            return fn()
        try:
            return fn()
        except Exception as e:  # gloo: a peer closed its connection, or the timeout passed
            raise GroupFailed(
                f"rank {self.rank}: the trainer's publishers lost each other at {what} "
                f"({type(e).__name__}: {str(e)[:300]}); nothing more is committed: restart the "
                "trainer (it resumes after the store's LATEST)"
            ) from e

    def _all_gather(self, obj, what: str = "a version") -> list:
        import torch.distributed as dist

        if self.group is None:
            return [obj]
        out = [None] * self.world
        self._collective(what, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def _gather(self, obj, what: str) -> list | None:
        import torch.distributed as dist

        if self.group is None:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        self._collective(
            what, lambda: dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        )
        return out

    def _broadcast(self, obj, what: str = "the start"):
        import torch.distributed as dist

        if self.group is None:
            return obj
        box = [obj]
        self._collective(
            what, lambda: dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        )
        return box[0]


__all__ = ["GroupFailed", "ShardedPublisher"]
