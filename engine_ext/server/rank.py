"""The per-rank half of an update, engine-agnostic: map, fetch its part, apply in place, verify, undo.

A :class:`RankUpdater` lives in every rank (vLLM worker, SGLang scheduler). At start-up
it asks the layout probe where the model's own weight loader puts each checkpoint
element on this rank (:mod:`engine_ext.server.layout`) and fingerprints the live weights
through those maps. For an update, the driver sends the verified manifests of the route;
each rank fetches straight from the store only the tensors, or grid cells of them
(:mod:`engine_ext.format.chunks`), that meet what it holds, verifies and decodes them in a
background thread while the engine keeps serving (:meth:`RankUpdater.fetch`), so no
rank reads what another holds and nothing passes through the driver. An apply writes
the fetched delta in place through
:func:`engine_ext.server.apply.apply_delta` with an undo log; tensors the probe could not map
are rebuilt on the host and reloaded densely through the engine's loader. Derived
state (re-packed copies of weights) is refreshed through a hook. The driver of the
update (:mod:`engine_ext.server.transaction`) combines the per-rank fingerprints and then
calls :meth:`RankUpdater.commit` or :meth:`RankUpdater.rollback` on every rank.

:func:`run_op` is the one entry every engine adapter calls with an op name from the
wire: it never raises, and answers a :class:`~engine_ext.server.protocol.RankReply` as plain
data, so that a failing rank lets the driver roll the others back.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .. import settings
from ..errors import (
    AuditUnavailable,
    BaseMismatchError,
    IntegrityError,
    OutOfOrderError,
    QueueFull,
    RollbackError,
    UnreproducibleError,
    UnsupportedError,
    VerifyError,
)
from ..format import fingerprint as fpr
from ..format.delta import TensorDelta, apply_tensor
from ..format.dtypes import DType
from .apply import apply_delta
from .maps import ApplyResult, TensorMap, Unmappable, checkpoint_view, covered_elements, local_fingerprint
from .protocol import RankReply, TensorReport
from .touched import Touched

log = logging.getLogger("engine_ext")

Loader = Callable[[str, torch.Tensor], None]  # load one whole checkpoint tensor via the engine's loader
Refresh = Callable[["Touched | None"], None]  # rebuild derived copies of what an apply wrote; None: of everything
Describe = Callable[[], dict]  # the engine's kernels/paths on this rank, for the start-up log and status
# The audit of derived copies, {"checked": n, "opaque": n, "stale": [layer names]}: of every layer, or of those a
# Touched wrote (``sample``: one of each kind)
CheckDerived = Callable[..., dict]
# {checkpoint tensor: why} for tensors whose served form no refresh keeps in step (given the maps): refused
FindUnreproducible = Callable[[dict], dict]
# The served model against a cold instance built from a checkpoint directory (the cold-load audit): {"ok", ...}
CompareCold = Callable[[str], dict]
OPS = (
    "setup",
    "fetch",
    "fetched",
    "apply",
    "discard",
    "commit",
    "rollback",
    "status",
    "resync",
    "audit",
    "forget",
    "set_label",
    "cold_audit",
)
DECODE_BACKENDS = ("auto", "host", "device")
MAX_FETCHES = 8  # fetches a rank holds at once (the driver's queue bound keeps it lower)


@dataclass
class _Fetch:
    """One update's part on this rank, fetched and decoded in a background thread."""

    thread: threading.Thread | None = None
    deltas: list[TensorDelta] = field(default_factory=list)
    names: set[str] = field(default_factory=set)  # changed tensors this rank holds (reported after the apply)
    bytes: int = 0
    error: BaseException | None = None
    fps: dict[str, int] = field(default_factory=dict)  # this rank's fingerprints the part was decoded against


@dataclass
class _Pending:
    """An applied update awaiting commit or rollback: what rollback restores."""

    result: ApplyResult  # its undo log restores the in-place writes
    old_fps: dict[str, int]
    old_host: dict[str, torch.Tensor]  # dense-fallback tensors as they were
    touched: Touched | None  # refreshed after a rollback (None: all)


