"""r_horizon: the chained prompt on small problems (the variable reproduces the original number from the previous
answer), the chained verifier (all / last, the Final Answers section, too few answers, think_end), the dataset
transform (seeded, distinct problems, integer answers only, refused when too few), and tiny-model runs (the neutral
setting is vanilla; a composed run trains on composed prompts and logs its chain accuracy)."""

import re

import pytest
from datasets import Dataset

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    digit_fraction_reward,
    make_tiny_trainer,
    record_run,
    tiny_dataset,
)
from trl_plugins_builtin.r_horizon import (
    ANSWERS_COLUMN,
    as_integer,
    chain_answers,
    chain_reward,
    compose_chain,
    compose_dataset,
    key_integer,
)


# ------------------------------------------------------------------------------------------ composition
def test_key_integer_skips_decimals_fractions_powers_and_words():
    assert key_integer("Compute 7-1-5 step by step.") == (8, 9)
    text = "Take 2.5 kg, 3/4 of it, x^2 and a2, then add 12 apples."
    start, end = key_integer(text)
    assert text[start:end] == "12"
    assert key_integer("no numbers here") is None


def test_as_integer():
    assert [as_integer(v) for v in ("12", " -3 ", 7, "1.5", "x", True, None)] == [12, -3, 7, None, None, None, None]


def _linked_value(prompt, j, previous_answer):
    """Evaluate problem j's variable definition with the previous answer substituted."""
    match = re.search(rf"\[variable{j}\] = \[answer{j - 1}\] ([+-]) (\d+)", prompt)
    sign = 1 if match.group(1) == "+" else -1
    return previous_answer + sign * int(match.group(2))


def test_compose_chain_links_each_problem_to_the_previous_answer():
    questions = ["Compute 7-1 step by step.", "Compute 4+2 step by step.", "Compute 30-5 step by step."]
    answers = [6, 6, 25]
    prompt = compose_chain(questions, answers)
    assert prompt.startswith("Problem 1: Compute 7-1 step by step.")
    assert "Problem 2: Let [variable2] = [answer1] - 2, where [answer1] is the answer to Problem 1. Compute " \
           "[variable2]+2 step by step." in prompt
    assert "[variable3] = [answer2] + 24" in prompt and "Compute [variable3]-5" in prompt
    # substituting the true answers gives back each problem's own number: the targets stay the original answers
    assert _linked_value(prompt, 2, answers[0]) == 4 and _linked_value(prompt, 3, answers[1]) == 30
    assert prompt.rstrip().endswith("Problem 3: \\boxed{[answer3]}") and "### Final Answers" in prompt


def test_compose_chain_refuses_a_problem_without_an_integer():
    with pytest.raises(ValueError, match="problem 2 has no integer"):
        compose_chain(["Compute 1+1.", "Name a colour."], [2, 0])


# ------------------------------------------------------------------------------------------ chained verifier
@pytest.mark.parametrize(
    "completion, expected",
    [
        ("work\n### Final Answers\nProblem 1: \\boxed{6}\nProblem 2: \\boxed{8}", ["6", "8"]),
        # the section holds a wrong count: the last n boxed answers of the whole solution (the section's included)
        ("\\boxed{1} \\boxed{6} \\boxed{7}\nFinal Answers:\nProblem 1: \\boxed{8}", ["7", "8"]),
        ("scratch \\boxed{5} then \\boxed{6} and \\boxed{8}", ["6", "8"]),
        ("only \\boxed{6}", []),
        ("nested \\boxed{\\frac{1}{2}} \\boxed{3}", ["\\frac{1}{2}", "3"]),
    ],
)
def test_chain_answers(completion, expected):
    assert chain_answers(completion, 2) == expected


@pytest.mark.parametrize(
    "completion, mode, think_end, reward",
    [
        ("### Final Answers\nProblem 1: \\boxed{6}\nProblem 2: \\boxed{8}", "all", None, 1.0),
        ("### Final Answers\nProblem 1: \\boxed{5}\nProblem 2: \\boxed{8}", "all", None, 0.0),  # one wrong: nothing
        ("### Final Answers\nProblem 1: \\boxed{5}\nProblem 2: \\boxed{8}", "last", None, 1.0),
        ("### Final Answers\nProblem 1: \\boxed{6}\nProblem 2: \\boxed{7}", "last", None, 0.0),
        ("\\boxed{8}", "last", None, 0.0),  # too few answers is a format error in both modes
        ("\\boxed{ 6.0 } \\boxed{$8$}", "all", None, 1.0),  # normalised exact match
        ("<think>\\boxed{6} \\boxed{8}</think> no answers after", "all", "</think>", 0.0),
        ("<think>x</think>\\boxed{6} \\boxed{8}", "all", "</think>", 1.0),
        ("\\boxed{6} \\boxed{8}", "all", "</think>", 0.0),  # no marker: 0, as the official reward
    ],
)
def test_chain_reward(completion, mode, think_end, reward):
    assert chain_reward(completion, ["6", "8"], mode, think_end) == reward


