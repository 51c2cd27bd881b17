"""What the tests' engine servers leave for the test report (used by conftest.py hooks).

``note_log``: a server's log file; when a test fails, the tails of the logs of servers
started since its module began are attached to the failure, so a red CI explains
itself. ``note_hang``: a server start that hung and was started again. ``note_engine``:
which CPU kernels a server ran on (GEMM path, attention ISA, AMX permission), printed
once per distinct set at the end of the run, whichever host CI got. Under pytest-xdist the
servers run in worker processes, so each note is also a line in the file
``ENGINE_EXT_TEST_REPORT`` names (set by conftest.py in the controlling process before the
workers start), which the run's summary reads.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

LOGS: list[tuple[float, Path]] = []  # (start time, log path)
ENGINES: dict[str, list[str]] = {}  # description -> servers (model dirs) that ran on it
HANGS: list[str] = []  # logs of server starts that hung and were started again


def note_log(path: str | Path) -> None:
    LOGS.append((time.time(), Path(path)))


def note_engine(description: str, server: str) -> None:
    ENGINES.setdefault(description, []).append(server)
    path = os.environ.get("ENGINE_EXT_TEST_REPORT")
    if path:
        with open(path, "a") as f:  # one short line per write: appends from several workers stay whole
            f.write(json.dumps([description, server]) + "\n")


def note_hang(log: str | Path) -> None:
    """A server start that hung (no ``/health``, no death) and was started again: named at the end of
    the run, so a start the retry saved still shows (its log, renamed, holds its processes' stacks)."""
    HANGS.append(str(log))
    path = os.environ.get("ENGINE_EXT_TEST_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"hung": str(log)}) + "\n")


def _notes() -> list | None:
    path = os.environ.get("ENGINE_EXT_TEST_REPORT")
    if not path or not os.path.exists(path):
        return None
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def engines() -> dict[str, list[str]]:
    """Every note of this run, from all workers (the report file), else from this process."""
    notes = _notes()
    if notes is None:
        return ENGINES
    out: dict[str, list[str]] = {}
    for note in notes:
        if isinstance(note, list):
            description, server = note
            out.setdefault(description, []).append(server)
    return out


def hangs() -> list[str]:
    """The logs of every server start of this run that hung, from all workers."""
    notes = _notes()
    return HANGS if notes is None else [n["hung"] for n in notes if isinstance(n, dict)]


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
