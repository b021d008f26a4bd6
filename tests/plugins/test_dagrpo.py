"""DaGRPO: the pair-masked advantage on hand-made groups (delta = 0
is mean-centred GRPO, all-equal scores give zeros, a symmetric mask sums to zero), the three scorers, the anchors
of the sampling stage, the scores carried from the reward stage to the advantage stage, and two end-to-end runs
(neutral setting == trl.GRPOTrainer; anchors trained off-policy)."""

import math

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import PluginConfigError, PluginError, build_plugins
from trl_plugins.tasks.arithmetic import Problem
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_reward_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    stub_rows,
    tiny_dataset,
    tiny_tokenizer,
)
from trl_plugins.api.text import completion_text
from trl_plugins_builtin.dagrpo import (
    ANCHOR_ANNOTATION,
    DaGRPOOptions,
    anchor_slots,
    edit_similarity,
    ngram_jaccard,
    pairwise_advantages,
    prm_score,
    score_distinctiveness,
    similarity_distinctiveness,
)

# ------------------------------------------------------------------------------------------ pair-masked advantage
A = torch.tensor([1.5, 0.5, -0.5, -1.5])
S = torch.tensor([1.0, 0.95, 0.2, 0.1])  # d01 = 0.05 < 0.1 is masked; d23 = 0.1 survives (>= delta)


def _keep(scores, delta, G=4):
    return score_distinctiveness(scores, G) >= delta


def test_hand_computed_surviving_normaliser():
    # S_0 = S_1 = {2, 3}, S_2 = {0, 1, 3}, S_3 = {0, 1, 2}: A_i = a_i - mean_{S_i}(a)
    out = pairwise_advantages(A, _keep(S, 0.1), "surviving")
    torch.testing.assert_close(out, torch.tensor([2.5, 1.5, -0.5 - 1 / 6, -2.0]))


def test_hand_computed_group_normaliser():
    # sum_{j in S_i} (a_i - a_j) / G = [5, 3, -2, -6] / 4
    out = pairwise_advantages(A, _keep(S, 0.1), "group")
    torch.testing.assert_close(out, torch.tensor([1.25, 0.75, -0.5, -1.5]))
    assert float(out.sum()) == pytest.approx(0.0, abs=1e-6)  # symmetric mask


