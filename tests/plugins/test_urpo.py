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
    make_advantage_context,
    make_prompt_context,
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
    VERDICT_KEY,
    agreement,
    judge_prompt,
    parse_scores,
    preference_judge_rows,
    self_judge_rewards,
    subgroup_advantages,
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


# ---------------------------------------------------------------------------------------------- trained verdicts
def _half_referee(prompt, j):
    """Scores by length on even requests, no verdict on odd ones."""
    return _referee(prompt, j) if j % 2 == 0 else "I cannot decide."


def test_the_last_verdict_rows_of_open_groups_are_deferred_at_the_prompt_stage():
    rows = stub_rows(2, 4, urpo_kind=["open", "verifiable"])
    ctx = make_prompt_context(rows, num_generations=4)
    _stack().call("trl_plugins_generation_prompts", ctx)
    assert ctx.deferred == [False, False, True, True, False, False, False, False]
    ctx = make_prompt_context(rows, num_generations=4)
    _stack(verdict_rows=0).call("trl_plugins_generation_prompts", ctx)  # untrained self-judgements: no slot taken
    assert not any(ctx.deferred)


def test_verdicts_fill_the_deferred_slots_under_the_judge_prompt_and_score_the_answers():
    rows = stub_rows(2, 4, urpo_kind=["open", "verifiable"])
    service = StubGenerationService(_half_referee, logprob=-0.5)
    ctx = make_rollout_context([["aaaa", "a", "", ""], ["x", "y", "z", "w"]], rows=rows, service=service,
                               deferred=[2, 3])
    _stack().call("trl_plugins_after_generation", ctx)
    (call,) = service.calls
    assert len(call) == 2 and call[0] == call[1]  # two verdicts on the same judge request
    request = call[0][0]["content"]
    assert "2 candidate responses" in request and "[Response 1]\naaaa\n" in request and "[Response 2]\na\n" in request
    for i in (2, 3):  # verdict rows: trained under the judge prompt, sampled under it (log-probs kept)
        assert ctx.training_prompts[i] == call[0] and not ctx.prompt_swapped[i]
        assert ctx.prompt_ids[i] == ctx.tokenize_prompts([call[0]])[0]
        assert ctx.sampling_logprobs[i] == [-0.5] * len(ctx.completion_ids[i]) and not any(ctx.offpolicy[i])
    assert ctx.completions[2][-1]["content"].endswith("<scores>4, 1</scores>")
    assert [a.get(SCORE_KEY) for a in ctx.annotations[:2]] == [4.0, 1.0]  # the mean of the parsable verdicts (one)
    assert [a.get(VERDICT_KEY) for a in ctx.annotations] == [None, None, 1.0, 0.0, None, None, None, None]
    assert ctx.training_prompts[4:] == ctx.prompts[4:] and all(a == {} for a in ctx.annotations[4:])
    assert ctx.metrics["plugins/urpo/verdict_parsable_fraction"] == [0.5]
    assert ctx.metrics["plugins/urpo/unparsable_fraction"] == [0.0]


def test_the_answers_score_is_the_mean_of_every_parsable_verdict_and_none_when_none_parses():
    texts = iter(["<scores>9, 3</scores>", "<scores>5, 7</scores>", "no", "nothing"])
    service = StubGenerationService(lambda prompt, j: next(texts))
    rows = stub_rows(2, 4, urpo_kind="open")
    ctx = make_rollout_context([["a", "b", "", ""], ["c", "d", "", ""]], rows=rows, service=service,
                               deferred=[2, 3, 6, 7])
    _stack().call("trl_plugins_after_generation", ctx)  # group 1 without a verdict: 1 of 2 groups, allowed (0.5)
    assert [a.get(SCORE_KEY) for a in ctx.annotations] == [7.0, 5.0, None, None, None, None, None, None]
    assert [a.get(VERDICT_KEY) for a in ctx.annotations][2:4] + [a.get(VERDICT_KEY) for a in ctx.annotations][6:] \
        == [1.0, 1.0, 0.0, 0.0]
    assert ctx.metrics["plugins/urpo/unparsable_fraction"] == [0.5]


