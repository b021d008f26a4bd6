"""urpo (URPO): the judge format and its score parsing, the agreement reward of judge rows and the self-judge column on
small inputs, preference data recast as judge rows, the policy judging its open groups through a scripted generation
service (also on two simulated processes), unparsable judgements counted and refused past their share, a trainer run
through the real generation service with open, judge and verifiable rows mixed, the neutral setting and the refusals."""

from __future__ import annotations

import math
import re

import pytest
import torch
from datasets import Dataset

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.services import RunInfo
from trl_plugins.components.genrm import GenRMParseError
from trl_plugins.testing import (
    StubGenerationService,
    assert_reduces_to_vanilla,
    make_reward_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    run_on_processes,
    script_generation,
    stub_rows,
)
from trl_plugins_builtin.urpo import (
    JUDGE_COLUMN,
    SCORE_KEY,
    SELF_COLUMN,
    agreement,
    judge_prompt,
    parse_scores,
    preference_judge_rows,
    self_judge_rewards,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def _stack(**options):
    return build_plugins(["urpo"], {"urpo": options})


def test_parse_scores_reads_the_last_list_of_exactly_n_scores_in_range():
    assert parse_scores("ok <scores>7, 2.5, 10</scores>", 3) == [7.0, 2.5, 10.0]
    assert parse_scores("<scores>1,2,3</scores> then <SCORES>4 5 6</SCORES>", 3) == [4.0, 5.0, 6.0]
    assert parse_scores("<think><scores>1, 1</scores></think> <scores>9, 3</scores>", 2) == [9.0, 3.0]
    assert parse_scores("<scores>7, 2</scores>", 3) is None  # wrong count
    assert parse_scores("<scores>7, 11</scores>", 2) is None  # out of range
    assert parse_scores("<scores>0.5, 1</scores>", 2, low=0.0, high=1.0) == [0.5, 1.0]
    assert parse_scores("Scores: 7, 2", 2) is None and parse_scores(None, 2) is None


def test_agreement_needs_the_labelled_response_strictly_first():
    assert agreement([3.0, 8.0], 2) == 1.0
    assert agreement([8.0, 8.0], 2) == 0.0  # a tie is no agreement
    assert agreement([9.0, 2.0, 5.0], 1) == 1.0 and agreement([9.0, 2.0, 5.0], 3) == 0.0
    assert agreement(None, 1) == 0.0 and agreement([1.0, 2.0], 3) == 0.0


def test_self_judge_column_rescales_fills_missing_with_the_group_mean_and_skips_other_rows():
    scores = [10.0, 1.0, None, 4.0, None, None, 5.0, 5.0]
    is_open = [True, True, True, True, True, True, False, False]
    values, missing = self_judge_rewards(scores, is_open, 2, 1.0, 10.0)
    assert values[:4].tolist() == pytest.approx([1.0, 0.0, 1 / 3, 1 / 3])
    assert values[4:6].tolist() == [0.0, 0.0]  # no score in the whole group: 0 (a neutral advantage)
    assert all(math.isnan(v) for v in values[6:].tolist())  # not open: not applicable
    assert missing.tolist() == [False, False, True, False, True, True, False, False]


def test_the_judge_format_numbers_the_responses_and_names_the_range():
    text = judge_prompt("What is 2+2?", ["4", "5"], low=0, high=5)
    assert "[Question]\nWhat is 2+2?\n[End of Question]" in text
    assert "[Response 1]\n4\n[End of Response 1]\n\n[Response 2]\n5\n[End of Response 2]" in text
    assert "2 candidate responses" in text and "from 0 to 5" in text


def test_preference_rows_become_judge_rows_with_the_chosen_position():
    rows = [{"prompt": [{"role": "user", "content": f"Q{i}"}], "chosen": f"good{i}", "rejected": f"bad{i}"}
            for i in range(12)] + [{"prompt": "Q", "chosen": "good", "rejected": ["bad1", "bad2"]}]
    out = preference_judge_rows(rows, seed=1)
    positions = []
    for row in out:
        text = row["prompt"][0]["content"]
        responses = re.findall(r"\[Response (\d)\]\n(\S+)\n", text)
        assert row["urpo_kind"] == "judge" and set(row) == {"prompt", "urpo_kind", "urpo_best"}
        assert responses[row["urpo_best"] - 1][1].startswith("good")
        positions.append(row["urpo_best"])
    assert len(re.findall(r"\[Response \d\]", out[-1]["prompt"][0]["content"])) == 3  # an N-way example
    assert set(positions[:12]) == {1, 2}  # shuffled: the chosen one is not always first
    assert preference_judge_rows(rows, seed=1) == out  # seeded
    with pytest.raises(ValueError, match="row 0 has no rejected"):
        preference_judge_rows([{"prompt": "Q", "chosen": "a", "rejected": ""}])


def _referee(prompt, j):
    """A referee that scores each response by its length: ``<scores>len_1, ...</scores>`` (clamped to 1..10)."""
    text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    responses = re.findall(r"\[Response \d+\]\n(.*?)\n\[End of Response \d+\]", text, re.DOTALL)
    return "Longer is better. <scores>" + ", ".join(str(min(max(len(r), 1), 10)) for r in responses) + "</scores>"


def test_the_policy_judges_each_open_group_once_and_annotates_its_rows():
    rows = stub_rows(3, 2, urpo_kind=["open", "verifiable", "open"])
    service = StubGenerationService(_referee)
    ctx = make_rollout_context([["aaaa", "a"], ["x", "y"], ["bb", "bbbbbbbbbbbb"]], rows=rows, service=service)
    _stack(verdict_rows=0).call("trl_plugins_after_generation", ctx)
    (call,) = service.calls
    assert len(call) == 2 and "[Question]\nQ0\n" in call[0][0]["content"] and "Q2" in call[1][0]["content"]
    assert [a.get(SCORE_KEY, "none") for a in ctx.annotations] == [4.0, 1.0, "none", "none", 2.0, 10.0]
    assert ctx.metrics["plugins/urpo/judged_groups"] == [2.0]
    assert ctx.metrics["plugins/urpo/unparsable_fraction"] == [0.0]


def test_without_open_rows_nothing_is_asked():
    service = StubGenerationService(_referee)
    ctx = make_rollout_context([["a", "b"]], rows=stub_rows(1, 2), service=service)
    _stack(verdict_rows=0).call("trl_plugins_after_generation", ctx)
    assert service.calls == [] and ctx.annotations == [{}, {}]
    _stack(default_kind="open", self_judge_weight=0.0).call("trl_plugins_after_generation", ctx)
    assert service.calls == []  # self-judging off


def test_unparsable_judgements_are_counted_and_refused_past_their_share():
    def half(prompt, j):
        return "no verdict" if "Q0" in prompt[-1]["content"] else _referee(prompt, j)

    rows = stub_rows(2, 2)
    ctx = make_rollout_context([["a", "bb"], ["c", "dd"]], rows=rows, service=StubGenerationService(half))
    _stack(default_kind="open", verdict_rows=0).call("trl_plugins_after_generation", ctx)  # 1 of 2: at the share, allowed
    assert ctx.metrics["plugins/urpo/unparsable_fraction"] == [0.5]
    assert [a[SCORE_KEY] for a in ctx.annotations] == [None, None, 1.0, 2.0]
    ctx = make_rollout_context([["a", "bb"], ["c", "dd"]], rows=rows, service=StubGenerationService(half))
    with pytest.raises(GenRMParseError, match=r"1 of 2 open groups; first: group 0, text 'no verdict'.*unparsable=0.4"):
        _stack(default_kind="open", max_unparsable=0.4, verdict_rows=0).call("trl_plugins_after_generation", ctx)


def test_groups_are_judged_once_over_two_processes_and_every_process_sees_every_verdict():
    rows = stub_rows(4, 2, urpo_kind="open")
    texts = ["a", "bbb", "cc", "d", "eeee", "e", "f", "ffffff"]

    def work(rank, gather):
        local = slice(4 * rank, 4 * rank + 4)
        ctx = make_rollout_context(texts[local], num_generations=2, rows=rows[local], process_index=rank,
                                   gather=gather, run=RunInfo(num_processes=2), service=StubGenerationService(_referee))
        _stack(verdict_rows=0).call("trl_plugins_after_generation", ctx)
        return [len(c) for c in ctx.service.calls], [a[SCORE_KEY] for a in ctx.annotations]

    (calls0, scores0), (calls1, scores1) = run_on_processes(2, work)
    assert calls0 == [2] and calls1 == [2]  # groups 0, 2 on process 0; 1, 3 on process 1; one call each
    assert scores0 + scores1 == [1.0, 3.0, 2.0, 1.0, 4.0, 1.0, 1.0, 6.0]


def test_the_reward_stage_fills_the_self_judge_column_from_the_annotations():
    rows = stub_rows(3, 2, urpo_kind=["open", "open", "verifiable"])
    annotations = [{SCORE_KEY: 10.0}, {SCORE_KEY: 1.0}, {}, {}, {}, {}]  # group 1: not judged (e.g. a refill round)
    ctx = make_reward_context([[1.0, 0.0]] * 6, num_generations=2, reward_func_names=["acc", SELF_COLUMN],
                              rows=rows, annotations=annotations)
    _stack(judge_weight=0.0).call("trl_plugins_transform_rewards", ctx)
    column = ctx.rewards_per_func[:, 1].tolist()
    assert column[:4] == [1.0, 0.0, 0.0, 0.0] and math.isnan(column[4]) and math.isnan(column[5])
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0] * 6
    assert ctx.metrics["plugins/urpo/unjudged_fraction"] == [0.5]