@pytest.mark.parametrize("normalizer", ["surviving", "group"])
@pytest.mark.parametrize("seed", range(5))
def test_delta_zero_is_mean_centred_grpo(normalizer, seed):
    g = torch.Generator().manual_seed(seed)
    G = 2 + seed
    rewards = torch.rand(3 * G, generator=g)
    mean = rewards.view(-1, G).mean(1, keepdim=True)
    std = rewards.view(-1, G).std(1, keepdim=True)
    a = ((rewards.view(-1, G) - mean) / (std + 1e-4)).view(-1)  # TRL's advantages (scale_rewards="group")
    keep = _keep(torch.rand(3 * G, generator=g), 0.0, G)
    assert keep.all()
    out = pairwise_advantages(a, keep, normalizer)
    assert torch.equal(out, a)  # exactly the incoming advantages ...
    # ... which are the pairwise form (1/G) sum_j (R_i - R_j) / sigma, written out
    R, sigma = rewards.view(-1, G), std + 1e-4
    expected = ((R.unsqueeze(2) - R.unsqueeze(1)).sum(2) / G / sigma).view(-1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_uncentred_incoming_advantages_keep_their_group_offset():
    a = A + 3.0  # e.g. an earlier plugin's advantages with group mean 3
    for normalizer in ("surviving", "group"):
        out = pairwise_advantages(a, _keep(S, 0.1), normalizer)
        torch.testing.assert_close(out, 3.0 + pairwise_advantages(A, _keep(S, 0.1), normalizer))
    assert torch.equal(pairwise_advantages(a, _keep(S, 0.0), "surviving"), a)
    assert torch.equal(pairwise_advantages(a, _keep(torch.zeros(4), 0.1), "surviving"), torch.zeros(4))


@pytest.mark.parametrize("normalizer", ["surviving", "group"])
def test_all_equal_scores_give_zero(normalizer):
    out = pairwise_advantages(A, _keep(torch.full((4,), 0.3), 0.05), normalizer)
    assert torch.equal(out, torch.zeros(4))


@pytest.mark.parametrize("seed", range(10))
def test_symmetric_mask_sums_to_zero(seed):
    g = torch.Generator().manual_seed(seed)
    G = 5
    a = torch.randn(2, G, generator=g)
    a = (a - a.mean(1, keepdim=True)).view(-1)  # centred, as TRL's advantages
    upper = torch.rand(2, G, G, generator=g) > 0.5
    keep = torch.triu(upper, diagonal=1)
    keep = keep | keep.transpose(1, 2)  # symmetric, empty diagonal
    torch.testing.assert_close(pairwise_advantages(a, keep, "group").view(2, G).sum(1), torch.zeros(2), atol=1e-6,
                               rtol=0)
    # the surviving-pairs normaliser sums to zero when every row keeps as many pairs (a regular mask)
    ring = torch.zeros(1, G, G, dtype=torch.bool)
    for i in range(G):
        ring[0, i, (i + 1) % G] = ring[0, (i + 1) % G, i] = True
    assert float(pairwise_advantages(a[:G], ring, "surviving").sum()) == pytest.approx(0.0, abs=1e-6)


def test_token_level_advantages_are_masked_per_column():
    a = torch.stack([A, 2 * A, -A], dim=1)  # (4, 3)
    out = pairwise_advantages(a, _keep(S, 0.1), "surviving")
    for t in range(3):
        torch.testing.assert_close(out[:, t], pairwise_advantages(a[:, t].contiguous(), _keep(S, 0.1), "surviving"))


# ------------------------------------------------------------------------------------------ scorers
def test_ngram_jaccard_and_edit_similarity():
    assert ngram_jaccard(list("abcd"), list("abce"), 2) == pytest.approx(2 / 4)  # {ab, bc} of {ab, bc, cd, ce}
    assert ngram_jaccard(list("ab"), list("ab"), 3) == 1.0  # shorter than n: one gram
    assert ngram_jaccard([], [], 2) == 1.0 and ngram_jaccard([], list("a"), 2) == 0.0
    assert edit_similarity(list("kitten"), list("sitting")) == pytest.approx(1 - 3 / 7)
    assert edit_similarity([], []) == 1.0 and edit_similarity(list("ab"), []) == 0.0


def test_similarity_distinctiveness_is_symmetric_with_zero_diagonal():
    tokens = [list("3+4=7"), list("3+4=7"), list("xyz"), list("3+4=8")]
    d = similarity_distinctiveness(tokens, 4, "jaccard", 2)
    assert torch.equal(d, d.transpose(1, 2)) and torch.all(torch.diagonal(d, dim1=1, dim2=2) == 0)
    assert d[0, 0, 1] == 0.0 and d[0, 0, 2] == 1.0
    assert d[0, 0, 3] == pytest.approx(1 - 3 / 5)  # bigrams {3+,+4,4=,=7} vs {3+,+4,4=,=8}


PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])  # 3+4=7, 7*2=14, Answer: 14


def test_prm_score_is_the_mean_step_score():
    assert prm_score(PROBLEM.to_json(), PROBLEM.solution) == 1.0
    assert prm_score(PROBLEM.to_json(), "3+4=7\n7*2=15\nAnswer: 15") == pytest.approx(1 / 3)
    assert prm_score(PROBLEM.to_json(), "") == 0.0


def test_anchor_slots():
    success = torch.tensor([[False, False, False], [True, False, False], [False, True, False], [True, True, True]])
    assert anchor_slots(success, 1, 0) == [0, -1, -1, -1]
    assert anchor_slots(success, 2, 1) == [1, 1, 2, -1]  # slot 1 failed -> 1; group 2: slot 1 succeeded -> next
    assert anchor_slots(success, 1, 9) == [2, -1, -1, -1]  # clamped to G - 1


