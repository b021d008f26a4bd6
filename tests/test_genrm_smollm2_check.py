"""scripts/genrm_smollm2_check.py end to end with a scripted judge in place of builtin:smollm2: the parsing counts,
the vote, the reward column's neutral fill and the right-vs-wrong preference are computed from the judge's answers."""

import importlib.util
import math
import re
from pathlib import Path

from trl_plugins.components import genrm

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("genrm_smollm2_check", ROOT / "scripts" / "genrm_smollm2_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _with_scripted_judge(monkeypatch, tmp_path, judge):
    """The script, its local HF judge replaced by ``judge`` (messages -> answer text)."""

    class Scripted(genrm.ScriptedGenRMBackend):
        def __init__(self, *args, **kwargs):
            super().__init__(judge)

    monkeypatch.setattr(genrm, "HFGenRMBackend", Scripted)
    monkeypatch.setattr("trl_plugins.runtime.models.smollm2_path", lambda: tmp_path)
    return _script()


def test_check_reports_parsing_vote_and_reward_column(monkeypatch, tmp_path):
    def judge(messages):
        user = messages[-1]["content"]
        question = re.search(r"What is (\d+) ([+-]) (\d+)\?", user)
        a, op, b = int(question.group(1)), question.group(2), int(question.group(3))
        reply = int(re.search(r"\[Response\]\n(-?\d+)", user).group(1))
        if a == 13 and b == 14:  # one question's judge never writes a score: both its requests have no verdict
            return "I cannot tell."
        return "Critique ... \\boxed{9}" if reply == (a + b if op == "+" else a - b) else "\\boxed{2}"

    module = _with_scripted_judge(monkeypatch, tmp_path, judge)
    res = module.run(module.parse_args(["--n", "4", "--k", "2", "--json", str(tmp_path / "r.json")]))
    assert res["judgements"] == 16 and res["parsed"] == 12 and res["rows_without_verdict"] == 2
    assert res["mean_vote_right"] == 18.0 and res["mean_vote_wrong"] == 4.0  # the vote sums k = 2 scores
    assert res["right_preferred"] == 1.0 and res["pairs_compared"] == 3
    unjudged = [r for r in res["requests"] if math.isnan(r["vote"])]
    assert len(unjudged) == 2 and all(r["reward"] == 0.0 for r in unjudged)  # a group with no verdict: 0.0
    judged = [r for r in res["requests"] if not math.isnan(r["vote"])]
    assert all(r["reward"] == r["vote"] for r in judged)
    table = module.markdown(res)
    assert "12 of 16 judgements" in table and table.count("\n| What is") == 8


def test_the_rating_template_reads_a_first_line_that_is_a_number_in_range():
    template = _script().rating_template()
    answers = ("8", "7.\nThe answer is right.", " 3.5/10", "27", "3 - 1 = 2", "I rate it 7.", "no idea")
    assert [template.parse(t) for t in answers] == [8.0, 7.0, 3.5, None, None, None, None]
    assert template.protocol == "pointwise" and "{question}" in template.user and "{response}" in template.user


def test_main_runs_one_check_per_template_and_writes_both(monkeypatch, tmp_path):
    import json

    def judge(messages):
        return "\\boxed{6}" if messages[0]["role"] == "system" else "4"

    module = _with_scripted_judge(monkeypatch, tmp_path, judge)
    module.main(["--n", "2", "--k", "1", "--json", str(tmp_path / "r.json")])
    checks = json.loads((tmp_path / "r.json").read_text())["checks"]
    assert [c["template"] for c in checks] == ["deepseek_grm/pointwise", "genrm_smollm2/rating"]
    assert [c["mean_vote_right"] for c in checks] == [6.0, 4.0] and [c["max_tokens"] for c in checks] == [192, 12]
