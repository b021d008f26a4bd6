"""ampo: AMPO multi-teacher guidance (from the official code).

The adaptive number of injected solutions, the solutions column's formats, the answer-token span, the official score
(ground truth written after the solution's <answer> tag, 0.1-weighted format reward), the sampling hook
(only failing groups are guided, the most comprehensible solutions under the policy replace failed rows, off-policy
with NaN sampling log-probs, G kept), endpoint teachers through a loopback OpenAI-compatible server, refusals at
construction, the neutral setting and a tiny-model run."""

import math
import warnings

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.components.local_server import chat_response, serve_openai_compatible
from trl_plugins.components.teacher import clear_shared_teachers
from trl_plugins.api.services import RunInfo
from trl_plugins.testing import (
    assert_group_sizes,
    assert_offpolicy_logprobs_nan,
    assert_reduces_to_vanilla,
    build_stack,
    char_encode,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    run_hook,
    stub_rows,
)
from trl_plugins.api.text import completion_text
from trl_plugins_builtin.ampo import (
    answer_token_span,
    format_reward,
    ground_truth_answer_text,
    guidance_count,
    mean_probability,
    selection_score,
    solution_texts,
)


@pytest.mark.parametrize("successes,available,trigger,expected", [
    (0, 4, "below_pass", 4),  # all fail, G = 8: up to half the group
    (0, 2, "below_pass", 2),  # fewer solutions than slots
    (3, 4, "below_pass", 1),  # tops the group up to 4 successes
    (4, 4, "below_pass", 0),  # at the pass threshold: no guidance
    (1, 4, "all_fail", 0),
    (0, 4, "all_fail", 4),
])
def test_adaptive_guidance_count(successes, available, trigger, expected):
    assert guidance_count(successes, available, 8, 0.5, trigger) == expected


def test_solution_texts_formats():
    assert solution_texts(["a", " ", {"content": "b", "source": "T2"}, None, "c"], 10) == ["a", "b", "c"]
    assert solution_texts("only one", 4) == ["only one"]
    assert solution_texts(["a", "b", "c"], 2) == ["a", "b"]


def test_answer_token_span_is_the_last_occurrence():
    ids, start, end = answer_token_span("2+2=4\nAnswer: 4", "4", _Tok())
    assert ids == char_encode("2+2=4\nAnswer: 4") and (start, end) == (14, 15)
    assert answer_token_span("no answer here", "4", _Tok())[1:] == (0, 0)
    assert mean_probability(torch.log(torch.tensor([0.1, 0.5, 0.9])), 1, 3) == pytest.approx(0.7)


class _Tok:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": char_encode(text)}


def _correct(completions, **kwargs):
    return [1.0 if "42" in completion_text(c) else 0.0 for c in completions]


GOOD = ord("!")  # the stub policy finds any solution containing "!" likely


def _policy(prompt_ids, completion_ids):
    return [torch.full((len(c),), math.log(0.9 if GOOD in c else 0.2)) for c in completion_ids]


def _context(solutions, completions, policy=_policy, **kwargs):
    rows = stub_rows(2, 4, teacher_solutions=solutions, answer="42")
    return make_rollout_context(completions, rows=rows, reward_funcs=[_correct], policy_logprobs=policy,
                                run=RunInfo(max_completion_length=64), **kwargs)


def test_failing_group_gets_the_most_comprehensible_solutions():
    sols = ["plain 42", "clear! so 42", "also! 42", "odd 42"]
    ctx = _context([sols, sols], [["a", "b", "c", "d"], ["42", "42", "x", "y"]])
    before = [list(x) for x in ctx.completion_ids]
    run_hook("ampo", "trl_plugins_after_generation", ctx)
    injected = [i for i in range(8) if ctx.annotations[i].get("teacher_guided")]
    assert len(injected) == 2 and all(ctx.group_ids[i] == 0 for i in injected)  # k = 4/2 - 0 = 2; group 1 passes
    texts = sorted(ctx.tokenizer.decode(ctx.completion_ids[i], skip_special_tokens=True) for i in injected)
    assert texts == ["also! 42", "clear! so 42"]  # the two the policy finds likeliest
    for i in range(8):
        if i in injected:
            assert all(ctx.offpolicy[i]) and ctx.completion_ids[i][-1] == 0  # EOS
        else:
            assert ctx.completion_ids[i] == before[i] and not any(ctx.offpolicy[i])
    assert_group_sizes(ctx)
    assert_offpolicy_logprobs_nan(ctx)
    assert ctx.metrics["plugins/ampo/injected_rows"] == [2]
    assert ctx.metrics["plugins/ampo/injected_success_rate"] == [1.0]
    assert ctx.metrics["plugins/ampo/guided_group_fraction"] == [0.5]


