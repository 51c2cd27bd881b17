"""Moved: the GPU proof of the update path is ``gpu_acceptance/gpu_proof.py``; this entry runs it with the same arguments.

Why it moved: it proves (bit-exact applies, CUDA-graph replays equal to a fresh model, the census refusing
what it must) more than it measures, and bench/ only measures. Why this entry stays: the developer guide
tells a session with a lent GPU to run ``bench/gpu_proof.py`` first, and that command lives on in notes and
in prepared device scripts; it must keep working, so it replaces itself with the moved script (same
process, same arguments, same exit status).
"""
import os
import sys
from pathlib import Path

MOVED = Path(__file__).resolve().parents[1] / "gpu_acceptance" / "gpu_proof.py"

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, str(MOVED), *sys.argv[1:]])
