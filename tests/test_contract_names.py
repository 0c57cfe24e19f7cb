"""The catalogue matches the metric contract (shared/metrics.md) and docs/metrics.md documents it."""

import re
from pathlib import Path

import pytest

from gpuwatch.exporter.catalogue import CATALOGUE

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT.parent / "shared" / "metrics.md"


def contract_rows():
    rows = {}
    for line in CONTRACT.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)]
        if len(cells) < 5 or not cells[1].startswith("gpuwatch_"):
            continue
        names, kind, labels = cells[1], cells[2], cells[3]
        base = names.split(" / ")[0]
        stem = base.rsplit("_", 2)[0] if " / " in names else None
        all_names = [base] + [stem + "_" + part.strip("_") for part in names.split(" / ")[1:]] if stem else [base]
        label_names = [l.split("=")[0].strip(" `") for l in labels.split(",") if l.strip()]
        for name in all_names:
            rows[name] = (kind, tuple(label_names))
    return rows


@pytest.mark.skipif(not CONTRACT.exists(), reason="shared/metrics.md is not beside the checkout")
def test_every_contract_metric_is_in_the_catalogue_with_its_type_and_labels():
    rows = contract_rows()
    assert len(rows) > 40
    for name, (kind, labels) in rows.items():
        spec = CATALOGUE[name]
        assert spec.type == kind, name
        assert spec.labels == labels, name


def test_docs_list_every_metric():
    text = (ROOT / "docs" / "metrics.md").read_text()
    for name in CATALOGUE:
        assert f"`{name}`" in text, name