def test_answer_likelihood_scores_only_the_answer_tokens():
    # the policy gives "!"-containing rows 0.9 everywhere: the score is 0.9 on the answer span, 0 without an answer
    sols = ["no answer!", "reasoning 42"]
    ctx = _context([sols, sols], [["a", "b", "c", "d"], ["a", "b", "c", "d"]])
    run_hook("ampo", "trl_plugins_after_generation", ctx,
             options={"answer_span": "last_occurrence", "format_coefficient": 0.0})
    first = next(i for i in range(4) if ctx.annotations[i].get("teacher_guided"))
    assert ctx.tokenizer.decode(ctx.completion_ids[first], skip_special_tokens=True) in sols
    assert ctx.metrics["plugins/ampo/selected_score_mean"][0] == pytest.approx((0.0 + 0.2) / 2)


def test_all_fail_trigger_leaves_partly_solved_groups():
    sols = ["s! 42"]
    ctx = _context([sols, sols], [["a", "b", "c", "d"], ["42", "b", "c", "d"]])
    run_hook("ampo", "trl_plugins_after_generation", ctx, {"ampo": {"trigger": "all_fail"}})
    guided = {ctx.group_ids[i] for i in range(8) if ctx.annotations[i].get("teacher_guided")}
    assert guided == {0}


def test_endpoint_teachers_through_a_loopback_server():
    def handler(path, payload):
        return chat_response(f"teacher {payload['model']}! 42")

    clear_shared_teachers()
    try:
        with serve_openai_compatible(handler) as url:
            stack = build_stack("ampo", {"ampo": {"teachers": "endpoint", "teacher_models": ["t1", "t2"],
                                                  "teacher_base_urls": [url], "selection": "sequence_likelihood"}})
            ctx = _context(["unused"], [["a", "b", "c", "d"], ["a", "b", "c", "d"]])
            run_hook(stack, "trl_plugins_after_generation", ctx)
        texts = {ctx.tokenizer.decode(ctx.completion_ids[i], skip_special_tokens=True)
                 for i in range(8) if ctx.annotations[i].get("teacher_guided")}
        assert texts == {"teacher t1! 42", "teacher t2! 42"}
    finally:
        clear_shared_teachers()


def test_option_and_column_refusals():
    with pytest.raises(PluginConfigError, match="teacher_models"):
        build_plugins(["ampo"], {"ampo": {"teachers": "endpoint"}})
    with pytest.raises(PluginConfigError, match="teacher_base_urls"):
        build_plugins(["ampo"], {"ampo": {"teachers": "endpoint", "teacher_models": ["a", "b", "c"],
                                          "teacher_base_urls": ["u1", "u2"]}})
    with pytest.raises(PluginConfigError, match="teacher_solutions"):
        make_tiny_trainer(plugins=["ampo"])  # the tiny dataset has no 'teacher_solutions' column


def test_neutral_setting_is_vanilla():
    # every rollout passes a threshold of -1: no group is guided
    assert_reduces_to_vanilla("ampo", {"solutions_column": "solution", "success_threshold": -1.0},
                              loss_types=("dapo",), steps=1)


def test_tiny_run_injects_reference_solutions():
    trainer = make_tiny_trainer(plugins=["ampo"], plugin_config={"ampo": {"solutions_column": "solution"}},
                                max_steps=1, max_completion_length=48)
    run = record_run(trainer)
    logs = {k: v for log in run.logs for k, v in log.items()}
    assert logs["plugins/ampo/injected_rows"] > 0
    assert logs["plugins/ampo/injected_success_rate"] == 1.0
    assert 0 < logs["plugins/framework/offpolicy_token_fraction"] < 1


