"""The Grafana dashboard and docs/metrics.md stay in step with the metrics the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agentkv.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "agentkv-dashboard.json"


def _exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_dashboard_uses_every_agentkv_metric_and_only_real_ones() -> None:
    text = "\n".join(_exprs())
    for spec in METRICS:
        assert re.search(rf"\b{spec.name}(_total|_bucket|_sum|_count)?\b", text), spec.name
    known = {s.name for s in METRICS} | {"agentkv_engine_reachable"}
    for name in set(re.findall(r"\bagentkv_[a-z_]+", text)):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert base in known, f"dashboard queries {name}, which agentkv does not export"


def test_dashboard_vllm_metrics_exist_in_this_vllm() -> None:
    pytest.importorskip("vllm")
    import vllm.v1.metrics.loggers as loggers

    source = Path(loggers.__file__).read_text()
    for name in set(re.findall(r"vllm:[a-z_]+", "\n".join(_exprs()))):
        base = re.sub(r"_total$", "", name)
        assert f'"{base}"' in source, f"vLLM has no metric {base}"


def test_dashboard_panels_are_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}"


def test_metrics_doc_lists_every_metric_with_its_labels() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for spec in METRICS:
        exported = spec.name + ("_total" if spec.kind == "counter" else "")
        assert f"`{exported}`" in doc, exported
        for label in spec.labels:
            assert label in doc
