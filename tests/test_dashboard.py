"""docs/grafana/engine_ext.json queries only what engine_ext exports: every series name in every
panel's PromQL is one that a collector of engine_ext/metrics.py exposes (a Counter's ``_total``, a
Histogram's ``_bucket``/``_sum``/``_count``, a Gauge's name), every label it filters or groups by is
one of that collector's labels, and every ``phase`` it selects is a phase the update transaction
times (engine_ext/server/transaction.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from engine_ext import metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "engine_ext.json"


def exported() -> dict[str, tuple[str, ...]]:
    """Every sample name engine_ext's collectors export -> that collector's label names."""
    out = {}
    for obj in vars(metrics).values():
        if not isinstance(obj, MetricWrapperBase):
            continue
        base, kind, labels = obj._name, obj._type, tuple(obj._labelnames)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}[kind]
        out.update({base + s: labels + (("le",) if s == "_bucket" else ()) for s in suffixes})
    return out


def queries(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k in ("expr", "query") and isinstance(v, str)] + \
            [q for v in node.values() for q in queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in queries(v)]
    return []


def test_the_dashboard_queries_only_exported_metrics_labels_and_phases():
    dash = json.loads(DASHBOARD.read_text())
    names = exported()
    exprs = queries(dash)
    assert len(dash["panels"]) >= 8 and len(exprs) >= 15
    used = set()
    for expr in exprs:
        for series, body in re.findall(r"(engine_ext_[a-z_]+)(\{[^}]*\})?", expr):
            assert series in names, f"{series} is not exported by engine_ext/metrics.py: {expr}"
            used.add(series)
            for label in re.findall(r"(\w+)\s*=~?", body):
                assert label in names[series] + ("job", "instance"), f"{series} has no label {label!r}: {expr}"
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",")):
                series = re.findall(r"engine_ext_[a-z_]+", expr)
                assert any(label in names[s] for s in series), f"no series in {expr} has the label {label!r}"
    # what an operator asks first: latency, pause, bytes, refusals by reason, follow lag
    for must in ("engine_ext_phase_seconds_bucket", "engine_ext_fetched_bytes_total", "engine_ext_update_failures_total",
                 "engine_ext_follow_lag_versions", "engine_ext_weight_version"):
        assert must in used, must
    timed = set(re.findall(r'phases\["(\w+)"\]|_timed(?:_sync)?\("(\w+)"', (ROOT / "engine_ext/server/transaction.py").read_text()))
    timed = {a or b for a, b in timed}
    for phase in re.findall(r'phase="(\w+)"', "\n".join(exprs)):
        assert phase in timed, f"the dashboard selects phase {phase!r}; the transaction times {sorted(timed)}"
