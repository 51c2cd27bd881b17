"""Support code shared by the tests and the benchmarks: imported as ``support`` with ``tests/`` on ``sys.path``
(tests/conftest.py puts it there for every test module; a bench script inserts it itself).

Why here and not in bench/: the tests need these generators to run, and bench/ only measures; a benchmark
may import test support, a test never imports a benchmark. Not ``tests.support``: some installed packages
ship a top-level ``tests`` package of their own, which would shadow this folder.

The other helpers (tests/servers.py, vllm_helpers.py, fake_ranks.py, ...) stay directly in tests/ for now:
several are run as scripts by path or put on the path of Ray workers, verl configs and engine processes,
so moving them is a change of its own.
"""