# ------------------------------------------------------------------------------------------ reward -> advantage
def _reward_ctx(texts, G, rows):
    return make_reward_context(torch.zeros(len(texts), 1), num_generations=G, reward_func_names=["r"], rows=rows,
                               completions=[[{"role": "assistant", "content": t}] for t in texts])


def _adv_ctx(rewards, advantages, G):
    ctx = make_advantage_context(rewards, num_generations=G, advantages=advantages,
                                 completion_lengths=torch.ones(rewards.numel()))
    return ctx, ctx.metrics


TEXTS = [PROBLEM.solution, "3+4=7\n7*2=14\nAnswer: 15", "3+4=8", "garbage"]  # PRM: 1, 2/3, 0, 0


def test_prm_scores_travel_from_the_reward_stage_to_the_advantage_stage():
    stack = build_plugins(["dagrpo"], {"dagrpo": {"scorer": "prm", "delta": 0.5}})
    rows = [{"problem": PROBLEM.to_json(), "solution": PROBLEM.solution}] * 4
    stack.call("trl_plugins_transform_rewards", _reward_ctx(TEXTS, 4, rows))
    ctx, sink = _adv_ctx(torch.tensor([1.0, 0.0, 0.0, 0.0]), A.clone(), 4)
    stack.call("trl_plugins_transform_advantages", ctx)
    scores = torch.tensor([1.0, 2 / 3, 0.0, 0.0])
    torch.testing.assert_close(ctx.advantages, pairwise_advantages(A, _keep(scores, 0.5), "surviving"))
    # masked: (0,1) with d = 1/3 and (2,3) with d = 0, i.e. 4 of the 12 ordered off-diagonal pairs
    assert sink["plugins/dagrpo/masked_pair_fraction"] == [pytest.approx(4 / 12)]
    assert sink["plugins/dagrpo/zero_advantage_row_fraction"] == [0.0]
    assert sink["plugins/dagrpo/mean_score"] == [pytest.approx((1 + 2 / 3) / 4)]
    with pytest.raises(PluginError, match="no fine-grained scores"):  # consumed: never reused for another batch
        stack.call("trl_plugins_transform_advantages", _adv_ctx(torch.zeros(4), A.clone(), 4)[0])


def test_similarity_scorer_without_trainer_uses_characters():
    stack = build_plugins(["dagrpo"], {"dagrpo": {"scorer": "similarity", "delta": 0.5, "anchors": False}})
    texts = ["3+4=7", "3+4=7", "xyz", "3+4=8"]
    stack.call("trl_plugins_transform_rewards", _reward_ctx(texts, 4, [{}] * 4))
    ctx, sink = _adv_ctx(torch.zeros(4), A.clone(), 4)
    stack.call("trl_plugins_transform_advantages", ctx)
    keep = similarity_distinctiveness([list(t) for t in texts], 4, "jaccard", 2) >= 0.5
    torch.testing.assert_close(ctx.advantages, pairwise_advantages(A, keep, "surviving"))
    assert "plugins/dagrpo/mean_pair_distinctiveness" in sink and "plugins/dagrpo/mean_score" not in sink


def test_similarity_scorer_prefers_the_generated_token_ids():
    stack = build_plugins(["dagrpo"], {"dagrpo": {"scorer": "similarity", "delta": 0.5, "anchors": False}})
    ctx = _reward_ctx(["a", "b", "c", "d"], 4, [{}] * 4)  # texts all differ ...
    ctx.local_completion_ids = [[1, 2, 3], [1, 2, 3], [7, 8], [1, 2, 4]]  # ... the ids decide
    stack.call("trl_plugins_transform_rewards", ctx)
    actx, _ = _adv_ctx(torch.zeros(4), A.clone(), 4)
    stack.call("trl_plugins_transform_advantages", actx)
    keep = similarity_distinctiveness(ctx.local_completion_ids, 4, "jaccard", 2) >= 0.5
    assert not keep[0, 0, 1] and keep[0, 0, 2]
    torch.testing.assert_close(actx.advantages, pairwise_advantages(A, keep, "surviving"))


