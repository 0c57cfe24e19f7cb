"""The one XID table (gpuwatch/groups/xid.py XIDS): its shape, what reads it, and the copy in docs/runbooks.md.

The runbook's table is generated from the code and checked here, so the two cannot drift; regenerate it with
GPUWATCH_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_xids.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpuwatch.groups.xid import CRITICAL_XIDS, XID_SEVERITIES, XIDS, describe
from gpuwatch.rules import health

RUNBOOKS = Path(__file__).resolve().parent.parent / "docs" / "runbooks.md"
BEGIN = "<!-- xid-table: generated from XIDS in gpuwatch/groups/xid.py; tests/test_xids.py checks it -->"
END = "<!-- /xid-table -->"


def xid_table() -> str:
    rows = ["| XID | meaning | severity | action |", "|---|---|---|---|"]
    rows += [f"| {code} | {meaning} | {severity} | {action} |" for code, (meaning, severity, action) in XIDS.items()]
    return "\n".join(rows)


def test_the_runbook_table_is_the_code_table():
    text = RUNBOOKS.read_text()
    assert BEGIN in text and END in text, "docs/runbooks.md lost its XID table markers"
    before, rest = text.split(BEGIN, 1)
    current, after = rest.split(END, 1)
    expected = "\n\n" + xid_table() + "\n\n"
    if os.environ.get("GPUWATCH_UPDATE_GOLDEN") == "1":
        RUNBOOKS.write_text(before + BEGIN + expected + END + after)
        current = expected
    assert current == expected, "docs/runbooks.md's XID table differs from XIDS; regenerate with GPUWATCH_UPDATE_GOLDEN=1"


def test_every_entry_has_a_meaning_a_known_severity_and_an_action():
    assert list(XIDS) == sorted(XIDS) and max(XIDS) == 172
    for code, (meaning, severity, action) in XIDS.items():
        assert severity in XID_SEVERITIES, code
        assert meaning and action and "|" not in meaning + action, code
        assert meaning == meaning.strip() and not meaning.endswith("."), code


def test_the_codes_the_brief_names_are_all_there():
    """The common and data-center codes: every one of them has an entry."""
    named = {13, 31, 32, 38, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120, 121, 122, 123,
             136, 137, 140, 143, *range(144, 173)}
    assert named - set(XIDS) == {152, 153}  # DLA errors: not on any data-center GPU in the catalog
    assert not ({152, 153} & set(XIDS))


def test_the_critical_set_keeps_every_code_that_was_critical_and_no_application_fault():
    """The nine codes that were critical before the table stay critical (their alerts do not change); the
    GPU's own troubles were added; application faults, 63, 94 and 154 never fire xid_critical."""
    assert {48, 62, 64, 74, 79, 95, 119, 120, 140} <= CRITICAL_XIDS
    assert CRITICAL_XIDS == {46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 158, 171, 172}
    assert not {13, 31, 43, 45, 63, 94, 154} & CRITICAL_XIDS
    assert set(health.CRITICAL_XIDS) == CRITICAL_XIDS
    assert health.CRITICAL_XIDS[48] == "double-bit ECC error" and health.CRITICAL_XIDS[79] == "GPU has fallen off the bus"
    assert all(XIDS[code][1] == "application" for code in (13, 31, 43, 45))


def test_an_unknown_code_is_described_as_unknown_never_guessed():
    assert describe(999) == ("unknown XID", "unknown", "see NVIDIA's Xid catalog")
    assert describe(79) == XIDS[79]


def test_the_xid_critical_condition_lists_the_table_s_critical_codes():
    rule = next(r for r in health.RULES if r.id == "xid_critical")
    listed = {int(c) for c in re.findall(r"\d+", rule.condition.split("(", 1)[1].split(";", 1)[0])}
    assert listed == CRITICAL_XIDS
