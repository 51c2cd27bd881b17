"""Who still reads a publisher's kept bits, so that the next diff does not move them underneath.

A publisher keeps one copy of the last version's raw bits (on the tensors' device): the next
version is diffed against it and updates it in place, in O(changed). The background thread reads
that same copy, with no copy of its own, where it writes an anchor (the bits are the anchor's
tensors) and where the context coder codes a delta (the bits are its base). So a queued job that
reads the kept bits holds them (:meth:`KeptBitsReaders.hold`) until it is done, written or not
(:meth:`~KeptBitsReaders.release`), and the training thread waits for no reader
(:meth:`~KeptBitsReaders.wait_free`) before a diff moves them.
"""

from __future__ import annotations

import threading


class KeptBitsReaders:
    """A count of the queued jobs that read the kept bits, and an event set while there is none."""

    def __init__(self):
        self._lock = threading.Lock()
        self._readers = 0
        self._free = threading.Event()
        self._free.set()

    def hold(self) -> None:
        """A queued job will read the kept bits: the next diff (which moves them) waits for it."""
        with self._lock:
            self._readers += 1
            self._free.clear()

    def release(self) -> None:
        """A job is done reading the kept bits (written or not)."""
        with self._lock:
            self._readers -= 1
            if self._readers == 0:
                self._free.set()

    def wait_free(self) -> None:
        """Block until no queued job reads the kept bits."""
        self._free.wait()
