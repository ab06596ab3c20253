"""docs/grafana-tokenmill.json asks only for metrics docs/metrics.md lists (a histogram by its base name,
a counter with or without `_total`), so a renamed metric cannot leave a panel silently empty."""

from __future__ import annotations

import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_panel_queries_a_documented_metric() -> None:
    dashboard = json.loads((DOCS / "grafana-tokenmill.json").read_text())
    documented = (DOCS / "metrics.md").read_text()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    names = {re.sub(r"_bucket$", "", n) for e in exprs for n in re.findall(r"tokenmill:[a-z_]+", e)}
    assert len(names) > 20
    missing = sorted(n for n in names if n not in documented and n.removesuffix("_total") not in documented)
    assert not missing, missing