# ------------------------------------------------------------------------------------------ dataset transform
def _problems():
    rows = [{"prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": f"Compute {a}+{b}."}],
             "answer": str(a + b), "level": a} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]]
    rows.append({"prompt": [{"role": "user", "content": "Compute 1/2+1/2."}], "answer": "1.0", "level": 0})
    return Dataset.from_list(rows)


def test_compose_dataset_builds_distinct_seeded_chains_of_integer_problems():
    data = _problems()
    out = compose_dataset(data, 3, seed=0)
    assert len(out) == 5  # the composable problems (the 1.0 answer is not an integer)
    assert compose_dataset(data, 3, seed=0).to_list() == out.to_list()
    assert compose_dataset(data, 3, seed=1).to_list() != out.to_list()
    by_answer = {r["answer"]: r for r in data.to_list()}
    chains = set()
    for row in out:
        targets = row[ANSWERS_COLUMN]
        assert len(targets) == 3 == len(set(targets)) and "1.0" not in targets
        chains.add(tuple(targets))
        last = by_answer[targets[-1]]
        assert row["answer"] == targets[-1] and row["level"] == last["level"]  # the last problem's columns
        assert row["prompt"][0] == {"role": "system", "content": "sys"}  # only the last user message changes
        text = row["prompt"][-1]["content"]
        assert text.startswith(f"Problem 1: {by_answer[targets[0]]['prompt'][-1]['content']}")
        for j in (2, 3):
            number = int(re.search(r"Compute (\d+)\+", by_answer[targets[j - 1]]["prompt"][-1]["content"]).group(1))
            assert _linked_value(text, j, int(targets[j - 2])) == number
    assert len(chains) == 5
    assert len(compose_dataset(data, 2, seed=0, num_samples=12)) == 12


def test_compose_dataset_refuses_too_few_integer_problems_and_a_missing_column():
    with pytest.raises(PluginConfigError, match="num_problems=6 needs at least 6 rows with an integer 'answer'"):
        compose_dataset(_problems(), 6, seed=0)
    with pytest.raises(PluginConfigError, match="has no 'solution' column"):
        compose_dataset(_problems(), 2, seed=0, answer_column="solution")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_problems": 0}, "Option 'num_problems' of plugin 'r_horizon' got 0"),
        ({"reward": "any"}, "Option 'reward' of plugin 'r_horizon' got 'any'"),
        ({"num_samples": 0}, "Option 'num_samples' of plugin 'r_horizon' got 0"),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["r_horizon"], {"r_horizon": options})


# ------------------------------------------------------------------------------------------ trainer runs
def test_neutral_setting_is_vanilla():
    assert_reduces_to_vanilla("r_horizon", {"num_problems": 1}, loss_types=("grpo", "dapo"), steps=1)


def test_a_run_trains_on_composed_prompts_with_the_chained_verifier(tmp_path):
    dataset = tiny_dataset(8)
    trainer = make_tiny_trainer(plugins=["r_horizon"], reward_funcs=[digit_fraction_reward], dataset=dataset,
                                max_steps=1, log_level="error", output_dir=str(tmp_path))
    assert trainer.reward_func_names == ["digit_fraction_reward", "r_horizon_chain"]
    composed = trainer.train_dataset
    assert len(composed) == 8 and all(len(t) == 2 for t in composed[ANSWERS_COLUMN])
    assert all(p[-1]["content"].startswith("Problem 1: ") for p in composed["prompt"])
    run = record_run(trainer)
    logs = [log for log in run.logs if "loss" in log]
    assert "plugins/r_horizon/chain_accuracy" in logs[0] and "rewards/r_horizon_chain/mean" in logs[0]


def test_reward_function_scores_composed_rows_and_skips_others():
    plugin = build_plugins(["r_horizon"], {}).by_name["r_horizon"]
    (reward,) = plugin.trl_plugins_reward_functions(None)
    assert reward.__name__ == "r_horizon_chain"
    done = "### Final Answers\nProblem 1: \\boxed{6}\nProblem 2: \\boxed{8}"
    assert reward([done, "\\boxed{6} \\boxed{9}"], **{ANSWERS_COLUMN: [["6", "8"], ["6", "8"]]}) == [1.0, 0.0]
    assert reward([done, done]) == [None, None]  # rows it did not compose (an eval dataset): not applicable
