"""ruscarl against the official code: step_power's exponent defaults to 1, 0-point rubric items are left out of the
scaffold, and items tagged for rule checking are checked by rule, never sent to the LLM judge."""

import pytest

from trl_plugins import build_plugins
from trl_plugins_builtin.ruscarl import rule_verdict, scaffold_text, step_decay


def test_step_power_defaults_to_the_official_exponent_one():
    plugin = build_plugins(["ruscarl"], {"ruscarl": {"judge": "rule", "step_rule": "step_power"}}).plugins[0]
    assert plugin.options.power == 1.0
    assert step_decay(6, 11, "step_power") == pytest.approx(0.5)  # (1 - x)^1 at x = 0.5
    assert plugin.row_ratio(0, 2, 5, 11) == (pytest.approx(0.5), pytest.approx(0.5))  # 0-based step 5 = t 6


def test_zero_point_items_are_left_out_of_the_scaffold():
    text = scaffold_text([{"criterion": "Mentions A", "points": 2.0}, {"criterion": "Neutral note", "points": 0.0},
                          {"criterion": "Claims C", "points": -1.0}])
    assert "Neutral note" not in text and "penalty: 0" not in text
    assert "Criterion 1: Mentions A (worth 2 points)" in text and "Criterion 2: Claims C (penalty: 1 points)" in text


RULE_ITEM = {"criterion": "Final answer is 12", "points": 3.0,
             "tags": ["verifier:rule", "function:math_verify", "parameters:12"]}
JUDGE_ITEM = {"criterion": "Explains the steps", "points": 1.0, "tags": ["axis:completeness"]}


def test_rule_verdict():
    assert rule_verdict(RULE_ITEM, "so the result is \\boxed{12}") is True
    assert rule_verdict(RULE_ITEM, "6*2 = 12.0") is True
    assert rule_verdict(RULE_ITEM, "the answer is 13") is False
    assert rule_verdict(RULE_ITEM, "no number at all") is False
    assert rule_verdict(JUDGE_ITEM, "12") is None
    assert rule_verdict({**RULE_ITEM, "tags": ["verifier:rule", "function:other", "parameters:12"]}, "12") is None


class RecordingJudge:
    def __init__(self):
        self.items = []

    def grade(self, requests):
        self.items.extend(r.item["criterion"] for r in requests)
        return [True] * len(requests)


@pytest.mark.parametrize("rule_items, judged, expected", [
    ("rule", ["Explains the steps"] * 2, [1.0, 0.25]),  # 12 is right (3 + 1 of 4), 13 is wrong (1 of 4)
    ("judge", ["Final answer is 12", "Explains the steps"] * 2, [1.0, 1.0]),
])
def test_rule_items_bypass_the_judge(rule_items, judged, expected):
    plugin = build_plugins(["ruscarl"], {"ruscarl": {"judge": "rule", "rule_items": rule_items}}).plugins[0]
    plugin.judge = RecordingJudge()
    prompts = [[{"role": "user", "content": "6*2?"}]] * 2
    completions = [[{"role": "assistant", "content": "6*2 = 12"}], [{"role": "assistant", "content": "it is 13"}]]
    scores = plugin.score(prompts, completions, {"rubrics": [[RULE_ITEM, JUDGE_ITEM]] * 2})
    assert plugin.judge.items == judged
    assert scores == expected
