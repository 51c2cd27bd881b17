"""Pull mode: a server that watches its store's ``LATEST`` and updates itself.

With ``ENGINE_EXT_FOLLOW=<store prefix>`` the driver process of a server (vLLM's API
server, SGLang's TokenizerManager) runs one :class:`Follower` next to its
:class:`~engine_ext.server.controller.Controller`. Every ``ENGINE_EXT_FOLLOW_INTERVAL`` seconds
(varied by +-20 % so that a fleet started together does not hit the store together) it
reads the signed ``LATEST``; when it names another version than the one served, it runs
an ordinary update to the store root, which plans the chain or the anchor with the fewer
bytes and is verified, applied and rolled back like any other. A failure (store down,
bad signature, a refused route) is logged, counted and retried after a doubled wait (up
to :data:`MAX_BACKOFF_S`); serving never stops. How far the server is behind is in its
status (``GET /update_weights_delta``, ``follow``) and in Prometheus
(``engine_ext_follow_lag_versions``, ``engine_ext_follow_lag_seconds``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable

from .. import metrics
from ..errors import NotFoundError
from ..store import open_store, reader
from ..store.signing import Trust
from .protocol import UpdateRequest

log = logging.getLogger("engine_ext")

MAX_BACKOFF_S = 60.0  # a failing store sees one look a minute per server; a healed one is met within ~72 s
JITTER = 0.2


class Follower:
    """Keeps one server at its store's ``LATEST``; ``controller`` returns the server's controller
    (awaited before each look, so that an engine's own bookkeeping, e.g. SGLang's resync, runs)."""

    def __init__(
        self, controller: Callable[[], Awaitable[object]], source: str, interval_s: float, trust: Trust | None = None
    ):
        self.controller, self.source, self.interval_s = controller, source, interval_s
        self.trust = trust or Trust.from_settings()
        self.latest_version: int | None = None
        self.served_version: int | None = None
        self.behind_since: float | None = None  # when LATEST was first seen ahead of the served version
        self.failures = 0  # in a row
        self.last_error: str | None = None
        self.last_check: float | None = None
        self.waiting = False  # the store has no LATEST yet: nothing published to follow
        self.updates = 0
        self._task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        """Start watching (once) in the running event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self.run())
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # its failures were logged as they came
                await self._task

    def delay(self) -> float:
        """The wait before the next look: the interval, doubled per failure in a row (capped), +-20 %."""
        base = (
            min(self.interval_s * 2**self.failures, max(MAX_BACKOFF_S, self.interval_s))
            if self.failures
            else self.interval_s
        )
        return base * random.uniform(1 - JITTER, 1 + JITTER)

    async def run(self) -> None:
        log.info("engine_ext: following %s every %.3g s", self.source, self.interval_s)
        while True:
            await self.check()
            await asyncio.sleep(self.delay())

    async def check(self) -> None:
        """One look at ``LATEST``, and one update when it names another version. Never raises."""
        self.last_check = time.time()
        try:
            ctl = await self.controller()
            self.served_version = ctl.version
            store = open_store(self.source)
            try:
                latest = await asyncio.to_thread(reader.read_latest, store, self.trust)
            except NotFoundError:
                if not self.waiting:
                    log.info(
                        "engine_ext: %s has no LATEST yet; looking again every %.3g s", self.source, self.interval_s
                    )
                self.waiting, self.failures, self.last_error = True, 0, None
                return
            self.waiting = False
            self.latest_version = latest.version
            if ctl.version is None or latest.version > ctl.version:  # an older LATEST: a push got ahead; wait
                if self.behind_since is None:
                    self.behind_since = time.time()
                answer = await ctl.update(UpdateRequest.parse({"url": self.source, "wait": True}))
                self.updates += 0 if answer.get("noop") else 1
                log.info("engine_ext: followed %s to v%s", self.source, answer["version"])
            self.served_version = ctl.version
            if self.served_version == self.latest_version:
                self.behind_since = None
            self.failures, self.last_error = 0, None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - pull mode never stops serving
            self.failures += 1
            self.last_error = f"{type(e).__name__}: {str(e)[:500]}"
            metrics.FOLLOW_FAILURES.labels(getattr(e, "reason", "internal")).inc()
            log.warning(
                "engine_ext: following %s failed (%d in a row; next look in about %.3g s): %s",
                self.source,
                self.failures,
                self.delay(),
                self.last_error,
            )
        finally:
            metrics.FOLLOW_LAG_VERSIONS.set(self.lag_versions())
            metrics.FOLLOW_LAG_SECONDS.set(self.lag_seconds())

    def lag_versions(self) -> float:
        """Versions between the served one and ``LATEST`` (0 when caught up; -1 when unknown)."""
        if self.latest_version is None or self.served_version is None:
            return -1 if self.latest_version is not None else 0
        return self.latest_version - self.served_version

    def lag_seconds(self) -> float:
        """Seconds since a newer ``LATEST`` was first seen and not yet served (0 when caught up)."""
        return 0.0 if self.behind_since is None else time.time() - self.behind_since

    def state(self) -> str:
        """``waiting`` (nothing published yet), ``failing`` (the last look failed), ``behind`` or ``following``."""
        if self.failures:
            return "failing"
        if self.waiting:
            return "waiting"
        return "behind" if self.lag_versions() > 0 else "following"

    def status(self) -> dict:
        return {
            "source": self.source,
            "state": self.state(),
            "interval_s": self.interval_s,
            "latest_version": self.latest_version,
            "served_version": self.served_version,
            "lag_versions": self.lag_versions(),
            "lag_seconds": round(self.lag_seconds(), 3),
            "updates": self.updates,
            "failures_in_a_row": self.failures,
            "last_error": self.last_error,
            "last_check_unix": self.last_check,
        }


__all__ = ["MAX_BACKOFF_S", "Follower"]