def test_the_judge_reward_function_rewards_agreement_on_judge_rows_only():
    (judge,) = _stack(self_judge_weight=0.0, judge_weight=0.5).plugins[0].trl_plugins_reward_functions(args=None)
    assert judge.__name__ == JUDGE_COLUMN and judge.reward_weight == 0.5
    (row,) = preference_judge_rows([{"prompt": "Q", "chosen": "good", "rejected": "bad"}])
    best = row["urpo_best"]
    right = "<scores>" + ", ".join("9" if k == best else "2" for k in (1, 2)) + "</scores>"
    wrong = "<scores>" + ", ".join("2" if k == best else "9" for k in (1, 2)) + "</scores>"
    prompts = [row["prompt"]] * 3 + [[{"role": "user", "content": "Q"}]]
    completions = [[{"role": "assistant", "content": t}] for t in (right, wrong, "no verdict", "4")]
    out = judge(prompts, completions, urpo_kind=["judge"] * 3 + [None], urpo_best=[best] * 3 + [None])
    assert out == [1.0, 0.0, 0.0, None]
    with pytest.raises(PluginConfigError, match="urpo_best=None"):
        judge(prompts[:1], completions[:1], urpo_kind=["judge"], urpo_best=[None])


# ---------------------------------------------------------------------------------------------- trainer runs
def _mixed_dataset():
    open_rows = [{"prompt": [{"role": "user", "content": f"Tell me about {w}."}], "urpo_kind": "open", "answer": None,
                  "urpo_best": None} for w in ("cats",)]
    judge_rows = [dict(r, answer=None) for r in preference_judge_rows(
        [{"prompt": f"Say hi {i}", "chosen": "hello there", "rejected": "go away"} for i in range(1)], seed=3)]
    verifiable = [{"prompt": [{"role": "user", "content": "2+2?"}], "urpo_kind": "verifiable", "answer": "4",
                   "urpo_best": None}]
    return Dataset.from_list(open_rows + judge_rows + verifiable)  # one prompt of each kind: one batch holds all