class RankUpdater:
    """This rank's maps, fingerprints and pending undo.

    ``checkpoint``: {name: (shape, dtype)} of the served checkpoint; ``read_checkpoint``
    reads one tensor of it (the dense fallback starts from it); ``refresh`` rebuilds
    derived copies of the storages an apply wrote; ``describe`` reports the engine's paths;
    ``check_derived`` compares every derived copy with a fresh derivation (for :meth:`audit`);
    ``compare_cold`` compares the served model with a cold instance built from a checkpoint (:meth:`cold_audit`).
    ``decode_backend``: where context-coded parts are decoded: "auto" where the weights
    live (on an accelerator in Triton, on the host in numba), "host" always on the host,
    "device" always through the Triton pass (on CPU weights only under ``TRITON_INTERPRET=1``:
    tests). ``apply_backend``: :func:`engine_ext.server.apply.apply_delta`'s backend.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        load: Loader,
        checkpoint: dict[str, tuple[tuple[int, ...], DType]],
        read_checkpoint: Callable[[str], torch.Tensor] | None = None,
        refresh: Refresh | None = None,
        rank: int = 0,
        describe: Describe | None = None,
        decode_backend: str = "auto",
        apply_backend: str = "auto",
        check_derived: CheckDerived | None = None,
        find_unreproducible: FindUnreproducible | None = None,
        compare_cold: CompareCold | None = None,
    ):
        if decode_backend not in DECODE_BACKENDS:
            raise ValueError(f"decode_backend must be one of {DECODE_BACKENDS}, got {decode_backend!r}")
        self.module, self.load, self.checkpoint = module, load, checkpoint
        self.read_checkpoint, self.refresh, self.rank, self.describe = read_checkpoint, refresh, rank, describe
        self.check_derived, self.find_unreproducible = check_derived, find_unreproducible
        self.compare_cold = compare_cold
        self.decode_backend, self.apply_backend = decode_backend, apply_backend
        self.maps: dict[str, TensorMap | Unmappable] = {}
        self._boxes: dict | None = None  # boxes(): made once the maps are probed
        self.host: dict[str, torch.Tensor] = {}  # checkpoint copies of unmappable tensors (dense fallback)
        self.fps: dict[str, int] = {}  # rank-local partial fingerprints (whole for host tensors)
        self.covered: dict[str, int] = {}
        # The committed state, carried by the rank itself so that every driver that reaches it
        # (the API server's route, an in-process backend, a direct RPC) sees the same one:
        self.version: int | None = None
        self.manifest: str | None = None  # SHA-256 of the manifest the served weights came from
        self.commits = 0  # every commit and resync counts one: a driver that saw another count re-reads
        self.label: str | None = None  # the caller's own name for the served version (vLLM's weight version)
        self._pending: _Pending | None = None
        self._fetches: dict[str, _Fetch] = {}
        self.setup_s = 0.0
        self.mismatched: tuple[str, ...] = ()
        self.unreproducible: dict[str, str] = {}  # {tensor: why}: a derived copy of it that no refresh keeps in step
        self.tied: dict[str, str] = {}  # checkpoint tensors the engine ties to another and does not load: {name: kept}
        self.ties: dict[str, str] = {}  # every parameter the engine registers under two names: {second: first}

    # ---- start-up
    def setup(self) -> RankReply:
        """Probe the loader's layout and fingerprint the live weights (idempotent)."""
        if not self.maps:
            from .layout import probe_layout

            t = time.perf_counter()
            specs = [(n, tuple(s), d) for n, (s, d) in self.checkpoint.items()]
            self.maps = probe_layout(self.module, self.load, specs)
            self._leave_out_tied()
            for name, m in self.maps.items():
                if isinstance(m, Unmappable):
                    if self.read_checkpoint is None:
                        raise UnsupportedError(
                            f"{name}: unmappable ({m.reason}) and no checkpoint reader for a dense fallback"
                        )
                    self.host[name] = self.read_checkpoint(name).cpu()
                    self.fps[name] = fpr.tensor_fingerprint(self.host[name])
                    self.covered[name] = self.host[name].numel()
                else:
                    self.fps[name] = local_fingerprint(m)
                    self.covered[name] = covered_elements(m)
            if self.read_checkpoint is not None and settings.current().check_load:
                self.mismatched = tuple(self.check_load())
            if self.find_unreproducible is not None:
                self.unreproducible = dict(sorted(self.find_unreproducible(self.maps).items()))
                if self.unreproducible:
                    log.error(
                        "engine_ext: rank %s: %d tensor(s) reach copies the engine derived after loading that no "
                        "refresh keeps in step; updates writing them will be refused (409 unreproducible): %s",
                        self.rank,
                        len(self.unreproducible),
                        dict(list(self.unreproducible.items())[:4]),
                    )
            self.unreproducible.update(self._unreloadable())
            self.setup_s = time.perf_counter() - t
        return RankReply(
            True,
            self.rank,
            fingerprints=self.report(),
            fallback=tuple(sorted(self.host)),
            converted=tuple(self.converted()),
            mismatched=self.mismatched,
            unreproducible=dict(self.unreproducible),
            engine=self.describe() if self.describe else {},
            tensors={n: (tuple(s), d.name) for n, (s, d) in self.checkpoint.items()},
            tied=dict(self.tied),
            ties=dict(self.ties),
            seconds={"setup": self.setup_s},
            **self.committed(),
        )

    def _unreloadable(self) -> dict[str, str]:
        """{tensor: why} for the dense-fallback tensors whose loader raised when probed, and raises again when asked
        to reload the value it loaded at start-up (what the fallback does at every version): an update writing
        them would fail in the middle of its apply (GPT-OSS's experts on vLLM's Triton MoE path, whose parameters
        post-processing deletes), so it is refused at start-up instead. A loader that reloads it is left alone."""
        out = {}
        for name, m in self.maps.items():
            if isinstance(m, Unmappable) and name in self.host and m.reason.startswith("loader raised"):
                try:
                    self.load(name, self.host[name])
                except Exception as e:  # noqa: BLE001 - the verdict
                    out[name] = f"the engine's loader cannot reload it ({type(e).__name__}: {str(e)[:200]})"
        if out:
            log.error(
                "engine_ext: rank %s: %d dense-fallback tensor(s) cannot be reloaded through the engine's loader; "
                "updates writing them will be refused (409 unreproducible): %s",
                self.rank,
                len(out),
                sorted(out)[:8],
            )
        return out

    def _leave_out_tied(self) -> None:
        """A checkpoint tensor that the engine holds as a second name of a parameter registered
        first under another name (tied embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight``)
        and that its loader does not write is not served: the kept parameter is, under its own
        name. SGLang's loader skips the tied copy; vLLM 0.32's skips it too, and refuses it when it
        comes alone (as the probe gives it: "skipped because it is tied to ..., which was not
        found"). It leaves this rank's served set (a version holds each storage once, under the
        kept name, and need not carry the copy that some checkpoints also store), and the
        start-up says so."""
        tied = self.ties = tied_names(self.module)
        for name, m in list(self.maps.items()):
            if name in tied and (isinstance(m, Unmappable) or not any(p.numel for p in m.pieces)):
                self.tied[name] = tied[name]
                del self.maps[name], self.checkpoint[name]
                how = (
                    f"its loader refuses it alone ({m.reason[:200]})"
                    if isinstance(m, Unmappable)
                    else "its loader skips it"
                )
                log.info(
                    "engine_ext: rank %s: checkpoint tensor %s is not served on its own: the engine ties it to %s "
                    "and %s; versions carry that tensor once, as %s",
                    self.rank,
                    name,
                    tied[name],
                    how,
                    tied[name],
                )

    def committed(self) -> dict:
        """The committed state this rank carries, as RankReply fields."""
        return {"version": self.version, "manifest": self.manifest, "commits": self.commits, "label": self.label}

    def check_load(self) -> list[str]:
        """Tensors whose live weights, read through this rank's maps, differ from the checkpoint the
        engine loaded (same boxes, same fingerprint): a layout the engine derives after loading
        (a repack, a permutation) that the maps do not follow. Named at start-up, so that such a
        tensor is not first met as a bare base mismatch at the first update."""
        bad = []
        for name, m in self.maps.items():
            if (
                isinstance(m, TensorMap)
                and m.pieces
                and local_fingerprint(checkpoint_view(m, self.read_checkpoint(name))) != self.fps[name]
            ):
                bad.append(name)
        if bad:
            log.error(
                "engine_ext: rank %s: the live weights of %d tensor(s) differ from the loaded checkpoint, so "
                "updates writing them will be refused (409 unreproducible): %s",
                self.rank,
                len(bad),
                bad[:8],
            )
        return bad

    def converted(self) -> list[str]:
        """Tensors mapped through a converting piece (the engine holds a widened copy, e.g. float32 biases)."""
        return sorted(
            n
            for n, m in self.maps.items()
            if isinstance(m, TensorMap) and any(p.dest.dtype != m.dtype.torch for p in m.pieces)
        )

    def resync(self) -> RankReply:
        """Recompute the fingerprints from the live weights (after an outside dense reload; also a
        read of the live weights). The committed state is the driver's to drop (:meth:`forget`)."""
        self._refuse_pending()
        self.setup()
        for name, m in self.maps.items():
            if name not in self.host:
                self.fps[name] = local_fingerprint(m)
        return RankReply(True, self.rank, fingerprints=self.report(), **self.committed())

    def forget(self, commits: int) -> RankReply:
        """The served weights are no longer a committed version's (changed outside engine_ext, or
        the ranks disagreed): no version, manifest or label, and the commit count the driver gives
        (one for every rank, so that they agree again)."""
        self._refuse_pending()
        self.version = self.manifest = self.label = None
        self.commits = int(commits)
        return RankReply(True, self.rank, **self.committed())

    def audit(self) -> RankReply:
        """The fingerprints of the live weights, read again through the maps; nothing changes. What is
        served checked against what the bookkeeping says (an operator's audit, the chaos soak's "never
        a mix"); dense-fallback tensors report their host copy, the only copy the maps can read. The
        copies the engine derives from those weights (packed, re-laid) are what its kernels read: the
        engine's ``check_derived`` compares each with a fresh derivation (``derived``)."""
        self.setup()
        live = {
            n: fpr.tensor_fingerprint(self.host[n]) if n in self.host else local_fingerprint(m)
            for n, m in self.maps.items()
        }
        return RankReply(
            True,
            self.rank,
            pending=self._pending is not None,
            fingerprints={
                n: TensorReport(fp, self.covered[n], _numel(self.checkpoint[n][0])) for n, fp in live.items()
            },
            derived=self.check_derived() if self.check_derived is not None else {},
        )

    def cold_audit(self, checkpoint: str) -> RankReply:
        """This rank's served model against a second instance the engine builds cold from ``checkpoint``
        (its own loader and post-processing), every tensor each module holds byte for byte: what no check
        through the maps can show (a wrong map, a copy no patch knows of). Nothing served changes."""
        if self.compare_cold is None:
            raise AuditUnavailable("this engine adapter has no cold-load audit (vLLM's has)")
        if self._pending is not None:
            raise AuditUnavailable("an apply is pending on this rank: audit after it is committed or rolled back")
        return RankReply(True, self.rank, cold=self.compare_cold(checkpoint), **self.committed())

    def report(self, names: Iterable[str] | None = None) -> dict[str, TensorReport]:
        """This rank's view of each tensor's fingerprint, for the driver to combine."""
        names = self.fps if names is None else names
        return {n: TensorReport(self.fps[n], self.covered[n], _numel(self.checkpoint[n][0])) for n in names}

    # ---- fetch (while serving)
    def held(self) -> set[str]:
        """The checkpoint tensors this rank holds some of: the entries it reads of a manifest (format 10)."""
        return {n for n, boxes in self.boxes().items() if boxes is None or boxes}

    def selection(self, m) -> dict:
        """What of manifest ``m`` this rank needs: {changed tensor it holds: the grid cells that
        meet its boxes (a frozenset, maybe empty: it holds the tensor but none of its changes), or
        None for the whole tensor (not cut, or reloaded densely)}. Its keys are also the
        tensors whose fingerprints it reports after the apply (:func:`~engine_ext.store.reader.select_cells`,
        over the manifest's columns)."""
        from ..store.reader import select_cells

        sel, unknown = select_cells(m, self.boxes())
        if unknown:
            raise ValueError(f"{unknown[0]}: not a tensor of the served checkpoint")
        return sel

    def boxes(self) -> dict:
        """{checkpoint tensor: the boxes of it this rank holds ((start, stop), ...; () none), or None for the
        whole (held on the host: reloaded densely)}: made once, after the layout is probed (the maps and the
        host's names do not change after the start-up), each distinct box list one object."""
        if self._boxes is None:
            same: dict = {}
            out: dict = {}
            for name in self.checkpoint:
                if name in self.host:
                    out[name] = None
                    continue
                boxes = tuple((tuple(p.start), tuple(p.stop)) for p in self.maps[name].pieces if p.numel)
                out[name] = same.setdefault(boxes, boxes)
            self._boxes = out
        return self._boxes

    def fetch(self, txn: str, store: str, route: list[dict], timeout_s: float) -> RankReply:
        """Start fetching this rank's part of a route (manifest keys, each with the SHA-256 of the
        bytes the driver verified and a size limit) from ``store`` in a background thread;
        :meth:`fetched` tells when it is done."""
        self.setup()
        if len(self._fetches) >= MAX_FETCHES:
            raise QueueFull(f"{MAX_FETCHES} fetches already held on this rank")
        job = _Fetch()
        job.thread = threading.Thread(
            target=self._fetch,
            args=(job, store, route, time.monotonic() + timeout_s),
            name=f"engine-ext-fetch-{txn[:8]}",
            daemon=True,
        )
        self._fetches[txn] = job
        job.thread.start()
        return RankReply(True, self.rank)

    def _fetch(self, job: _Fetch, store_uri: str, route: list[dict], deadline: float) -> None:
        from ..format.delta import compose
        from ..store import open_store
        from ..store.reader import fetch_selected, open_held

        bases = _LiveBases(self)
        try:
            store = open_store(store_uri)
            store.deadline = deadline
            parts: dict[str, list[TensorDelta]] = {}
            links: dict[str, set[int]] = {}  # which links of the route changed each tensor
            held = self.held()
            for i, link in enumerate(route):
                raw = store.read(link["key"], max_bytes=link["max_bytes"])
                if hashlib.sha256(raw).hexdigest() != link["sha256"]:
                    raise IntegrityError(
                        f"{store.key_uri(link['key'])}: the manifest changed since the driver verified it"
                    )
                m, n = open_held(store, raw, held)  # its own entries (format 10); the driver checked the whole
                job.bytes += n
                sel = self.selection(m)
                job.names.update(sel)
                job.fps.update({name: self.fps[name] for name in sel if name not in job.fps})
                decoded, n = fetch_selected(store, m, sel, bases=bases)
                bases.advance(decoded)
                job.bytes += n
                for td in decoded:
                    parts.setdefault(td.name, []).append(td)
                    links.setdefault(td.name, set()).add(i)
            # one link's parts of a tensor (an absolute and a relative one) are disjoint: composed only across links
            job.deltas = [
                part for name, tds in parts.items() for part in (compose(tds) if len(links[name]) > 1 else tds)
            ]
        except BaseException as e:  # noqa: BLE001 - reported by fetched()
            job.error = e

    def fetched(self, txn: str) -> RankReply:
        """Whether this rank's part of ``txn`` is fetched (``pending``), the bytes it read, or its failure."""
        job = self._fetches[txn]
        if job.thread.is_alive():
            return RankReply(True, self.rank, pending=True, fetched_bytes=job.bytes)
        if job.error is not None:
            self._fetches.pop(txn, None)
            raise job.error
        return RankReply(True, self.rank, fetched_bytes=job.bytes)

    def discard(self, txn: str) -> RankReply:
        """Drop a fetched (or still fetching) part that will not be applied."""
        self._fetches.pop(txn, None)
        return RankReply(True, self.rank)

    # ---- apply / commit / rollback
    def apply(
        self, deltas: list[TensorDelta] | None = None, txn: str | None = None, commits: int | None = None
    ) -> RankReply:
        """Apply in place (``deltas``, or the part fetched for ``txn``), keeping an undo log until
        :meth:`commit` or :meth:`rollback`. The reply reports every changed tensor this rank holds.
        ``commits``: the commit count the driver planned from; refused if this rank moved since
        (another driver committed in between)."""
        self._refuse_pending()
        self.setup()
        if commits is not None and commits != self.commits:
            raise BaseMismatchError(
                f"the served weights changed through another door since this update was planned "
                f"(rank {self.rank} is at commit {self.commits}, the plan at {commits}); retry"
            )
        t = time.perf_counter()
        names: set[str] = set()
        if deltas is None:
            job = self._fetches.pop(txn, None)
            if job is None or job.thread.is_alive() or job.error is not None:
                raise OutOfOrderError(f"nothing fetched for update {txn}")
            deltas, names = job.deltas, job.names
            moved = sorted(n for n, fp in job.fps.items() if self.fps.get(n) != fp)
            if moved:  # context-coded parts were decoded against the weights as they were
                raise IntegrityError(
                    f"{len(moved)} tensor(s) changed on this rank since update {txn} was fetched: {moved[:5]}"
                )
        t_load = time.perf_counter() - t
        for td in deltas:
            if td.name not in self.checkpoint:
                raise ValueError(f"{td.name}: not a tensor of the served checkpoint")
        if refused := sorted({td.name for td in deltas} & (set(self.mismatched) | set(self.unreproducible))):
            raise UnreproducibleError(
                f"rank {self.rank}: the update writes {len(refused)} tensor(s) whose served form "
                f"an in-place write would not reproduce (named at start-up): {refused[:8]}"
            )
        mapped = [td for td in deltas if td.name not in self.host]
        dense = [td for td in deltas if td.name in self.host]
        old_fps = {td.name: self.fps[td.name] for td in deltas}
        t = time.perf_counter()
        res = apply_delta(mapped, self.maps, undo=True, backend=self.apply_backend)
        touched = None if dense else Touched(mapped, self.maps)
        self._pending = _Pending(res, old_fps, {}, touched)
        try:
            for name, d in res.fingerprint_delta.items():
                self.fps[name] = (self.fps[name] + d) & fpr.MASK64
            parts: dict[str, list[TensorDelta]] = {}
            for td in dense:  # a composed chain may hold an absolute and a relative part of one tensor
                parts.setdefault(td.name, []).append(td)
            for name, tds in parts.items():  # rebuild on the host, reload the whole tensor through the engine's loader
                new = self.host[name]
                for td in tds:
                    new = apply_tensor(new, td, check=td is tds[-1])
                self._pending.old_host[name] = self.host[name]
                self.load(name, new)
                self.host[name] = new
                self.fps[name] = fpr.tensor_fingerprint(new)
            self._refresh(touched)
            t_verify = self._verify_derived(touched)
        except BaseException:
            self._pending.touched = None
            self.rollback()
            raise
        t_apply = time.perf_counter() - t
        return RankReply(
            True,
            self.rank,
            written=int(sum(res.written.values())) + sum(td.nnz for td in dense),
            fingerprints=self.report(names | {td.name for td in deltas}),
            fallback=tuple(sorted(parts)),
            undo_bytes=res.undo.nbytes if res.undo is not None else 0,
            seconds={"load": t_load, "apply": t_apply - t_verify, "verify_derived": t_verify},
        )

    def commit(self, version: int | None = None, manifest: str | None = None) -> RankReply:
        """Keep the applied update (or adopt a version whose weights are held): drop the undo log;
        record the version and its manifest; count the commit."""
        if self._pending is not None:
            if self._pending.result.undo is not None:
                self._pending.result.undo.discard()
            self._pending = None
        if version is not None:
            self.version, self.manifest = version, manifest
        self.label = None  # a name given to the previous version
        self.commits += 1
        return RankReply(True, self.rank, **self.committed())

    def set_label(self, label: str | None) -> RankReply:
        """The caller's name for the served version (vLLM's ``finish_weight_update(weight_version)``)."""
        if label is not None and (not isinstance(label, str) or len(label) > 256):
            raise ValueError("a weight version label is a string of at most 256 characters")
        self.label = label
        return RankReply(True, self.rank, **self.committed())

    def rollback(self) -> RankReply:
        """Restore the exact old bits of the last apply (no-op when nothing is pending)."""
        p, self._pending = self._pending, None
        if p is None:
            return RankReply(True, self.rank)
        if p.result.undo is not None and not p.result.undo.done:
            p.result.undo.rollback()
        failed = {}
        for name, old in p.old_host.items():  # every tensor is tried: one loader's failure does not stop the rest
            try:
                self.load(name, old)
            except Exception as e:  # noqa: BLE001 - reported below, after the bookkeeping is restored
                failed[name] = f"{type(e).__name__}: {e}"
            self.host[name] = old
        self.fps.update(p.old_fps)
        self._refresh(p.touched)
        if failed:
            raise RollbackError(
                f"rank {self.rank}: the rollback could not reload {len(failed)} tensor(s) through the "
                f"engine's loader, whose served bits may be the failed update's: {dict(list(failed.items())[:4])}"
            )
        return RankReply(True, self.rank)

    def status(self) -> RankReply:
        return RankReply(
            True, self.rank, fallback=tuple(sorted(self.host)), pending=self._pending is not None, **self.committed()
        )

    # ---- helpers
    def _refuse_pending(self) -> None:
        if self._pending is not None:
            raise OutOfOrderError("an applied update is neither committed nor rolled back")

    def _refresh(self, touched: Touched | None) -> None:
        if self.refresh is not None:
            self.refresh(touched)

    def _verify_derived(self, touched: Touched | None) -> float:
        """After an apply's refresh, before the driver verifies and commits: the copies the engine's kernels
        read, of the layers just written, against a fresh derivation (``ENGINE_EXT_VERIFY_DERIVED``). A stale
        one fails the apply, which rolls back: the fingerprints read the checkpoint layout and cannot see it."""
        mode = settings.current().verify_derived
        if self.check_derived is None or mode == "off":
            return 0.0
        t = time.perf_counter()
        found = self.check_derived(touched, sample=mode == "sample")
        if found["stale"]:
            raise VerifyError(
                f"rank {self.rank}: after the apply, the engine's derived copies of {found['stale'][:5]} "
                "differ from a fresh derivation from the weights written (a refresh that does not follow "
                "them); rolled back"
            )
        return time.perf_counter() - t