def test_stacked_with_dynamic_sampling_guided_groups_are_mixed_and_kept():
    """ampo + dynamic_sampling (a stack users will try): on the untrained tiny model every group fails; ampo's guidance
    puts the reference solution into each, so every group is mixed and DAPO's filter (which judges the groups after
    the sampling hooks) rejects none of them: no refill round, no refill rollout."""
    trainer = make_tiny_trainer(plugins=["ampo", "dynamic_sampling"],
                                plugin_config={"ampo": {"solutions_column": "solution"}},
                                max_steps=1, max_completion_length=48)
    run = record_run(trainer)
    logs = {k: v for log in run.logs for k, v in log.items()}
    assert logs["plugins/ampo/injected_rows"] > 0
    G = trainer.num_generations
    for rewards in run.rewards:
        rate = rewards[:, 0].view(-1, G).mean(1)
        assert ((rate > 0) & (rate < 1)).all()
    assert logs["plugins/framework/rejected_groups"] == 0
    assert logs["plugins/framework/refill_rollouts"] == 0


def test_official_answer_rewrite_and_format_reward():
    tags = ["<answer>", "</answer>"]
    assert ground_truth_answer_text("x=4 <answer>\n 5</answer>", "4", tags) == ("x=4 <answer>\n ", "4", " </answer>")
    assert ground_truth_answer_text("x=4 <answer>5", "4", tags) == ("x=4 <answer> ", "4", " </answer>")
    # no tag, two tags, or nothing after the tag: the answer is appended to the whole solution
    for bad in ("x=4", "<answer>1<answer>2", "x <answer>  "):
        assert ground_truth_answer_text(bad, "4", tags) == (bad + "<answer> ", "4", " </answer>")
    assert format_reward("a <answer>4</answer> b", tags) == 1.0
    assert format_reward("a </answer>4<answer>", tags) == 0.0 and format_reward("<answer>4", tags) == 0.0
    assert selection_score(0.5, 1.0, 0.1) == pytest.approx(0.55) and selection_score(0.5, 0.0, 0.1) == 0.45


def test_default_score_is_the_ground_truth_after_the_answer_tag_plus_format():
    # every token of a "!"-solution is 0.9 likely, others 0.2; the ground truth "42" is scored where the solution's
    # answer stands (its own answer "41" is wrong), and the format reward decides between equal likelihoods
    sols = ["work <answer>41</answer>", "work!  <answer> 41", "plain 42", "work! no tags 42"]
    scored = []

    def policy(prompt_ids, completion_ids):
        scored.extend(completion_ids)
        return _policy(prompt_ids, completion_ids)

    ctx = _context([sols, sols], [["a", "b", "c", "d"], ["a", "b", "c", "d"]], policy=policy)
    run_hook("ampo", "trl_plugins_after_generation", ctx, options={"pass_fraction": 1.0})
    seen = [ctx.tokenizer.decode(ids, skip_special_tokens=True) for ids in scored]
    assert seen[:4] == ["work <answer> 42 </answer>", "work!  <answer> 42 </answer>", "plain 42<answer> 42 </answer>",
                        "work! no tags 42<answer> 42 </answer>"]
    # scores 0.9 * 0.2 + 0.1 (format), 0.9 * 0.9 + 0 (one tag only), 0.9 * 0.2, 0.9 * 0.9: k = 4, all injected
    expected = sorted([0.28, 0.81, 0.18, 0.81], reverse=True)
    assert ctx.metrics["plugins/ampo/selected_score_mean"][0] == pytest.approx(sum(expected) / 4, abs=1e-6)
    injected = sorted(ctx.tokenizer.decode(ctx.completion_ids[i], skip_special_tokens=True)
                      for i in range(4) if ctx.annotations[i].get("teacher_guided"))
    assert injected == sorted(sols)  # the teachers' solutions as written, not the rewritten scoring texts


def test_format_tags_are_checked():
    with pytest.raises(PluginConfigError, match="format_tags"):
        build_stack("ampo", {"ampo": {"format_tags": ["<answer>"]}})


def test_std_scaled_advantages_are_warned_about():
    # official: norm_adv_by_std_in_grpo=False (train_ampo.sh:117), i.e. TRL's scale_rewards="none"
    with pytest.warns(UserWarning, match="scale_rewards='none'"):
        build_stack("ampo", num_generations=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_stack("ampo", num_generations=4, scale_rewards="none")