def test_verdicts_of_a_group_straddling_two_processes_with_uneven_work():
    """G=4 over B=2 rows a process, four processes: group 0's answers on process 0, its verdict slots on process 1
    (only process 1 asks, twice); group 1 (processes 2, 3) is verifiable. Every process calls the service once."""
    rows = stub_rows(2, 4, urpo_kind=["open", "verifiable"])
    texts = ["aaa", "b", "", "", "x", "y", "z", "w"]

    def work(rank, gather):
        local = slice(2 * rank, 2 * rank + 2)
        ctx = make_rollout_context(texts[local], num_generations=4, rows=rows[local], process_index=rank,
                                   gather=gather, run=RunInfo(num_processes=4), deferred=[0, 1] if rank == 1 else [],
                                   service=StubGenerationService(_referee))
        _stack().call("trl_plugins_after_generation", ctx)
        return [len(c) for c in ctx.service.calls], ctx.annotations, ctx.training_prompts

    (calls0, ann0, _), (calls1, ann1, prompts1), (calls2, ann2, _), (calls3, ann3, _) = run_on_processes(4, work)
    assert [calls0, calls1, calls2, calls3] == [[0], [2], [0], [0]]  # one call each, only process 1 asks
    assert [a[SCORE_KEY] for a in ann0] == [3.0, 1.0] and [a[VERDICT_KEY] for a in ann1] == [1.0, 1.0]
    assert "[Response 1]\naaa\n" in prompts1[0][0]["content"] and ann2 == [{}, {}] and ann3 == [{}, {}]


def test_the_reward_stage_gives_verdict_rows_their_format_reward_and_nothing_else():
    rows = stub_rows(2, 4, urpo_kind=["open", "verifiable"])
    annotations = [{SCORE_KEY: 10.0}, {SCORE_KEY: 1.0}, {VERDICT_KEY: 1.0}, {VERDICT_KEY: 0.0}, {}, {}, {}, {}]
    ctx = make_reward_context([[1.0, 0.0]] * 8, num_generations=4, reward_func_names=["acc", SELF_COLUMN],
                              rows=rows, annotations=annotations)
    _stack(judge_weight=0.0).call("trl_plugins_transform_rewards", ctx)
    acc, column = ctx.rewards_per_func[:, 0].tolist(), ctx.rewards_per_func[:, 1].tolist()
    assert column[:4] == [1.0, 0.0, 1.0, 0.0] and all(math.isnan(v) for v in column[4:])
    assert acc[:2] == [1.0, 1.0] and all(math.isnan(v) for v in acc[2:4]) and acc[4:] == [1.0] * 4
    assert ctx.metrics["plugins/urpo/unjudged_fraction"] == [0.0]  # verdict rows are not answers to judge


def test_subgroup_advantages_on_small_tensors():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 1.0, float("nan"), 5.0])
    keys = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    rows = torch.tensor([True] * 6 + [False] * 2)
    adv = subgroup_advantages(rewards, keys, "none", rows)
    assert adv.tolist() == [0.5, -0.5, 0.5, -0.5, 1.0, -1.0, 0.0, 0.0]
    std = torch.tensor([1.0, 0.0]).std().item()
    assert subgroup_advantages(rewards, keys, "group", rows)[:2].tolist() == pytest.approx(
        [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)])
    spread = rewards[:6].std().item()
    assert subgroup_advantages(rewards, keys, "batch", rows)[4].item() == pytest.approx(1.0 / (spread + 1e-4))


