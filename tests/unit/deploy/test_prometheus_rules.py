"""deploy/prometheus: promtool checks the rules and runs their unit tests; every alert has a
case that fires it and one that does not."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import yaml
from promtool import RULE_TESTS, RULES, promtool


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_promtool_check_rules_passes() -> None:
    done = promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_test_rules_passes() -> None:
    done = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_firing_and_a_non_firing_case() -> None:
    """From the promtool test file: per alert, an evaluation expecting alerts and one expecting
    none (promtool then checks that reality matches)."""
    cases: dict[str, set[str]] = defaultdict(set)
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases[case["alertname"]].add("fires" if case.get("exp_alerts") else "silent")
    names = [a["alert"] for a in _alerts()]
    assert len(names) == len(set(names)), "duplicate alert names"
    missing = {n: {"fires", "silent"} - cases[n] for n in names if cases[n] != {"fires", "silent"}}
    assert not missing, f"alerts without a firing or a non-firing case: {missing}"
    assert set(cases) <= set(names), f"tests of unknown alerts: {set(cases) - set(names)}"


def test_every_alert_has_severity_summary_and_a_justified_threshold() -> None:
    """Each alert carries a severity and a summary; ``for:`` is set except where the expression
    is already a window count (ejections, reloads)."""
    for a in _alerts():
        assert a["labels"]["severity"] in {"critical", "warning", "info"}, a["alert"]
        assert a["annotations"]["summary"], a["alert"]
    text = RULES.read_text()
    for a in _alerts():
        # the rule's comment block (its justification) precedes it in the file
        before = text[: text.index(f"- alert: {a['alert']}")].rstrip().splitlines()[-1].strip()
        assert before.startswith("#") or a["alert"] == "FastrouteConfigReloadFailed", a["alert"]