def test_reward_scorer_and_reward_gap():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    ctx, _ = _adv_ctx(rewards, A.clone(), 4)
    build_plugins(["dagrpo"], {"dagrpo": {"scorer": "reward", "anchors": False}}).call(
        "trl_plugins_transform_advantages", ctx)
    # only the cross-class pairs survive: A_i = a_i - mean of the other class
    torch.testing.assert_close(ctx.advantages, torch.tensor([2.5, 1.5, -1.5, -2.5]))
    # include_reward_gap on the similarity scorer keeps the cross-class pairs of two identical texts
    stack = build_plugins(["dagrpo"], {"dagrpo": {"scorer": "similarity", "delta": 0.5, "include_reward_gap": True,
                                                  "anchors": False}})
    stack.call("trl_plugins_transform_rewards", _reward_ctx(["same"] * 4, 4, [{}] * 4))
    ctx, _ = _adv_ctx(rewards, A.clone(), 4)
    stack.call("trl_plugins_transform_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, torch.tensor([2.5, 1.5, -1.5, -2.5]))


def test_prm_scorer_needs_the_problem_json():
    stack = build_plugins(["dagrpo"], {"dagrpo": {"scorer": "prm"}})
    with pytest.raises(PluginConfigError, match="'problem'"):
        stack.call("trl_plugins_transform_rewards", _reward_ctx(["x"] * 2, 2, [{"problem": None}] * 2))


# ------------------------------------------------------------------------------------------ anchors (sampling stage)
def _rollout_ctx(groups, G, solution=PROBLEM.solution, with_logprobs=True):
    """``groups``: one list of G completion texts per group; texts starting with "OK" succeed."""
    tok = tiny_tokenizer()
    B = len(groups) * G
    rows = stub_rows(len(groups), G, solution=solution)
    score_calls = []

    def scorer(rows_, prompts_, completions_):
        score_calls.append(len(completions_))
        return torch.tensor([1.0 if c[-1]["content"].startswith("OK") else 0.0 for c in completions_])

    ctx = make_rollout_context(groups, num_generations=G, rows=rows, tokenizer=tok, prompt_ids=[[5, 6]] * B,
                               sampling_logprob=-1.0 if with_logprobs else None, scorer=scorer)
    ctx.score_calls, ctx.sink = score_calls, ctx.metrics
    return ctx, tok


@pytest.mark.parametrize("with_logprobs", [True, False])
def test_anchor_replaces_one_failed_rollout_of_each_all_fail_group(with_logprobs):
    ctx, tok = _rollout_ctx([["no", "no", "no"], ["no", "OK", "no"]], 3, with_logprobs=with_logprobs)
    before = [list(x) for x in ctx.completion_ids]
    build_plugins(["dagrpo"], {"dagrpo": {"anchor_index": 1}}).call("trl_plugins_after_generation", ctx)
    expected = tok(text=PROBLEM.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ctx.changed == {1}
    assert ctx.completion_ids[1] == expected
    assert ctx.completions[1] == [{"role": "assistant", "content": PROBLEM.solution}]
    assert ctx.offpolicy[1] == [True] * len(expected)
    assert ctx.training_prompts[1] == ctx.prompts[1] and ctx.prompt_swapped[1] is False  # no prompt swap
    if with_logprobs:
        assert all(math.isnan(x) for x in ctx.sampling_logprobs[1]) and len(ctx.sampling_logprobs[1]) == len(expected)
    assert ctx.annotations[1] == {ANCHOR_ANNOTATION: True}
    for i in (0, 2, 3, 4, 5):
        assert ctx.completion_ids[i] == before[i] and not any(ctx.offpolicy[i])
    assert ctx.sink["plugins/dagrpo/no_positive_group_fraction"] == [0.5]
    assert ctx.sink["plugins/dagrpo/anchored_group_fraction"] == [0.5]


def test_anchors_off_does_nothing():
    ctx, _ = _rollout_ctx([["no", "no"]], 2)
    build_plugins(["dagrpo"], {"dagrpo": {"anchors": False}}).call("trl_plugins_after_generation", ctx)
    assert not ctx.changed and ctx.score_calls == [] and ctx.sink == {}


def test_missing_solution_is_a_clear_error():
    ctx, _ = _rollout_ctx([["no", "no"]], 2, solution="")
    with pytest.raises(PluginConfigError, match=r"row 0 .*'solution'"):
        build_plugins(["dagrpo"]).call("trl_plugins_after_generation", ctx)


def test_required_columns_are_checked_at_construction(tmp_path):
    data = tiny_dataset(4).remove_columns("problem")
    with pytest.raises(PluginConfigError, match=r"'dagrpo'.*'problem'"):
        make_tiny_trainer(plugins=["dagrpo"], plugin_config={"dagrpo": {"scorer": "prm"}}, dataset=data,
                          output_dir=str(tmp_path))
    make_tiny_trainer(plugins=["dagrpo"], plugin_config={"dagrpo": {"scorer": "reward"}}, dataset=data,
                      output_dir=str(tmp_path))
    make_tiny_trainer(plugins=["dagrpo"], dataset=data, output_dir=str(tmp_path))  # the default scorer reads no column


# ------------------------------------------------------------------------------------------ end to end
def test_neutral_setting_is_vanilla_grpo(tmp_path):
    """delta = 0 and no anchors: every pair survives and the run is trl.GRPOTrainer's, bit for bit (completions,
    rewards, advantages, losses, gradients, parameters)."""
    common = dict(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path))
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, **common))
    plugin = record_run(make_tiny_trainer(plugins=["dagrpo"], plugin_config={"dagrpo": {"delta": 0.0,
                                                                                         "anchors": False}},
                                          **common))
    assert any(a.abs().max() > 0 for a in vanilla.advantages)
    assert_runs_equal(plugin, vanilla)
    assert all(log.get("plugins/dagrpo/masked_pair_fraction") == 0.0 for log in plugin.logs if "loss" in log)


