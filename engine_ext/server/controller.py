"""The driver of updates for one engine: one apply at a time, with history and metrics.

One :class:`Controller` lives where updates are driven from: the process that answers
HTTP (vLLM's API server, SGLang's TokenizerManager process, which also serves the
in-process ``sglang.Engine`` hook), or rank 0 of an in-process vLLM engine (the
``engine_ext`` weight-transfer backend). It checks the source against the allow-list
before anything is fetched, prepares each update (plan, every rank fetches its part:
an :class:`~engine_ext.server.transaction.UpdateTransaction`) outside its lock, so a slow source
holds no other update back, and executes it (pause, apply, verify, commit) under the
lock on the state it was planned from, planning again if another update committed
meanwhile. At most ``ENGINE_EXT_MAX_WAITING`` updates wait (429 beyond). It records
the outcome (bounded history, Prometheus metrics). :class:`Auth` and
:func:`error_answer` serve the HTTP routes of both engines.

The ranks carry the committed state themselves (version, manifest, a commit count and the
caller's label for the version): a driver that finds their count moved since it last
looked (another driver, or a direct RPC, committed) re-reads its :class:`ServedState`
from them before it plans (:meth:`Controller.sync`), so one engine has one served state
whichever door an update came through.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from .. import metrics, settings
from ..errors import AuditUnavailable, BaseMismatchError, Busy, DeltaError, QueueFull
from ..format import fingerprint as fpr
from ..store.signing import Trust
from ..store.sources import Sources
from .follow import Follower
from .protocol import UpdateRequest
from .transaction import (
    ApplyError,
    Ranks,
    ServedState,
    UpdateTransaction,
    check_replies,
    combine_fingerprints,
    committed_state,
)

log = logging.getLogger("engine_ext")

VERSION_SIDECAR = "engine_ext_version"  # optional file in the model dir holding the checkpoint's version


class Unauthorized(DeltaError):
    reason, http_status = "unauthorized", 401


@dataclass(frozen=True)
class Auth:
    """Who may use the update routes: a bearer token among ``tokens``; everybody only when
    ``open`` was asked for explicitly (``ENGINE_EXT_NO_AUTH=1``). Secure by default: with
    neither, every request is refused."""

    tokens: tuple[str, ...] = ()
    open: bool = False

    @classmethod
    def from_settings(cls, engine_tokens=(), s: settings.Settings | None = None) -> Auth:
        """``ENGINE_EXT_TOKEN`` plus the engine's own API keys (vLLM ``--api-key``, SGLang
        ``--api-key``/``--admin-api-key``), and ``ENGINE_EXT_NO_AUTH``."""
        s = s or settings.current()
        tokens = tuple(t for t in ((s.token,) if s.token else ()) + tuple(engine_tokens) if t)
        return cls(tokens, s.no_auth)

    def check(self, authorization: str | None) -> None:
        """Raise :class:`Unauthorized` unless ``authorization`` is ``Bearer <a token>`` (scheme in any case)."""
        if self.open and not self.tokens:
            return
        if not self.tokens:
            raise Unauthorized(
                "no token is configured for this route: set ENGINE_EXT_TOKEN (or the engine's API key), "
                "or ENGINE_EXT_NO_AUTH=1 to open it explicitly"
            )
        scheme, _, given = (authorization or "").strip().partition(" ")
        ok = scheme.lower() == "bearer" and any(
            hmac.compare_digest(given.strip().encode(), t.encode()) for t in self.tokens
        )
        if not ok:
            raise Unauthorized("missing or wrong bearer token")


def internal_error(e: BaseException, what: str = "the request") -> str:
    """Words for an unexpected failure, safe to answer to a caller: what failed, the exception's type and
    an error id; the details (message, traceback: internals, local paths) go to the server's log only,
    under that id (docs/SECURITY.md)."""
    error_id = secrets.token_hex(6)
    log.error("engine_ext: %s failed with an internal error [error id %s]: %r", what, error_id, e, exc_info=e)
    return f"{what} failed with an internal error ({type(e).__name__}); the server's log has the details under error id {error_id}"


def error_answer(e: Exception) -> tuple[int, dict]:
    """HTTP status and JSON body for an exception (DeltaError carries both; anything else is a 500 whose
    words and error id are in :func:`internal_error`)."""
    if isinstance(e, DeltaError):
        return e.http_status, {"ok": False, "reason": e.reason, "error": str(e)}
    return 500, {"ok": False, "reason": "internal", "error": internal_error(e)}


@dataclass(frozen=True)
class Policy:
    """What an update may come from: the stores it may be read from and the keys that must sign it."""

    sources: Sources
    trust: Trust


def initial_version(model_dir: str | None) -> int | None:
    """``ENGINE_EXT_BASE_VERSION``, else the ``engine_ext_version`` file in the model dir."""
    v = settings.current().base_version
    if v is None and model_dir and Path(model_dir, VERSION_SIDECAR).is_file():
        text = Path(model_dir, VERSION_SIDECAR).read_text().strip()
        try:
            v = int(text)
        except ValueError:
            raise ValueError(f"{Path(model_dir, VERSION_SIDECAR)}: version {text!r} is not an integer") from None
    return v


def _cut(text, n: int = 500) -> str:
    text = str(text)
    return text if len(text) <= n else text[:n] + "..."


class Controller:
    """One apply at a time, all ranks or none; keeps the served state and the history."""

    REPLANS = 3  # times an update plans again when others commit while it fetches

    def __init__(
        self,
        ranks: Ranks,
        sources: Sources | None = None,
        version: int | None = None,
        history: int = 32,
        engine_name: str = "vllm",
        trust: Trust | None = None,
        max_waiting: int | None = None,
    ):
        self.ranks = ranks
        self.sources = sources or Sources.from_settings()
        self.trust = trust or Trust.from_settings()
        self.engine_name = engine_name
        self.state = ServedState(version, {}, {})
        self.history: collections.deque = collections.deque(maxlen=history)
        self.max_waiting = settings.current().max_waiting if max_waiting is None else max_waiting
        self._lock = asyncio.Lock()
        self._applying = False  # an update executes (under the lock): others answer 409 unless they wait
        self._inflight = 0
        self.ready = False
        self.start_error: str | None = None
        self.follower: Follower | None = None

    # ---- start-up
    async def start(self) -> None:
        """Probe every rank and record the start-up fingerprint of the live weights."""
        try:
            self.state = ServedState.from_setup(await self.ranks.call("setup"), self.state.version)
        except Exception as e:
            self.start_error = str(e)
            raise
        self.ready = True
        metrics.VERSION.set(-1 if self.state.version is None else self.state.version)
        layout = self.state.layout
        log.info(
            "engine_ext: %d checkpoint tensors mapped on %d rank(s); version %s, fingerprint %s; dense fallback: %s; "
            "converting maps: %d; engine paths: %s",
            len(self.state.tensor_fps),
            len(layout["engine"]),
            self.state.version,
            fpr.fmt(self.state.model_fingerprint),
            layout["fallback"],
            len(layout["converted"]),
            layout["engine"][0],
        )
        if layout["mismatched"]:
            log.error(
                "engine_ext: %d tensor(s) are served with other weights than the checkpoint they were loaded "
                "from (a layout the engine derives after loading?); updates touching them will be refused: %s",
                len(layout["mismatched"]),
                layout["mismatched"][:8],
            )
        if layout["unreproducible"]:
            log.error(
                "engine_ext: %d tensor(s) reach copies the engine derived after loading that no refresh keeps in "
                "step; updates writing them will be refused: %s",
                len(layout["unreproducible"]),
                dict(list(layout["unreproducible"].items())[:4]),
            )

    def start_following(self, get_controller=None) -> Follower | None:
        """Pull mode (``ENGINE_EXT_FOLLOW``): watch the store's LATEST from this process's event
        loop; ``get_controller`` (default: this controller) is awaited before each look."""
        s = settings.current()
        if not s.follow:
            return None
        if self.follower is None:

            async def me():
                return self

            self.follower = Follower(get_controller or me, s.follow, s.follow_interval, self.trust)
        self.follower.start()
        return self.follower

    async def resync(self, reason: str = "weights changed outside engine_ext") -> None:
        """Re-read every rank's live fingerprints after the engine's own weight update.

        Where they changed, the version becomes unknown (on every rank too); a delta whose base
        fingerprint matches the new weights is still accepted.
        """
        async with self._lock:
            replies = check_replies(await self.ranks.call("resync"))
            fps = self._served_fingerprints(replies)
            if fps == self.state.tensor_fps and self.state.commits == max(r.commits for r in replies):
                log.info("engine_ext: %s, but the live weights are the served version's; nothing changed", reason)
                return
            await self._forget(
                replies
            )  # the version and its manifest are unknown: the next delta is bound by fingerprint
            self.state.tensor_fps = fps
            metrics.VERSION.set(-1)
            self.history.append(
                {
                    "ok": True,
                    "outside_update": True,
                    "version": None,
                    "fingerprint": fpr.fmt(self.state.model_fingerprint),
                    "time": time.time(),
                }
            )
            log.info("engine_ext: %s; fingerprint now %s", reason, fpr.fmt(self.state.model_fingerprint))

    async def sync(self) -> bool:
        """With the update lock held: ask the ranks for the committed state they carry; where their
        commit count is not the one this driver knows (an update committed through another door:
        an in-process backend, a direct RPC), re-read the served state from them. True if it moved."""
        if not self.ready:
            return False
        replies = check_replies(await self.ranks.call("status"))
        try:
            committed = committed_state(replies)
            moved = committed.commits != self.state.commits
        except ApplyError as e:  # a commit reached only some ranks: the version is unknown, the fingerprints tell
            log.error("engine_ext: %s; the version is forgotten on every rank", e)
            await self._forget(replies)
            moved = True
        if not moved:
            self.state.label = committed.label
            return False
        fresh = ServedState.from_setup(await self.ranks.call("setup"), None)
        before = self.state.version
        for f in dataclasses.fields(ServedState):
            setattr(self.state, f.name, getattr(fresh, f.name))
        metrics.VERSION.set(-1 if self.state.version is None else self.state.version)
        self.history.append(
            {
                "ok": True,
                "outside_update": True,
                "version": self.state.version,
                "fingerprint": fpr.fmt(self.state.model_fingerprint),
                "time": time.time(),
            }
        )
        log.info(
            "engine_ext: the ranks moved from v%s to v%s (commit %d) through another door; served state re-read, "
            "fingerprint %s",
            before,
            self.state.version,
            self.state.commits,
            fpr.fmt(self.state.model_fingerprint),
        )
        return True

    async def _forget(self, replies) -> int:
        """Every rank drops its committed version and takes one new commit count (past all of theirs);
        so does the served state. Returns the count."""
        commits = max(r.commits for r in replies) + 1
        check_replies(await self.ranks.call("forget", commits=commits))
        self.state.version, self.state.manifests, self.state.label, self.state.commits = None, (), None, commits
        return commits

    async def set_label(self, label: str | None) -> None:
        """Record the caller's name for the served version (vLLM's ``finish_weight_update(weight_version)``)
        on every rank, beside the version (``weight_version`` in :meth:`status`)."""
        async with self._lock:
            replies = check_replies(await self.ranks.call("set_label", label=label))
            self.state.label = committed_state(replies).label

    async def fresh_status(self) -> dict:
        """:meth:`status`, re-read from the ranks first unless an update holds the lock."""
        if self.ready and not self._lock.locked():
            try:
                async with self._lock:
                    await self.sync()
            except Exception as e:  # noqa: BLE001 - the status still answers, with what is known
                log.warning("engine_ext: re-reading the ranks' committed state failed: %s", e)
        return self.status()

    async def audit(self) -> dict:
        """Re-read every rank's live weights, under the update lock (never in the middle of an apply),
        and compare their fingerprints with the served state's, and every copy the engine derived from
        them (what its kernels read) with a fresh derivation: what ``GET ...?audit=1`` answers."""
        async with self._lock:
            replies = check_replies(await self.ranks.call("audit"))
            live = self._served_fingerprints(replies)
            differ = sorted(
                n for n in set(live) | set(self.state.tensor_fps) if live.get(n) != self.state.tensor_fps.get(n)
            )
            stale = sorted({f"rank {r.rank}: {n}" for r in replies for n in r.derived.get("stale", ())})
            derived = {
                "checked": sum(r.derived.get("checked", 0) for r in replies),
                "opaque": sum(r.derived.get("opaque", 0) for r in replies),
                "stale": stale[:20],
            }
            return {
                "ok": not differ and not stale,
                "version": self.state.version,
                "fingerprint": fpr.fmt(fpr.model_fingerprint(live)),
                "differ": differ[:20],
                "derived": derived,
            }

    async def cold_audit(self, checkpoint: str) -> dict:
        """Every rank's served model against a second instance it builds cold from ``checkpoint`` (a directory
        under an allowed source), byte for byte, under the update lock: what ``GET ...?audit=1&cold=DIR``
        answers where ``ENGINE_EXT_COLD_AUDIT=1`` (it doubles the model's memory for the time of the call)."""
        if not settings.current().cold_audit:
            raise AuditUnavailable(
                "the cold-load audit is off: ENGINE_EXT_COLD_AUDIT=1 turns it on (it builds a "
                "second instance of the model on every rank)"
            )
        self.sources.check(checkpoint)  # 403 outside the allowed sources, before anything is read
        async with self._lock:
            replies = check_replies(await self.ranks.call("cold_audit", checkpoint=checkpoint))
        differ = [f"rank {r.rank}: {n}" for r in replies for n in r.cold.get("differ", ())]
        return {
            "ok": all(r.cold.get("ok") for r in replies),
            "version": self.state.version,
            "checkpoint": checkpoint,
            "compared": sum(r.cold.get("compared", 0) for r in replies),
            "gemms": sum(r.cold.get("gemms", 0) for r in replies),
            "handles": sum(r.cold.get("handles", 0) for r in replies),
            "differ": differ[:20],
            "served_only": sorted({n for r in replies for n in r.cold.get("live_only", ())})[:20],
            "cold_only": sorted({n for r in replies for n in r.cold.get("cold_only", ())})[:20],
            "seconds": max((r.cold.get("seconds", 0.0) for r in replies), default=0.0),
        }

    def _served_fingerprints(self, replies) -> dict[str, int]:
        """The whole-tensor fingerprints of the served tensors from the ranks' reports (a checkpoint's
        stored tied copy, which no rank loads, is not served)."""
        tied = set(self.state.layout.get("tied", ())) | {n for r in replies for n in r.tied}
        return combine_fingerprints(replies, sorted({n for r in replies for n in r.fingerprints} - tied))

    @property
    def version(self) -> int | None:
        return self.state.version

    @property
    def model_fingerprint(self) -> int:
        return self.state.model_fingerprint

    def status(self) -> dict:
        return {
            "engine": self.engine_name,
            "version": self.state.version,
            "weight_version": self.state.label,  # the caller's name for it (vLLM's finish_weight_update), if given
            "commits": self.state.commits,
            "fingerprint": fpr.fmt(self.state.model_fingerprint) if self.ready else None,
            "tensors": len(self.state.tensor_fps),
            "busy": self._applying,
            "error": self.start_error,
            "layout": self.state.layout,
            "history": list(self.history),
            "follow": self.follower.status() if self.follower is not None else None,
        }

    # ---- update
    async def update(self, req: UpdateRequest, policy: Policy | None = None) -> dict:
        """Run one update transaction; the answer as JSON, or a DeltaError saying why nothing changed.
        ``policy``: the sources and trusted keys of the door it came through (default: the server's)."""
        policy = policy or Policy(self.sources, self.trust)
        try:
            source = policy.sources.check(req.url)  # 403 before anything is fetched
            if self._applying and not req.wait:
                raise Busy('another update is being applied; retry, or send "wait": true to queue')
            if self._inflight > self.max_waiting:
                raise QueueFull(
                    f"{self._inflight} updates are already in flight (ENGINE_EXT_MAX_WAITING="
                    f"{self.max_waiting}); retry later"
                )
            if not self.ready:
                raise ApplyError(
                    f"the engine_ext start-up probe did not complete: {self.start_error or 'still running'}"
                )
            self._inflight += 1
            try:
                answer, phases = await self._prepare_and_execute(req, source, policy.trust)
            finally:
                self._inflight -= 1
        except DeltaError as e:
            metrics.record_failure(e.reason)
            self.history.append(
                {"url": _cut(req.url, 300), "ok": False, "reason": e.reason, "error": _cut(e), "time": time.time()}
            )
            raise
        except Exception as e:
            metrics.record_failure("internal")
            words = internal_error(e, "the update")
            self.history.append(
                {"url": _cut(req.url, 300), "ok": False, "reason": "internal", "error": words, "time": time.time()}
            )
            raise ApplyError(words) from e
        if not answer.noop:
            metrics.record_success(
                answer.version, answer.payload_bytes, sum(answer.fetched_bytes), answer.written, phases
            )
        self.history.append(
            {
                "version": answer.version,
                "base_version": answer.base_version,
                "elements": answer.elements,
                "payload_bytes": answer.payload_bytes,
                "pause_ms": answer.pause_ms,
                "noop": answer.noop,
                "url": _cut(req.url, 300),
                "ok": True,
                "time": time.time(),
            }
        )
        return answer.to_json()

    async def _prepare_and_execute(self, req: UpdateRequest, source: str, trust: Trust):
        """Prepare outside the lock, execute under it; plan again if the state moved meanwhile
        (here, or on the ranks through another door: :meth:`sync` before planning and executing). Every
        plan of the request fetches within the one deadline (``ENGINE_EXT_FETCH_TIMEOUT``), fixed here."""
        deadline = time.monotonic() + settings.current().fetch_timeout
        for _ in range(self.REPLANS):
            async with self._lock:
                await self.sync()
            txn = UpdateTransaction(self.ranks, self.state, req, source, trust, deadline=deadline)
            try:
                try:
                    await txn.prepare()
                except DeltaError:
                    # a context-coded part decodes against the live base: another update that committed
                    # meanwhile makes it fail ("a wrong base"). Plan again from the new state, else it stands
                    async with self._lock:
                        await self.sync()
                        if self.state.key() == txn.planned_from:
                            raise
                    continue
                async with self._lock:
                    await self.sync()
                    if self.state.key() == txn.planned_from:
                        self._applying = True
                        try:
                            return await txn.execute(), txn.phases
                        finally:
                            self._applying = False
            finally:
                await txn.release()
        raise BaseMismatchError("other updates kept changing the served weights while this one was fetched; retry")


__all__ = [
    "Auth",
    "Busy",
    "Controller",
    "Policy",
    "QueueFull",
    "Unauthorized",
    "error_answer",
    "initial_version",
    "internal_error",
]
