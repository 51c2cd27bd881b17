"""The publisher's background thread: it builds and stores queued versions, one at a time, in order.

``publish`` returns as soon as a version's changes are taken (the manifest URI is known then);
encoding, hashing and uploading run here, behind a bounded queue, so the training thread blocks
only when uploads fall behind (backpressure). A failure is kept and raised once, on the training
thread (:meth:`UploadWorker.raise_pending`, from the next ``publish`` or ``wait``); the versions
queued behind a failed one are skipped, because each of them is a delta on a version that was not
published, and the publisher's next version starts the chain again with an anchor.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConflictError
from .kept_bits import KeptBitsReaders


@dataclass
class UploadJob:
    """One version to build and publish on the background thread."""

    kind: str  # ANCHOR or DELTA; a sharded publisher queues its own kind (an anchor and a delta of one version)
    version: int
    base_version: int | None
    anchor_version: int | None
    payload: object  # what the kind is built from: an anchor's tensors, a delta's changes (the publisher's types)
    holds: int  # times it holds the kept bits (KeptBitsReaders.hold): released once it is done, written or not


class UploadWorker:
    """The queue of versions to publish, the thread that publishes them with ``build(job)``, and the
    first failure, until it is raised."""

    def __init__(self, build: Callable[[UploadJob], None], kept: KeptBitsReaders, queue_size: int):
        self._build = build
        self._kept = kept
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None  # the first failure, not yet raised
        self._lost: ConflictError | None = None  # another publisher took this store over: this one stops
        # A failure was raised: the publisher's next version is an anchor (no delta names an unpublished base).
        # The publisher clears it when it starts the chain again.
        self.restart_chain = False
        self._thread = threading.Thread(target=self._loop, name="engine-ext-publisher", daemon=True)
        self._thread.start()

    def put(self, job: UploadJob) -> None:
        """Queue a version; blocks while the queue is full (uploads fell behind: backpressure)."""
        self._queue.put(job)

    def drain(self) -> None:
        """Block until every queued version is done (published, failed or skipped)."""
        self._queue.join()

    def close(self) -> None:
        """Let the thread finish what is queued, then end it."""
        self._queue.put(None)
        self._thread.join()

    def raise_pending(self) -> None:
        """Raise the first failure of the background (once). Every version queued after it was skipped,
        so none of them is published: the publisher's next version is an anchor. A
        :class:`~engine_ext.errors.ConflictError` (another publisher took a version of this store) is
        raised as such and stops this publisher for good: every later call raises it again."""
        if self._lost is not None:
            raise ConflictError(f"this publisher stopped: {self._lost}") from self._lost
        if self._error is None:
            return
        error = self._error
        self._error = None
        if isinstance(error, ConflictError):
            self._lost = error
            raise ConflictError(
                f"{error}; this publisher stops (a new DeltaPublisher continues the store after "
                "the other one's versions)"
            ) from error
        self.restart_chain = True
        raise RuntimeError(f"publishing failed: {error}") from error

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is None:  # behind a failure, a version is skipped: its base was not published
                    self._build(job)
            except BaseException as e:  # noqa: BLE001 - kept, and raised on the training thread by publish()/wait()
                self._error = e
            finally:
                holds = 0 if job is None else job.holds
                for _ in range(holds):
                    self._kept.release()  # done reading the kept bits, written or not
                # Its changes are freed now, not when the next version arrives: the next diff reuses the memory.
                job = None
                self._queue.task_done()
