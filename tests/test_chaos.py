"""The chaos soak's CI tier: a short run of stress/chaos.py with a fixed seed, and zero violations.

stress/chaos.py starts a publisher process, two vLLM CPU replicas (one following the store,
one pushed), a client sending completions to both, and injects faults at random from the
seed (publisher and server SIGKILLs, a racing publisher, store 5xx, cut and slow reads, a
follower partitioned from its store, a stale LATEST) while it checks its invariants; then
every replica must reach LATEST and equal a cold start on it. The 15-minute run over all
three store kinds is documented in docs/RELIABILITY.md with its figures.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]


def test_a_short_chaos_soak_keeps_every_invariant(tmp_path):
    out = tmp_path / "chaos"
    p = subprocess.run([sys.executable, str(ROOT / "stress" / "chaos.py"), "--seed", "1", "--minutes", "1.5",
                        "--stores", "http", "--replicas", "followed,pushed", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    assert report is not None, p.stdout[-4000:] + p.stderr[-4000:]
    assert report["violations"] == [], json.dumps(report["violations"], indent=1)
    assert p.returncode == 0, p.stdout[-3000:]
    assert report["versions_published"] >= 5 and sum(report["faults"].values()) >= 5, report
    assert report["final"]["version"] == report["latest"]["http"]
    for role, r in report["requests"].items():
        assert r["served"] > 0 and r["failed_while_up"] == 0 and r["converged_s"] is not None, (role, r)