def test_end_to_end_anchors_are_trained_off_policy(tmp_path):
    """The untrained model never answers correctly: every group is all-fail, so slot 0 of each group becomes the
    reference solution + EOS, flagged off-policy, rewarded 1 by the verifier, and the pair-masked advantages are
    the PRM-scored ones."""
    trainer = make_tiny_trainer(plugins=["dagrpo"], plugin_config={"dagrpo": {"scorer": "prm"}}, max_steps=2,
                                output_dir=str(tmp_path))
    batches = []
    original = trainer._generate_and_score_completions

    def gen(inputs):
        out = original(inputs)
        batches.append((inputs, out))
        return out

    trainer._generate_and_score_completions = gen
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    tok = trainer.processing_class
    G = trainer.num_generations
    for (inputs, out), rewards in zip(batches, run.rewards):
        anchor = tok(text=inputs[0]["solution"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        row = out["completion_ids"][0][out["completion_mask"][0].bool()].tolist()
        assert row == anchor
        assert out["offpolicy_mask"][0][: len(anchor)].all() and not out["offpolicy_mask"][1:].any()
        assert rewards[:, 0].tolist() == [1.0] + [0.0] * (G - 1)
        # PRM scores: anchor 1, failures (random text) 0 -> failure pairs masked, each failure compared to the anchor
        a = out["advantages"]
        assert a[0] > 0 and torch.all(a[1:] < 0)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert log["plugins/dagrpo/anchored_group_fraction"] == 1.0
        assert log["plugins/framework/offpolicy_token_fraction"] > 0
        for key in ("masked_pair_fraction", "zero_advantage_row_fraction", "mean_score"):
            assert f"plugins/dagrpo/{key}" in log


# ------------------------------------------------------------------------------------------ any dataset
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def _reversal_dataset():
    """A dataset that is not the bundled tasks': no ``problem`` or ``rubrics`` column, not arithmetic."""
    from datasets import Dataset

    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"Spell {w} backwards."}] for w in WORDS],
        "answer": [w[::-1] for w in WORDS],
        "solution": [w[::-1] for w in WORDS],
    })


