"""Catch-up deltas on real training steps: what a lagging replica fetches, and what they cost the publisher.

    python bench/catch_up.py [--steps 64] [--spans 4,16,64 2,4,8,16,32,64] [--lr 3e-6]

Publishes ``steps + 1`` versions of bench/train_data.py's run (a Qwen2-shaped model trained with
AdamW; bf16 casts of the fp32 masters) signed to a fresh local store, once without catch-up deltas
and once per span set (``DeltaPublisher(catch_up_spans=...)``), the deployed default coding. Then,
for replicas 1, 4, 16 and 64 versions behind the last version, plans the route each takes
(:func:`engine_ext.store.route.plan`) and reports its links, bytes fetched and manifests read,
beside the union of the changes (the first-order floor of any catch-up: the elements that differ).
Every route is fetched, composed and applied to the held version and compared bit for bit with the
target. The publisher's extra cost: stored bytes over the chain's, and its wall time (publish of every
version, waited for) beside the run without catch-ups, in the same process.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_data

from engine_ext.format.delta import apply_tensor
from engine_ext.format.dtypes import as_bits
from engine_ext.format.manifest import manifest_key
from engine_ext.store import route
from engine_ext.store.signing import Trust, generate_key
from engine_ext.trainer.publisher import DeltaPublisher


def publish(root: Path, versions: list[dict], spans: tuple, key: str) -> tuple[float, list]:
    t0 = time.perf_counter()
    with DeltaPublisher(str(root), anchor_every=0, signing_key=key, catch_up_spans=spans) as pub:
        for sd in versions:
            pub.publish(sd)
        pub.wait()
        return time.perf_counter() - t0, pub.catch_ups


def stored(root: Path, catch_ups: bool) -> int:
    """Bytes of the delta blobs and manifests: the chain's, or the catch-ups' alone."""
    return sum(
        p.stat().st_size
        for p in root.iterdir()
        if p.name.startswith("v") and ".anchor" not in p.name and (".from" in p.name) == catch_ups
    )


def plan_counting(uri: str, held: int, trust: Trust, reads: list[str]) -> route.Route:
    """``route.plan`` from ``held`` to ``uri``, every manifest it reads appended to ``reads``."""
    real = route.read_link

    def counting(store, key, *args, **kw):
        reads.append(key)
        return real(store, key, *args, **kw)

    route.read_link = counting
    try:
        return route.plan(uri, held, None, trust=trust)
    finally:
        route.read_link = real


def changed_elements(a: dict, b: dict) -> int:
    return sum(int((as_bits(a[n]) != as_bits(b[n])).sum()) for n in b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--spans", nargs="+", default=["4,16,64", "2,4,8,16,32,64"])
    a = p.parse_args()
    torch.set_num_threads(1)
    versions = train_data.versions(a.lr, a.steps)
    last = len(versions) - 1
    numel = sum(t.numel() for t in versions[0].values())
    work = Path(tempfile.mkdtemp(prefix="catch_up_bench_"))
    key = str(work / "publisher.key")
    generate_key(key)
    trust = Trust.from_public_keys([key + ".pub"])
    setups = [("chain only", ())] + [(f"spans {s}", tuple(int(x) for x in s.split(","))) for s in a.spans]
    runs = {}
    for label, spans in setups:
        root = work / label.replace(" ", "_").replace(",", "-")
        seconds, done = publish(root, versions, spans, key)
        runs[label] = (root, seconds, done)
    chain_root, chain_s, _ = runs["chain only"]
    chain_bytes = stored(chain_root, False)
    print(f"{numel:,} elements, {last + 1} versions (lr {a.lr:g}); the chain stores {chain_bytes:,} bytes of deltas\n")
    print("| publisher | stored beyond the chain | publish wall (s) | catch-ups published / skipped |")
    print("|---|---:|---:|---:|")
    for label, (root, seconds, done) in runs.items():
        extra = stored(root, True)
        made = sum(1 for c in done if c.key)
        print(
            f"| {label} | {extra:,} B ({extra / chain_bytes:.1%}) | {seconds:.1f} (chain {chain_s:.1f}) | "
            f"{made} / {len(done) - made} |"
        )
    print(
        "\n| behind | changed elements (union) | publisher | links | manifests read | bytes fetched | "
        "B per union change | bit-exact |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---|")
    for behind in (1, 4, 16, 64):
        if behind > last:
            continue
        held = last - behind
        union = changed_elements(versions[held], versions[last])
        for label, (root, _, _) in runs.items():
            reads: list[str] = []
            r = plan_counting(str(root / manifest_key(last)), held, trust, reads)
            fetched = sum(link.manifest.payload_bytes for link in r.links)
            got = dict(versions[held])
            for td in route.fetch_planned(r.store, r.links).tensors:
                got[td.name] = apply_tensor(got[td.name], td, check=False)
            exact = all(torch.equal(as_bits(got[n]), as_bits(versions[last][n])) for n in got)
            print(
                f"| {behind} | {union:,} | {label} | {len(r.links)} | {len(reads)} | {fetched:,} | "
                f"{fetched / max(union, 1):.3f} | {'yes' if exact else 'NO'} |"
            )


if __name__ == "__main__":
    main()
