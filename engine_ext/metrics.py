"""Prometheus metrics of weight updates (served on the engine's own ``/metrics``).

Defined once per process in prometheus_client's default registry, which vLLM's
and SGLang's ``/metrics`` endpoints export.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

UPDATES = Counter("engine_ext_updates_total", "Delta weight updates applied")
FAILURES = Counter("engine_ext_update_failures_total", "Delta weight updates refused or failed", ["reason"])
BYTES = Counter("engine_ext_payload_bytes_total", "Encoded bytes of the applied routes (whole deltas)")
FETCHED = Counter(
    "engine_ext_fetched_bytes_total", "Bytes the ranks of this server fetched from stores, all ranks together"
)
ELEMENTS = Counter("engine_ext_elements_total", "Checkpoint elements changed by applied deltas")
PHASE = Histogram("engine_ext_phase_seconds", "Time per update phase", ["phase"], buckets=_BUCKETS)
VERSION = Gauge("engine_ext_weight_version", "Weight version being served (-1: unknown)")
VERSION.set(-1)
FOLLOW_LAG_VERSIONS = Gauge("engine_ext_follow_lag_versions", "Pull mode: versions between LATEST and the served one")
FOLLOW_LAG_SECONDS = Gauge(
    "engine_ext_follow_lag_seconds", "Pull mode: seconds since a newer LATEST was first seen unserved"
)
FOLLOW_FAILURES = Counter(
    "engine_ext_follow_failures_total", "Pull mode: looks at LATEST or updates that failed", ["reason"]
)


def record_success(
    version: int, payload_bytes: int, fetched_bytes: int, elements: int, phases_s: dict[str, float]
) -> None:
    UPDATES.inc()
    BYTES.inc(payload_bytes)
    FETCHED.inc(fetched_bytes)
    ELEMENTS.inc(elements)
    VERSION.set(version)
    for phase, s in phases_s.items():
        PHASE.labels(phase).observe(s)


def record_failure(reason: str) -> None:
    FAILURES.labels(reason).inc()