def exact_match_reward(completions, answer, **kwargs):
    return [1.0 if completion_text(c).strip() == a else 0.0 for c, a in zip(completions, answer)]


def test_default_options_train_on_a_dataset_that_is_not_the_bundled_tasks(tmp_path):
    """``plugins: [dagrpo]`` with no options on a user's dataset: the default scorer (token similarity) needs no task
    column and no model; pairs are masked, the all-fail groups are anchored with the reference, and the model
    learns from them."""
    assert DaGRPOOptions().scorer == "similarity"
    trainer = make_tiny_trainer(plugins=["dagrpo"], dataset=_reversal_dataset(), reward_funcs=[exact_match_reward],
                                max_steps=2, output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        for key in ("masked_pair_fraction", "zero_advantage_row_fraction", "mean_pair_distinctiveness",
                    "anchored_group_fraction"):
            assert f"plugins/dagrpo/{key}" in log
        assert "plugins/dagrpo/mean_score" not in log  # no per-row score: the similarity scorer is pairwise
        assert log["plugins/dagrpo/anchored_group_fraction"] == 1.0  # the untrained model never succeeds
    for rewards in run.rewards:  # anchors (slot 0) are the reference solution: a success under the verifier
        assert rewards[0::trainer.num_generations, 0].eq(1.0).all()


def test_prm_scorer_takes_a_step_verifier_by_name(tmp_path):
    """scorer='prm' on a user's task: the verifier is registered under a name and the config names it; the
    bundled one stays available as 'arithmetic'."""
    from trl_plugins.components.prm import STEP_VERIFIERS

    calls = []

    def letters_verifier(problem, steps):  # a step is right when it is a prefix of the reversed word
        calls.append((problem, list(steps)))
        return [1.0 if problem.startswith(step) else 0.0 for step in steps]

    STEP_VERIFIERS.register("reversal", letters_verifier)
    try:
        with pytest.raises(PluginConfigError, match=r"prm_verifier.*'reversl'.*Did you mean 'reversal'"):
            build_plugins(["dagrpo"], {"dagrpo": {"scorer": "prm", "prm_verifier": "reversl"}})
        options = {"scorer": "prm", "prm_verifier": "reversal", "problem_column": "answer", "delta": 0.5,
                   "anchors": False}
        stack = build_plugins(["dagrpo"], {"dagrpo": options})
        rows = [{"answer": "ahpla"}] * 4
        stack.call("trl_plugins_transform_rewards", _reward_ctx(["ah", "ahp\nx", "zz", "ahpla"], 4, rows))
        ctx, sink = _adv_ctx(torch.zeros(4), A.clone(), 4)
        stack.call("trl_plugins_transform_advantages", ctx)
        assert sink["plugins/dagrpo/mean_score"] == [pytest.approx((1 + 0.5 + 0 + 1) / 4)]
        assert calls[1] == ("ahpla", ["ahp", "x"])
        make_tiny_trainer(plugins=["dagrpo"], plugin_config={"dagrpo": options}, dataset=_reversal_dataset(),
                          reward_funcs=[exact_match_reward], output_dir=str(tmp_path))  # 'problem' not required
    finally:
        STEP_VERIFIERS.unregister("reversal")
    assert prm_score(PROBLEM.to_json(), PROBLEM.solution, "arithmetic") == 1.0


# ------------------------------------------------------------------------------------------ LLM-judge scorer
CRITERIA = ["Mentions alpha", "Mentions beta"]


def _criteria_handler(seen):
    """A judge server: a criterion 'Mentions <word>' is met when the completion contains <word>."""
    import json

    from trl_plugins.components import chat_response
    from trl_plugins.components.judge import _split_prompt

    def handler(path, payload):
        prompt = payload["messages"][-1]["content"]
        seen.append(prompt)
        _, completion, item_line = _split_prompt(prompt)
        met = item_line.split()[-1] in completion.split()
        return chat_response(json.dumps({"explanation": "by word", "criteria_met": met}))

    return handler


def _judge_options(url, **extra):
    return {"scorer": "judge", "judge_base_url": url, "judge_criteria": CRITERIA, "judge_timeout": 5.0,
            "judge_max_retries": 1, "anchors": False, **extra}


def test_judge_scorer_grades_each_criterion_over_http_and_masks_equal_scores():
    from trl_plugins.components import serve_openai_compatible
    from trl_plugins.testing import group_normalized_advantages, make_advantage_context, make_reward_context

    texts = ["alpha beta", "alpha", "alpha", "gamma"]  # judge scores 1, 0.5, 0.5, 0
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])  # rows 1 and 2 differ in reward but not in score
    seen = []
    with serve_openai_compatible(_criteria_handler(seen)) as url:
        stack = build_plugins(["dagrpo"], {"dagrpo": _judge_options(url, delta=0.3)})
        rctx = make_reward_context(rewards, num_generations=4,
                                   completions=[[{"role": "assistant", "content": t}] for t in texts])
        stack.call("trl_plugins_transform_rewards", rctx)
    assert len(seen) == 8  # one judge call per (completion, criterion)
    assert sum("[+1] Mentions beta" in prompt for prompt in seen) == 4
    assert all("user: Q0" in prompt and "assistant: " in prompt for prompt in seen)
    actx = make_advantage_context(rewards, num_generations=4)
    stack.call("trl_plugins_transform_advantages", actx)
    a = group_normalized_advantages(rewards, 4)
    # pair (1, 2) is masked (equal scores): rows 1 and 2 keep only the pairs with rows 0 and 3, which leaves their
    # advantage unchanged; rows 0 and 3 keep all three pairs, and one of them (with the equal-reward row) adds 0
    torch.testing.assert_close(actx.advantages, a * torch.tensor([4 / 3, 1.0, 1.0, 4 / 3]))
    assert actx.metrics["plugins/dagrpo/mean_score"] == [pytest.approx(0.5)]
    assert actx.metrics["plugins/dagrpo/masked_pair_fraction"] == [pytest.approx(2 / 12)]