class _LiveBases:
    """The base of context-coded parts on a rank (:class:`engine_ext.store.decoding.Bases`): the live
    weights read through the maps (or the host copy of a dense-fallback tensor), with the
    earlier links of the route laid over them."""

    def __init__(self, up: RankUpdater):
        self.up = up
        self.overlay: dict[str, list[TensorDelta]] = {}

    def context_device(self, name):
        """The device of this rank's weights of ``name`` when its context pass runs there
        (:class:`RankUpdater`'s ``decode_backend``), else None (the host)."""
        up = self.up
        if up.decode_backend == "host" or name in up.host:
            return None
        dev = next((p.dest.device for p in up.maps[name].pieces if p.count_fingerprint and p.numel), None)
        if dev is None or (dev.type == "cpu" and up.decode_backend != "device"):
            return None
        return dev

    def bits(self, name, start, stop):
        box = self.tensor_bits(name, start, stop)
        return None if box is None else box.cpu().numpy()

    def tensor_bits(self, name, start, stop):
        """The box's checkpoint bits, flat, as the earlier links of the route left them, on the
        weights' device (a copy: the live weights are never written here)."""
        from ..format.dtypes import as_bits
        from .maps import read_box

        up = self.up
        if name in up.host:
            box = as_bits(up.host[name].contiguous())[tuple(slice(a, b) for a, b in zip(start, stop))].clone()
        else:
            box = read_box(up.maps[name], start, stop)  # PartlyHeld: the decoder asks block by block
            if box is None:
                return None
        shape, ext = up.checkpoint[name][0], tuple(b - a for a, b in zip(start, stop))
        for td in self.overlay.get(name, []):  # earlier links of the route, inside this box
            inside, local = _in_box(td.index().to(box.device), shape, start, stop)
            part = TensorDelta(td.name, td.dtype, ext, td.mode, local, td.values.to(box.device)[inside])
            box = as_bits(apply_tensor(box.view(td.dtype.torch), part, check=False))
        return box.reshape(-1)

    def verify(self, name, fingerprint):
        up = self.up
        if self.overlay.get(name) or up.covered.get(name) != _numel(up.checkpoint[name][0]):
            return  # a later link (hash-chained to the first), or a shard (the driver checked the whole)
        if up.fps[name] != fingerprint:
            raise BaseMismatchError(
                f"tensor {name!r}: this rank holds fingerprint {fpr.fmt(up.fps[name])}, "
                f"the delta's base is {fpr.fmt(fingerprint)}"
            )

    def advance(self, tensors):
        for td in tensors:
            self.overlay.setdefault(td.name, []).append(td)


