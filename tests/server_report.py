"""What the tests' engine servers leave for the test report (used by conftest.py hooks).

``note_log``: a server's log file; when a test fails, the tails of the logs of servers
started since its module began are attached to the failure, so a red CI explains
itself. ``note_engine``: which CPU kernels a server ran on (GEMM path, attention ISA,
AMX permission), printed once per distinct set at the end of the run, whichever host
CI got.
"""
from __future__ import annotations

import time
from pathlib import Path

LOGS: list[tuple[float, Path]] = []  # (start time, log path)
ENGINES: dict[str, list[str]] = {}  # description -> servers (model dirs) that ran on it


def note_log(path: str | Path) -> None:
    LOGS.append((time.time(), Path(path)))


def note_engine(description: str, server: str) -> None:
    ENGINES.setdefault(description, []).append(server)


def tails_since(t0: float, lines: int = 40, most: int = 3) -> list[tuple[str, str]]:
    """(title, tail) of the newest ``most`` logs noted since ``t0``."""
    out = []
    for _, path in [x for x in LOGS if x[0] >= t0][-most:]:
        try:
            tail = "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError as e:
            tail = f"(unreadable: {e})"
        out.append((f"server log {path} (last {lines} lines)", tail))
    return out
