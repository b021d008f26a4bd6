"""ps_grpo: token F1 and the group similarity reward on small inputs (all other-variant rollouts, or a subsample),
rows spread over the paraphrase set at the prompt stage, the reward column filled from the gathered completions, bad
input refused at construction, and tiny-model runs (no paraphrase is vanilla; a paraphrased run samples from and
trains on the variants and logs its agreement)."""

import random

import pytest
import torch
from datasets import Dataset

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    digit_fraction_reward,
    make_prompt_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    tiny_dataset,
)
from trl_plugins_builtin._paraphrase import variant_of
from trl_plugins_builtin.ps_grpo import COLUMN, group_similarity, subsample, token_f1


def test_token_f1():
    assert token_f1("the answer is 4", "the answer is 4") == 1.0
    assert token_f1("a b c d", "a b x y") == pytest.approx(0.5)  # 2 common of 4 and 4
    assert token_f1("a a b", "a b b") == pytest.approx(2 / 3)  # multiset overlap: a, b
    assert token_f1("x", "") == 0.0 and token_f1("", "") == 1.0
    assert token_f1("The Cat", "the cat") == 1.0


def test_group_similarity_averages_over_the_other_variants_only():
    sim = torch.tensor([[1.0, 0.2, 0.9, 0.4],
                        [0.2, 1.0, 0.3, 0.8],
                        [0.9, 0.3, 1.0, 0.6],
                        [0.4, 0.8, 0.6, 1.0]], dtype=torch.float64)
    variants = [0, 1, 0, 1]
    expected = torch.tensor([(0.2 + 0.4) / 2, (0.2 + 0.3) / 2, (0.3 + 0.6) / 2, (0.4 + 0.6) / 2], dtype=torch.float64)
    torch.testing.assert_close(group_similarity(sim, variants), expected)
    # one variant: nothing to compare with
    assert group_similarity(sim, [0, 0, 0, 0]).tolist() == [0.0] * 4
    # a subset per rollout (the approximation)
    torch.testing.assert_close(group_similarity(sim, variants, [[1], [2], [3], [0]]),
                               torch.tensor([0.2, 0.3, 0.6, 0.4], dtype=torch.float64))


def test_subsample_draws_only_other_variants():
    variants = [0, 1, 2, 0, 1, 2]
    assert subsample(variants, 0, None, random.Random(0)) == [1, 2, 4, 5]
    for seed in range(20):
        picked = subsample(variants, 4, 2, random.Random(seed))
        assert len(picked) == 2 and all(variants[j] != 1 for j in picked)
    assert subsample(variants, 0, 9, random.Random(0)) == [1, 2, 4, 5]


def _plugin(**options):
    return build_plugins(["ps_grpo"], {"ps_grpo": options}).by_name["ps_grpo"]


def _rows(G, paraphrases):
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 2+2?"}]
    return [{"prompt": prompt, "paraphrases": paraphrases} for _ in range(G)]


@pytest.mark.parametrize("paraphrases, max_paraphrases, n", [(["Add 2 and 2.", "2 plus 2?"], 3, 3),
                                                             (["Add 2 and 2.", "2 plus 2?"], 1, 2),
                                                             ([], 3, 1)])
def test_rows_are_spread_over_the_paraphrase_set(paraphrases, max_paraphrases, n):
    G = 4
    ctx = make_prompt_context(_rows(G, paraphrases), num_generations=G)
    _plugin(max_paraphrases=max_paraphrases).trl_plugins_generation_prompts(ctx)
    texts = ["What is 2+2?", *paraphrases]
    for k in range(G):
        assert variant_of(k, n) == k % n
        expected = texts[k % n]
        assert ctx.generation_prompts[k][-1]["content"] == expected
        assert ctx.training_prompts[k] == ctx.generation_prompts[k]  # trained on what it was sampled from
        assert ctx.generation_prompts[k][0] == {"role": "system", "content": "sys"}
    assert ctx.prompts[0][-1]["content"] == "What is 2+2?"  # the originals are untouched


def test_templates_reword_the_question_after_the_column_paraphrases():
    G = 4
    ctx = make_prompt_context(_rows(G, ["Add 2 and 2."]), num_generations=G)
    _plugin(templates=["Please answer: {question}", "{question} Be brief."]).trl_plugins_generation_prompts(ctx)
    assert [p[-1]["content"] for p in ctx.generation_prompts] == [
        "What is 2+2?", "Add 2 and 2.", "Please answer: What is 2+2?", "What is 2+2? Be brief."]
    ctx = make_prompt_context(_rows(G, ["Add 2 and 2."]), num_generations=G)
    _plugin(paraphrase_column=None, templates=["Q: {question}"]).trl_plugins_generation_prompts(ctx)
    assert [p[-1]["content"] for p in ctx.generation_prompts] == ["What is 2+2?", "Q: What is 2+2?"] * 2