def test_judge_scorer_raises_when_the_judge_gives_no_verdict():
    from trl_plugins.components import EndpointError, chat_response, serve_openai_compatible
    from trl_plugins.testing import make_reward_context

    with serve_openai_compatible(lambda path, payload: chat_response("no idea")) as url:
        stack = build_plugins(["dagrpo"], {"dagrpo": _judge_options(url, judge_parse_retries=0)})
        rctx = make_reward_context(torch.zeros(4), num_generations=4,
                                   completions=[[{"role": "assistant", "content": "x"}]] * 4)
        with pytest.raises(EndpointError, match=url):
            stack.call("trl_plugins_transform_rewards", rctx)


def test_judge_scorer_options_are_checked_at_construction():
    with pytest.raises(PluginConfigError, match="judge_base_url"):
        build_plugins(["dagrpo"], {"dagrpo": {"scorer": "judge"}})
    with pytest.raises(PluginConfigError, match="judge_criteria"):
        build_plugins(["dagrpo"], {"dagrpo": {"scorer": "judge", "judge_base_url": "http://127.0.0.1:9/v1",
                                              "judge_criteria": []}})
    plugin = build_plugins(["dagrpo"], {"dagrpo": {"scorer": "judge", "judge_base_url": "http://127.0.0.1:9/v1",
                                                   "judge_timeout": 3.0, "judge_max_retries": 0}}).by_name["dagrpo"]
    judge = plugin.build_judge()  # nothing is sent
    assert (judge.client.config.timeout, judge.client.config.max_retries) == (3.0, 0)
    assert plugin.required_columns() == ["solution"]  # no task column needed


