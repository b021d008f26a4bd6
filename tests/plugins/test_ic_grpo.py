"""ic_grpo: information units, the entropy-based helpfulness and stability rewards on small inputs, the columns filled
from the gathered completions (stability 0 without paraphrases), bad input refused at construction, and tiny-model
runs (no paraphrase is vanilla; a paraphrased run samples from the variants and logs both rewards)."""

import math

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
from trl_plugins_builtin.ic_grpo import (
    HELPFULNESS,
    STABILITY,
    group_stability,
    helpfulness,
    information_units,
    shannon_entropy,
)


def test_information_units():
    assert information_units("Buy VTI, then BND.", "words") == ["buy", "vti", "then", "bnd"]
    assert information_units("1. Index funds\n\n-  Bonds  now\n* Gold", "lines") == ["index funds", "bonds now", "gold"]


def test_shannon_entropy_and_helpfulness():
    assert float(shannon_entropy(torch.tensor([1.0, 1.0, 2.0]))) == pytest.approx(
        -(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5)))
    assert float(shannon_entropy(torch.zeros(3))) == 0.0
    assert helpfulness(["a", "b", "c", "d"]) == pytest.approx(math.log(4))  # 4 distinct units once each
    assert helpfulness(["a", "a", "a"]) == 0.0 and helpfulness([]) == 0.0  # repetition and silence carry nothing
    assert helpfulness(["a", "b", "a", "b"]) == pytest.approx(math.log(2))


def test_group_stability_hand_made():
    """Pooled n = {a: 3, b: 3, c: 1}: the outlier {c} raises the group's entropy, each conformist lowers it."""
    sets = [{"a", "b"}, {"a", "b"}, {"a", "b"}, {"c"}]

    def h(counts):
        total = sum(counts)
        return -sum(c / total * math.log(c / total) for c in counts if c)

    h_all = h([3, 3, 1])
    expected = [h([2, 2, 1]) - h_all] * 3 + [h([3, 3]) - h_all]
    torch.testing.assert_close(group_stability(sets), torch.tensor(expected, dtype=torch.float64))
    assert expected[3] < 0 < expected[0]  # the outlier is penalised, the conformists rewarded
    # identical answers: no rollout changes the pooled entropy
    assert group_stability([{"x", "y"}] * 3).tolist() == [0.0] * 3


def _plugin(**options):
    return build_plugins(["ic_grpo"], {"ic_grpo": options}).by_name["ic_grpo"]


def _rows(G, paraphrases):
    prompt = [{"role": "user", "content": "Which fund should I buy?"}]
    return [{"prompt": prompt, "paraphrases": paraphrases} for _ in range(G)]


def test_rows_are_spread_over_the_paraphrase_set():
    ctx = make_prompt_context(_rows(4, ["What fund do you recommend?"]), num_generations=4)
    _plugin().trl_plugins_generation_prompts(ctx)
    assert [p[-1]["content"] for p in ctx.generation_prompts] == ["Which fund should I buy?",
                                                                   "What fund do you recommend?"] * 2
    assert ctx.training_prompts == ctx.generation_prompts


def test_reward_columns_hold_helpfulness_and_stability():
    G = 4
    completions = ["buy vti", "buy vti", "buy vti now", "gold"]
    ctx = make_reward_context(torch.zeros(G, 3), num_generations=G, reward_func_names=["acc", HELPFULNESS, STABILITY],
                              rows=_rows(G, ["What fund do you recommend?"]), completions=completions)
    _plugin().trl_plugins_transform_rewards(ctx)
    units = [set(c.split()) for c in completions]
    torch.testing.assert_close(ctx.rewards_per_func[:, 1], torch.tensor([helpfulness(c.split()) for c in completions]))
    torch.testing.assert_close(ctx.rewards_per_func[:, 2], group_stability(units).float())
    assert ctx.rewards_per_func[3, 2] < 0 < ctx.rewards_per_func[0, 2]  # the outlier is penalised
    assert ctx.rewards_per_func[:, 0].tolist() == [0.0] * G
    assert [v for k, v in ctx.metrics.items() if k.endswith("variants_mean")] == [[2.0]]
    # no paraphrase: one variant, stability undefined (0); helpfulness still scored
    ctx = make_reward_context(torch.zeros(G, 2), num_generations=G, reward_func_names=[HELPFULNESS, STABILITY],
                              rows=_rows(G, []), completions=completions)
    _plugin().trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == [0.0] * G and ctx.rewards_per_func[2, 0] > 0


@pytest.mark.parametrize(
    "options, message",
    [
        ({"units": "sentences"}, "Option 'units' of plugin 'ic_grpo' got 'sentences'"),
        ({"max_paraphrases": -1}, "Option 'max_paraphrases' of plugin 'ic_grpo' got -1"),
        ({"templates": ["Please answer"]}, "Option 'templates' of plugin 'ic_grpo' got 'Please answer'"),
        ({"stability_weight": float("nan")}, "Option 'stability_weight' of plugin 'ic_grpo' got nan"),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["ic_grpo"], {"ic_grpo": options})


def test_bad_paraphrase_column_is_refused_when_the_trainer_is_built(tmp_path):
    rows = tiny_dataset(4).to_list()
    for row in rows:
        row["paraphrases"] = ["ok"]
    rows[1]["paraphrases"] = [""]
    with pytest.raises(PluginConfigError, match="paraphrases"):
        make_tiny_trainer(plugins=["ic_grpo"], dataset=Dataset.from_list(rows), output_dir=str(tmp_path))


# ------------------------------------------------------------------------------------------ trainer runs
def test_no_paraphrases_is_vanilla():
    assert_reduces_to_vanilla("ic_grpo", {"max_paraphrases": 0}, loss_types=("grpo",), steps=1)


def test_a_templated_run_fills_both_columns(tmp_path):
    trainer = make_tiny_trainer(plugins=["ic_grpo"],
                                plugin_config={"ic_grpo": {"paraphrase_column": None, "templates": ["Q: {question}"]}},
                                reward_funcs=[digit_fraction_reward], num_generations=4, max_completion_length=6,
                                max_steps=1, log_level="error", output_dir=str(tmp_path))
    assert trainer.reward_func_names == ["digit_fraction_reward", HELPFULNESS, STABILITY]
    run = record_run(trainer)
    log = [log for log in run.logs if "loss" in log][0]
    assert log["plugins/ic_grpo/variants_mean"] == 2.0
    # the columns are the formulas over the decoded completions (two groups of four, variants 0, 1, 0, 1)
    texts = trainer.processing_class.batch_decode(run.completion_ids[0], skip_special_tokens=True)
    units = [information_units(t, "words") for t in texts]
    stability = torch.cat([group_stability([set(u) for u in units[g:g + 4]]) for g in range(0, len(units), 4)])
    assert log[f"rewards/{STABILITY}/mean"] == pytest.approx(float(stability.mean()), abs=1e-6)
    assert log[f"rewards/{HELPFULNESS}/mean"] == pytest.approx(sum(map(helpfulness, units)) / len(units), abs=1e-6)
    assert log["plugins/ic_grpo/group_information_entropy"] > 0
