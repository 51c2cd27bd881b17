"""A live publisher's ``LATEST`` never expires: it is re-signed before it does.

A signed ``LATEST`` carries an expiry (``latest_ttl_s`` after it was written), so that a follower
can tell a run that died from one that is only slow between versions. A publisher that lives but
publishes rarely (a long evaluation, a paused run) would let it expire; :class:`LatestHeartbeat`
re-signs the ``LATEST`` its publisher wrote once half its time has passed, on a thread of its own,
unless another publisher moved ``LATEST`` since (then it stops beating: that one owns it now).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

from ..errors import ConflictError
from ..format.latest import LATEST_KEY, MAX_LATEST_BYTES, Latest
from ..store import Store
from ..store.signing import Signer
from .builder import sign_latest

log = logging.getLogger("engine_ext")
MAX_BEAT_S = 3600.0  # however long LATEST lives, the heartbeat looks at least this often


class LatestHeartbeat:
    """The ``LATEST`` a publisher last wrote, and the thread that re-signs it (with a signer only:
    an unsigned ``LATEST`` has no expiry)."""

    def __init__(self, store: Store, signer: Signer | None, ttl_s: float):
        self.store = store
        self.signer = signer
        self.ttl_s = ttl_s
        self.latest: Latest | None = None  # the last LATEST this publisher wrote (None: none, or another took it)
        # Held while LATEST moves: a beat never re-signs the pointer a new version is replacing.
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        if signer is not None:
            self._thread = threading.Thread(target=self._beat, name="engine-ext-latest-heartbeat", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def moving_latest(self) -> Iterator[None]:
        """Held while a version is published (it moves ``LATEST``): a beat never re-signs the pointer
        being replaced. Say what was written with :meth:`wrote`, inside."""
        with self._lock:
            yield

    def wrote(self, latest: Latest) -> None:
        """Beat for ``latest``, which this publisher just wrote (inside :meth:`moving_latest`)."""
        self.latest = latest

    def refresh(self, force: bool = False) -> bool:
        """Re-sign the ``LATEST`` this publisher wrote with a new expiry, once half its time has passed
        (or ``force``), unless another publisher moved it; returns whether it was re-signed."""
        with self._lock:
            mine = self.latest
            if mine is None or self.signer is None or mine.expires_unix is None:
                return False  # nothing of ours to re-sign (an unsigned LATEST never expires)
            if not force and mine.expires_unix - time.time() > self.ttl_s / 2:
                return False
            fresh = dataclasses.replace(mine, expires_unix=time.time() + self.ttl_s)
            try:
                self.store.write_if(LATEST_KEY, sign_latest(fresh, self.signer), self._still(mine), MAX_LATEST_BYTES)
            except ConflictError as e:
                self.latest = None  # another publisher owns LATEST now: stop beating
                log.warning("engine_ext: %s", e)
                return False
            self.latest = fresh
            return True

    def stop(self) -> None:
        """Stop beating (the publisher closes): the thread ends at once, not at its next beat."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()

    def _still(self, mine: Latest) -> Callable[[bytes | None], None]:
        """The store's check before it overwrites ``LATEST``: it must still point at ``mine``'s version."""

        def check(current: bytes | None) -> None:
            held = None if current is None else Latest.from_json(current)[0]
            if held is None or (held.version, held.sha256) != (mine.version, mine.sha256):
                now = "nothing" if held is None else f"v{held.version}"
                raise ConflictError(f"LATEST of {self.store.uri} moved to {now}; not re-signed")

        return check

    def _beat(self) -> None:
        # A quarter of the lifetime: a beat that fails (the store down for a while) is tried again well before expiry.
        while not self._stopped.wait(min(self.ttl_s / 4, MAX_BEAT_S)):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - the next beat tries again; publishing goes on
                log.warning("engine_ext: re-signing %s failed: %s", self.store.key_uri(LATEST_KEY), e)