def _accuracy(completions, answer, **kwargs):
    return [None if a is None else float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]


def _policy(prompt_text, row):
    """Player: answers of varying length (verifiable: right on even rows). Referee: scores by length; on the
    preference judge rows it prefers 'hello there' (so its judge reward is 1)."""
    if "[Response 1]" in prompt_text:
        responses = re.findall(r"\[Response \d+\]\n(.*?)\n\[End of Response \d+\]", prompt_text, re.DOTALL)
        if "hello there" in responses:
            return "<scores>" + ", ".join("9" if r == "hello there" else "1" for r in responses) + "</scores>"
        return "<scores>" + ", ".join(str(min(len(r), 10)) for r in responses) + "</scores>"
    if "2+2" in prompt_text:
        return "4" if row % 2 == 0 else "5"
    return "x" * (row % 4 + 1)


def test_a_trainer_run_rewards_open_groups_by_the_policys_own_judgement(tmp_path):
    trainer = make_tiny_trainer(plugins=["urpo"], dataset=_mixed_dataset(), reward_funcs=[_accuracy], max_steps=1,
                                output_dir=str(tmp_path), log_level="error", max_completion_length=32,
                                per_device_train_batch_size=12, num_generations=4)
    script_generation(trainer, _policy)
    run_ = record_run(trainer)
    (rewards,) = run_.rewards
    names = [getattr(f, "__name__", "") for f in trainer.reward_funcs]
    self_col, judge_col = rewards[:, names.index(SELF_COLUMN)], rewards[:, names.index(JUDGE_COLUMN)]
    log = next(log for log in run_.logs if "loss" in log)
    assert log["plugins/urpo/judged_groups"] >= 1.0
    assert log["plugins/urpo/unparsable_fraction"] == 0.0
    opened = ~torch.isnan(self_col)
    assert opened.any() and ((self_col[opened] >= 0) & (self_col[opened] <= 1)).all()
    assert self_col[opened].unique().numel() > 1  # the referee told the group's answers apart
    judged = ~torch.isnan(judge_col)
    assert judged.sum() == 4 and judge_col[judged].eq(1.0).all() and log["plugins/urpo/judge_accuracy"] == 1.0
    assert opened.sum() == 4 and log["plugins/urpo/judged_groups"] == 1.0
    assert not (opened & judged).any()


def test_neutral_setting_is_vanilla_grpo():
    """Both weights 0: no column and no hook, with every row open-ended (the kind that would be self-judged)."""
    assert_reduces_to_vanilla("urpo", {"self_judge_weight": 0.0, "judge_weight": 0.0, "default_kind": "open"},
                              loss_types=("grpo",))


@pytest.mark.parametrize("options, match", [
    ({"score_low": 5.0, "score_high": 5.0}, r"score range \[5.0, 5.0\] is empty"),
    ({"instruction": "Judge {responses}."}, "must contain {question}"),
    ({"instruction": "{question} {responses} {answer}"}, "answer"),
    ({"open_kind": "judge"}, "two different non-empty names"),
    ({"kind_column": ""}, "kind_column=''"),
    ({"max_unparsable": 1.5}, "max_unparsable"),
    ({"self_judge_weight": -1.0}, "self_judge_weight"),
])
def test_bad_options_are_refused_at_construction(options, match):
    with pytest.raises(PluginConfigError, match=match):
        _stack(**options)