def test_reward_column_is_the_agreement_with_the_other_paraphrases():
    G = 4
    rows = _rows(G, ["Add 2 and 2."])  # n = 2: variants 0, 1, 0, 1
    completions = ["it is 4", "it is 4", "it is 5", "four"]
    rewards = torch.zeros(G, 2)
    ctx = make_reward_context(rewards, num_generations=G, reward_func_names=["acc", COLUMN], rows=rows,
                              completions=completions)
    _plugin().trl_plugins_transform_rewards(ctx)
    f1 = token_f1
    expected = [(f1("it is 4", "it is 4") + f1("it is 4", "four")) / 2,  # rows 0, 2: variant 0; rows 1, 3: 1
                (f1("it is 4", "it is 4") + f1("it is 4", "it is 5")) / 2,
                (f1("it is 5", "it is 4") + f1("it is 5", "four")) / 2,
                (f1("four", "it is 4") + f1("four", "it is 5")) / 2]
    torch.testing.assert_close(ctx.rewards_per_func[:, 1], torch.tensor(expected))
    assert ctx.rewards_per_func[:, 0].tolist() == [0.0] * G  # other columns untouched
    logged = [v for k, v in ctx.metrics.items() if k.endswith("similarity_mean")]
    assert logged == [[pytest.approx(sum(expected) / G)]]


def test_answer_similarity_and_the_subsampled_estimate():
    G = 4
    rows = _rows(G, ["Add 2 and 2."])
    completions = ["x\nAnswer: 4", "y\nAnswer: 4", "z\nAnswer: 5", "no answer"]
    ctx = make_reward_context(torch.zeros(G, 1), num_generations=G, reward_func_names=[COLUMN], rows=rows,
                              completions=completions)
    _plugin(similarity="answer").trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 0].tolist() == [0.5, 0.5, 0.0, 0.0]
    ctx = make_reward_context(torch.zeros(G, 1), num_generations=G, reward_func_names=[COLUMN], rows=rows,
                              completions=completions)
    _plugin(similarity="answer", num_compare=1).trl_plugins_transform_rewards(ctx)
    assert set(ctx.rewards_per_func[:, 0].tolist()) <= {0.0, 1.0}  # one comparison each


@pytest.mark.parametrize(
    "options, message",
    [
        ({"similarity": "bleu"}, "Option 'similarity' of plugin 'ps_grpo' got 'bleu'"),
        ({"max_paraphrases": -1}, "Option 'max_paraphrases' of plugin 'ps_grpo' got -1"),
        ({"num_compare": 0}, "Option 'num_compare' of plugin 'ps_grpo' got 0"),
        ({"answer_extractor": "magic"}, "Option 'answer_extractor' of plugin 'ps_grpo'"),
        ({"templates": ["Please answer"]}, "Option 'templates' of plugin 'ps_grpo' got 'Please answer'"),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["ps_grpo"], {"ps_grpo": options})


def _paraphrased(n=8):
    rows = tiny_dataset(n).to_list()
    for row in rows:
        question = row["prompt"][-1]["content"]
        row["paraphrases"] = [question.replace("Compute", "Work out"), question.replace("Compute", "Evaluate")]
    return Dataset.from_list(rows)


def test_bad_paraphrase_column_is_refused_when_the_trainer_is_built(tmp_path):
    rows = _paraphrased(4).to_list()
    rows[2]["paraphrases"] = ["ok", " "]
    with pytest.raises(PluginConfigError, match="paraphrases"):
        make_tiny_trainer(plugins=["ps_grpo"], dataset=Dataset.from_list(rows), output_dir=str(tmp_path))
    with pytest.raises(PluginConfigError, match="needs the dataset column 'paraphrases'"):
        make_tiny_trainer(plugins=["ps_grpo"], dataset=tiny_dataset(4), output_dir=str(tmp_path))


# ------------------------------------------------------------------------------------------ trainer runs
def test_no_paraphrases_is_vanilla():
    assert_reduces_to_vanilla("ps_grpo", {"max_paraphrases": 0}, loss_types=("grpo", "dapo"), steps=1)


def test_a_paraphrased_run_samples_from_the_variants(tmp_path):
    trainer = make_tiny_trainer(plugins=["ps_grpo"], plugin_config={"ps_grpo": {"max_paraphrases": 1}},
                                reward_funcs=[digit_fraction_reward], dataset=_paraphrased(), num_generations=4,
                                max_completion_length=6, max_steps=1, log_level="error", output_dir=str(tmp_path))
    assert trainer.reward_func_names == ["digit_fraction_reward", COLUMN]
    generated = []
    original = trainer._generate_single_turn

    def single_turn(prompt_ids, *a, **kw):
        generated.extend(trainer.processing_class.decode(p) for p in prompt_ids)
        return original(prompt_ids, *a, **kw)

    trainer._generate_single_turn = single_turn
    run = record_run(trainer)
    assert any("Work out" in p for p in generated) and any("Compute" in p for p in generated)
    assert not any("Evaluate" in p for p in generated)  # max_paraphrases=1: the first paraphrase only
    logs = [log for log in run.logs if "loss" in log]
    assert logs[0]["plugins/ps_grpo/variants_mean"] == 2.0 and "rewards/ps_grpo_similarity/mean" in logs[0]
