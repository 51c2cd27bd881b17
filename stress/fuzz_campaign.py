"""The long fuzzing campaign (issue 30): every target of ``tests/fuzz_targets.py`` for minutes.

    python stress/fuzz_campaign.py --minutes 15            # every target, the time shared equally
    python stress/fuzz_campaign.py --minutes 2 --targets manifest v2_streams --seed 7

Each target runs in a child process of its own (a crash of native code, or the address-space
limit ``--rlimit-gib`` above what the child holds after start-up, is then a finding, not the
end of the campaign), in batches of ``--batch`` hypothesis examples, each batch with its own
seed (``--seed`` + batch number): a failure's batch replays with ``--targets T --seed S
--batches 1``. Hypothesis shrinks every failure it finds; the campaign records it (its message
and the shrunk input) and goes on with the next batch. The same oracle as the CI tier judges
every input (``fuzz_targets.judge``: the documented outcome, a CPU-time and an allocation bound).

Prints, per target, the inputs tried (every call of the target, shrinking included), the
distinct failures, the time, and writes them as JSON with ``--json``. Burns every core it is
given: run it under the CPU lock (see GUIDE.md).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(name: str, seconds: float, seed: int, batch: int, batches: int | None, rlimit_gib: float) -> dict:
    """Run one target in this process until ``seconds`` pass (or ``batches`` are done)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import logging

    logging.getLogger("engine_ext").setLevel(logging.CRITICAL)  # refusals are logged as warnings: millions of them
    import fuzz_targets as ft
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

    t = ft.TARGETS[name]
    ft.corpus()
    if name.startswith("v2"):
        ft.v2_pool()
    if rlimit_gib:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        limit = vm + int(rlimit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    tried, failures, done = 0, {}, 0
    start = time.monotonic()
    while time.monotonic() - start < seconds and (batches is None or done < batches):
        s = seed + done

        @settings(max_examples=batch, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink], report_multiple_bugs=False)
        @hseed(s)
        @given(t.strategy())
        def run(case):
            nonlocal tried
            tried += 1
            t.check(case)

        try:
            run()
        except Exception as e:  # noqa: BLE001 - a finding: recorded, and the campaign goes on
            first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            notes = "\n".join(getattr(e, "__notes__", []))
            key = first[:120]
            if key not in failures:
                failures[key] = {"error": first, "example": notes, "seed": s, "count": 0}
            failures[key]["count"] += 1
        done += 1
    return {"target": name, "entry": t.entry, "inputs": tried, "batches": done, "seconds": round(time.monotonic() - start, 1),
            "failures": list(failures.values())}


def _spawn(name: str, seconds: float, args) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", name, "--seconds", str(seconds), "--seed", str(args.seed),
           "--batch", str(args.batch), "--rlimit-gib", str(args.rlimit_gib)]
    if args.batches:
        cmd += ["--batches", str(args.batches)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
               MALLOC_ARENA_MAX="2")  # fewer 64 MiB arenas of address space: the limit counts real growth
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=15.0, help="total campaign time, shared equally by the targets")
    ap.add_argument("--targets", nargs="*", default=None, help="default: all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2000, help="hypothesis examples per batch (one seed each)")
    ap.add_argument("--batches", type=int, default=None, help="stop a target after this many batches")
    ap.add_argument("--jobs", type=int, default=1, help="targets run at once (one process each)")
    ap.add_argument("--rlimit-gib", type=float, default=4.0, help="address space a worker may add after start-up (0: none)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.seconds, args.seed, args.batch, args.batches, args.rlimit_gib)))
        return
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from fuzz_targets import TARGETS

    names = args.targets or sorted(TARGETS)
    per = args.minutes * 60 * args.jobs / len(names)
    results, queue, running = [], list(names), {}
    t0 = time.monotonic()
    while queue or running:
        while queue and len(running) < args.jobs:
            name = queue.pop(0)
            running[name] = _spawn(name, per, args)
        for name, proc in list(running.items()):
            if proc.poll() is None:
                continue
            out, err = proc.communicate()
            del running[name]
            try:
                results.append(json.loads(out.strip().splitlines()[-1]))
            except (ValueError, IndexError):  # the worker died: a crash of native code, or out of memory
                results.append({"target": name, "entry": TARGETS[name].entry, "inputs": None, "batches": None,
                                "seconds": None, "failures": [{"error": f"worker died with exit code {proc.returncode}",
                                                               "example": err[-3000:], "seed": args.seed, "count": 1}]})
            r = results[-1]
            print(f"{name:12s} {r['inputs'] or 0:>9,} inputs  {len(r['failures'])} failure(s)  {r['seconds']} s", flush=True)
        time.sleep(0.2)
    total = sum(r["inputs"] or 0 for r in results)
    print(f"\n| target | entry point | inputs tried | failures |\n|---|---|---:|---:|")
    for r in sorted(results, key=lambda r: r["target"]):
        print(f"| {r['target']} | {r['entry']} | {r['inputs'] or 0:,} | {len(r['failures'])} |")
    print(f"\n{total:,} inputs in {(time.monotonic() - t0) / 60:.1f} min (seed {args.seed}, batches of {args.batch})")
    for r in results:
        for f in r["failures"]:
            print(f"\nFAILURE {r['target']} (seed {f['seed']}, x{f['count']}): {f['error']}\n{f['example'][:2000]}")
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "minutes": args.minutes, "results": results}, indent=1))
    sys.exit(1 if any(r["failures"] for r in results) else 0)


if __name__ == "__main__":
    main()