@pytest.mark.parametrize("name", ["dagrpo", "ruscarl"])
def test_an_unset_judge_api_key_variable_is_refused_not_ignored(name, monkeypatch):
    """A named ``judge_api_key_env`` that is not set stops the judge from being built (it used to send no key)."""
    monkeypatch.delenv("TRLP_UNSET_KEY", raising=False)
    options = {"judge_base_url": "http://127.0.0.1:9/v1", "judge_api_key_env": "TRLP_UNSET_KEY"}
    if name == "dagrpo":
        options["scorer"] = "judge"
    plugin = build_plugins([name], {name: options}).by_name[name]
    with pytest.raises(PluginConfigError, match="TRLP_UNSET_KEY"):
        plugin.build_judge()
    monkeypatch.setenv("TRLP_UNSET_KEY", "sk-1")
    assert plugin.build_judge().client.config.api_key == "sk-1"


# ------------------------------------------------------------------------------------------ anchors: reserved slot
def test_reserved_anchor_slot_adds_the_anchor_or_one_more_rollout(tmp_path, monkeypatch):
    """anchor_placement='reserve': slot 0 of each group is not sampled in the first round; the all-fail group gets
    the reference solution there (off-policy, NaN sampling log-probs), the group with a success one more rollout
    through the generation service -- at most G rollouts per group."""
    from trl_plugins.components.prm import arithmetic_row
    from trl_plugins.api.contexts import OFFPOLICY_KEY

    trainer = make_tiny_trainer(plugins=["dagrpo"], max_completion_length=40, output_dir=str(tmp_path),
                                plugin_config={"dagrpo": {"anchor_placement": "reserve", "scorer": "reward"}},
                                log_level="error")
    tok = trainer.processing_class
    ds = trainer.train_dataset
    G = trainer.num_generations
    rows = [dict(ds[k]) for k in range(2) for _ in range(G)]
    solved = rows[0]["prompt"][-1]["content"]  # the backend solves the first prompt, fails the second
    calls = []

    def backend(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        calls.append(len(prompt_ids))
        ids_out = []
        for ids in prompt_ids:
            text = tok.decode(ids, skip_special_tokens=True)
            question = text[text.index("Compute"):].split("\n")[0].strip()
            problem = Problem.from_json(arithmetic_row(question)["problem"])
            completion = problem.solution if question in solved else "Answer: 0"
            ids_out.append(tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        return ids_out, [[-0.25] * len(x) for x in ids_out]

    trainer._generate_single_turn = backend
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", "token_truncate")
    trainer.model.train()
    out = trainer._generate_and_score_completions(rows)
    assert calls == [2 * (G - 1), 1]  # first round without the reserved slots; one refill (the solved group)
    mask, off, lps = out["completion_mask"].bool(), out[OFFPOLICY_KEY], out["sampling_per_token_logps"]

    def text(i):
        return tok.decode(out["completion_ids"][i][mask[i]], skip_special_tokens=True)

    assert text(0) == rows[0]["solution"] and not off[0].any() and torch.all(lps[0][mask[0]] == -0.25)
    anchor = G  # slot 0 of the failed group
    assert text(anchor) == rows[anchor]["solution"]
    n = int(mask[anchor].sum())
    assert off[anchor, :n].all() and torch.isnan(lps[anchor, :n]).all()
    assert [text(i) for i in range(G + 1, 2 * G)] == ["Answer: 0"] * (G - 1)  # its G - 1 rollouts are kept


def test_reserved_slot_options():
    from trl_plugins.testing import make_prompt_context

    stack = build_plugins(["dagrpo"], {"dagrpo": {"anchor_placement": "reserve", "anchor_index": 9,
                                                  "scorer": "reward"}})
    pctx = make_prompt_context(num_groups=2, num_generations=4)
    stack.call("trl_plugins_generation_prompts", pctx)
    assert pctx.deferred == [False, False, False, True] * 2  # anchor_index capped at G - 1
    for options in ({"anchor_placement": "replace"}, {"anchor_placement": "reserve", "anchors": False}):
        stack = build_plugins(["dagrpo"], {"dagrpo": {"scorer": "reward", **options}})
        pctx = make_prompt_context(num_groups=2, num_generations=4)
        stack.call("trl_plugins_generation_prompts", pctx)
        assert not any(pctx.deferred)
