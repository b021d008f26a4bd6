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


def test_check_reports_parsing_vote_and_reward_column(monkeypatch, tmp_path):
    def judge(messages):
        user = messages[-1]["content"]
        question = re.search(r"What is (\d+) ([+-]) (\d+)\?", user)
        a, op, b = int(question.group(1)), question.group(2), int(question.group(3))
        reply = int(re.search(r"\[Response\]\n(-?\d+)", user).group(1))
        if a == 13 and b == 14:  # one question's judge never writes a score: both its requests have no verdict
            return "I cannot tell."
        return "Critique ... \\boxed{9}" if reply == (a + b if op == "+" else a - b) else "\\boxed{2}"

    class Scripted(genrm.ScriptedGenRMBackend):
        def __init__(self, *args, **kwargs):
            super().__init__(judge)

    module = _script()
    monkeypatch.setattr(genrm, "HFGenRMBackend", Scripted)
    monkeypatch.setattr("trl_plugins.runtime.models.smollm2_path", lambda: tmp_path)
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