def _in_box(idx: torch.Tensor, shape, start, stop) -> tuple[torch.Tensor, torch.Tensor]:
    """(which flat indices of a tensor of ``shape`` lie in box [start, stop), the box-local row-major
    indices of those), on ``idx``'s device."""
    coords, rem = [], idx
    for n in reversed(tuple(shape)):
        coords.append(rem % n)
        rem = rem // n
    inside = torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
    local = torch.zeros_like(idx)
    for c, a, b in zip(reversed(coords), start, stop):
        inside &= (c >= a) & (c < b)
        local = local * (b - a) + (c - a)
    return inside, local[inside]


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """{later name: first name} of the parameters ``module`` registers under more than one name."""
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def run_op(
    updater: RankUpdater | Callable[[], RankUpdater], op: str, kwargs: dict | None = None, rank: int = 0
) -> dict:
    """Run ``op`` of this rank's updater and answer its :class:`RankReply` as wire data; never raises.

    ``updater`` may be a factory (built on first use inside the guard, so a failing
    start-up is an answer too). Engine adapters call this from their RPC handler.
    """
    try:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; one of {OPS}")
        up = updater() if callable(updater) and not isinstance(updater, RankUpdater) else updater
        rank = up.rank
        with torch.no_grad():
            return getattr(up, op)(**(kwargs or {})).to_wire()
    except Exception as e:  # noqa: BLE001 - reported to the driver, which rolls every rank back
        log.error("engine_ext: %s failed on rank %s: %s", op, rank, traceback.format_exc())
        return RankReply.failure(rank, e).to_wire()


__all__ = ["OPS", "Describe", "Loader", "RankUpdater", "Refresh", "run_op"]