def test_groups_with_verdicts_get_sub_group_advantages_and_the_others_keep_trls():
    rewards = [0.9, 0.1, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    annotations = [{SCORE_KEY: 9.0}, {SCORE_KEY: 1.0}, {VERDICT_KEY: 1.0}, {VERDICT_KEY: 0.0}, {}, {}, {}, {}]
    ctx = make_advantage_context(rewards, num_generations=4, annotations=annotations)
    before = ctx.advantages.clone()
    _stack().call("trl_plugins_transform_advantages", ctx)  # scale_rewards "group": each sub-group's own std
    answers, verdicts = torch.tensor([0.9, 0.1]).std().item() + 1e-4, torch.tensor([1.0, 0.0]).std().item() + 1e-4
    assert ctx.advantages[:4].tolist() == pytest.approx([0.4 / answers, -0.4 / answers, 0.5 / verdicts,
                                                         -0.5 / verdicts])
    assert torch.equal(ctx.advantages[4:], before[4:])
    ctx = make_advantage_context(rewards, num_generations=4, annotations=[{}] * 8)
    before = ctx.advantages.clone()
    _stack().call("trl_plugins_transform_advantages", ctx)  # no verdict row (a refill round, eval): TRL's
    assert torch.equal(ctx.advantages, before)


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
    trainer = make_tiny_trainer(plugins=["urpo"], plugin_config={"urpo": {"verdict_rows": 0}},
                                dataset=_mixed_dataset(), reward_funcs=[_accuracy], max_steps=1,
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


def _referee_policy(prompt_text, row):
    """As :func:`_policy`, but the referee's verdicts on the open group alternate parsable / not."""
    if "[Response 1]" in prompt_text and "hello there" not in prompt_text and row % 2 == 1:
        return "I cannot decide."
    return _policy(prompt_text, row)


def test_a_trainer_run_trains_the_verdicts_in_the_step_that_writes_them(tmp_path):
    """G=4, one open, one judge and one verifiable prompt: the open group is 2 answers and 2 verdict rows (trained
    under the judge prompt, rewarded 1 / 0 by format, advantages within the 2 verdicts); the loss sees them."""
    from trl_plugins.runtime.trl_seam import replace_trl_method

    trainer = make_tiny_trainer(plugins=["urpo"], dataset=_mixed_dataset(), reward_funcs=[_accuracy], max_steps=1,
                                output_dir=str(tmp_path), log_level="error", max_completion_length=32,
                                per_device_train_batch_size=12, num_generations=4)
    script_generation(trainer, _referee_policy)
    seen = []

    def gen(inputs):
        out = original(inputs)
        seen.append(out)
        return out

    original = replace_trl_method(trainer, "generate_and_score_completions", gen)
    run_ = record_run(trainer)
    (rewards,), (out,) = run_.rewards, seen
    names = [getattr(f, "__name__", "") for f in trainer.reward_funcs]
    self_col, acc_col = rewards[:, names.index(SELF_COLUMN)], rewards[:, names.index(_accuracy.__name__)]
    tok = trainer.processing_class
    prompts = [tok.decode(ids[m.bool()]) for ids, m in zip(out["prompt_ids"], out["prompt_mask"])]
    verdict = torch.tensor(["[Response 1]" in p and "hello there" not in p for p in prompts])
    answers = torch.tensor(["Tell me about cats" in p for p in prompts]) & ~verdict
    assert verdict.sum() == 2 and answers.sum() == 2  # the open group: 2 answers, 2 verdicts of them
    assert all("2 candidate responses" in p for p, v in zip(prompts, verdict) if v)
    assert sorted(self_col[verdict].tolist()) == [0.0, 1.0] and acc_col[verdict].isnan().all()
    texts = tok.batch_decode(out["completion_ids"][verdict], skip_special_tokens=True)
    assert sorted(t.strip() for t in texts)[0] == "<scores>1, 2</scores>"  # the parsable verdict scores 'x', 'xx'
    assert self_col[answers].tolist() == pytest.approx([0.0, 1 / 9])  # (s - 1) / 9 from that verdict
    adv = run_.advantages[0]
    assert adv[verdict].sum().abs() < 1e-5 and adv[verdict].abs().min() > 0.5  # their own sub-group
    assert adv[answers].sum().abs() < 1e-5 and adv[answers].abs().min() > 0.5
    log = next(log for log in run_.logs if "loss" in log)
    assert log["plugins/urpo/verdict_parsable_fraction"] == 0.5 and log["plugins/urpo/judge_accuracy"] == 1.0
    assert log["plugins/urpo/verdict_fraction"] == pytest.approx(2 / 12)


def test_a_verdict_count_that_leaves_too_few_answers_is_refused_when_the_trainer_is_built(tmp_path):
    with pytest.raises(PluginConfigError, match=r"verdict_rows=3 with num_generations=4"):
        make_tiny_trainer(plugins=["urpo"], plugin_config={"urpo": {"verdict_rows": 3}}, dataset=_mixed_dataset(),
                          reward_funcs=[_accuracy], max_steps=1, output_dir=str(tmp_path),
                          per_device_train_batch_size=12, num_generations=4)


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
    ({"verdict_rows": 1}, r"verdict_rows=1; allowed: 0 .* or 2 and more"),
    ({"verdict_rows": -2}, "verdict_rows"),
])
def test_bad_options_are_refused_at_construction(options, match):
    with pytest.raises(PluginConfigError, match=match):
        _stack(**options)
