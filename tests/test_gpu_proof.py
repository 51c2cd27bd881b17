"""gpu_acceptance/gpu_proof.py cannot rot: its --cpu-smoke run takes every section's code path (tiny shapes,
Triton's interpreter, no CUDA graph) and writes the report, every section ok and every check true."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_proof_cpu_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "gpu_acceptance/gpu_proof.py", "--cpu-smoke", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    report = (tmp_path / "gpu_proof.md").read_text()
    assert p.returncode == 0, report + p.stdout[-3000:] + p.stderr[-3000:]
    assert report.count("Section status: **ok**") == 5, report
    assert "no CUDA graph" in report and "Triton interpreter" in report  # the smoke says what it is
    b = report.split("## (b)")[1].split("## (c)")[0]
    assert "| True |" in b  # the device decode equals the host decode
    c = report.split("## (c)")[1].split("## (d)")[0]
    assert "All hold: **True**" in c and c.count("| True | 0 | True | True |") == 5  # start, v1, undone v2, v2, v3
    assert "recomputed from the device tensors: **True**" in report
    e = report.split("## (e)")[1]  # vLLM's CUDA post-processing, emulated: refused, equal to a cold start, or the known gap
    assert "All hold: **True**" in e
    if "vLLM is not importable" not in e:
        assert "| bf16 MoE, TRITON (vLLM's choice) | `w13_weight` | in place, equals a cold start |" in e
        # no row diverges: the UE8M0 checkpoint's requantisation is refused by the census since issue 50 closed the gap
        assert e.count("refused (load check)") == 6 and e.count("DIVERGES from a cold start") == 0
    assert not list(tmp_path.glob(".section_*"))


def test_the_old_entry_runs_the_moved_proof():
    """``bench/gpu_proof.py`` (the command the developer guide gives a session with a lent GPU) still runs the proof:
    it hands its arguments to gpu_acceptance/gpu_proof.py, whose usage it then prints."""
    moved = subprocess.run([sys.executable, "gpu_acceptance/gpu_proof.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    old = subprocess.run([sys.executable, "bench/gpu_proof.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert moved.returncode == old.returncode == 0, old.stderr
    assert "--cpu-smoke" in old.stdout and old.stdout == moved.stdout
