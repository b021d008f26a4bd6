"""trl_plugins.api.answers: answer extraction, normalised exact-match clustering, EMPO / TTRL rewards, semantic
entropy."""

import math

import pytest

from trl_plugins.api.answers import (
    batch_clusters,
    cluster_answers,
    cluster_fractions,
    cluster_sizes,
    extract_boxed,
    extract_boxed_or_last_number,
    extract_last_number,
    extract_task_answer,
    get_extractor,
    group_cluster_ids,
    majority_votes,
    max_semantic_entropy,
    normalize_answer,
    semantic_entropy,
)
from trl_plugins.testing import make_reward_context


def test_extractors():
    assert extract_task_answer("3+4=7\nAnswer: 7") == "7"
    assert extract_task_answer("no answer line") is None
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and \boxed{ 42 }") == "42"
    assert extract_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert extract_boxed("nothing") is None
    assert extract_last_number("1,000 apples then 3.5 and -2") == "-2"
    assert extract_last_number("none") is None
    assert extract_boxed_or_last_number(r"x = 3 so \boxed{5}, not 7") == "5"
    assert extract_boxed_or_last_number("x = 3, y = 7") == "7"
    assert get_extractor("task") is extract_task_answer
    assert get_extractor("trl_plugins.api.answers:extract_boxed") is extract_boxed
    with pytest.raises(ValueError, match="unknown answer extractor 'nope'"):
        get_extractor("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        get_extractor("trl_plugins.api.answers:missing")


def test_normalisation_and_clusters():
    assert normalize_answer(" 1,000. ") == "1000"
    assert normalize_answer("$5.0$") == normalize_answer("+5") == normalize_answer("5") == "5"
    assert normalize_answer("0.50") == normalize_answer(".5") == "0.5"
    assert normalize_answer("Paris") == normalize_answer(" paris ") == "paris"
    assert normalize_answer(r"\text{Paris}") == "paris"
    assert cluster_answers(["7", "07", None, "8", "7.0"]) == [0, 0, None, 1, 0]
    assert group_cluster_ids(["1", "1", "2", "3"], 2) == [[0, 0], [0, 1]]
    with pytest.raises(ValueError, match="whole groups"):
        group_cluster_ids(["1", "2", "3"], 2)


def test_cluster_rewards():
    assert cluster_fractions([0, 0, 1, None]) == [0.5, 0.5, 0.25, 0.0]
    assert majority_votes([1, 0, 1, 0, None]) == [0.0, 1.0, 0.0, 1.0, 0.0]  # tie -> first-appearing cluster (0)
    assert majority_votes([0, 1, 1]) == [0.0, 1.0, 1.0]
    assert majority_votes([None, None]) == [0.0, 0.0]


def test_semantic_entropy_values():
    G = 4
    assert semantic_entropy([0, 0, 0, 0]) == 0.0
    assert semantic_entropy([0, 1, 2, 3]) == pytest.approx(math.log(4)) == pytest.approx(max_semantic_entropy(G))
    assert semantic_entropy([0, 1, 2, 3], "plugin") == pytest.approx(math.log(4))
    # clusters {2, 1, 1}: mc = -(log .5 + 2 log .25)/3; plugin = -(.5 log .5 + 2 * .25 log .25)
    assert semantic_entropy([0, 0, 1, 2], "mc") == pytest.approx(-(math.log(0.5) + 2 * math.log(0.25)) / 3)
    assert semantic_entropy([0, 0, 1, 2], "plugin") == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    # unanswered completions: singletons, one cluster, or ignored
    assert cluster_sizes([0, 0, None, None], "singleton") == [2, 1, 1]
    assert cluster_sizes([0, 0, None, None], "cluster") == [2, 2]
    assert cluster_sizes([0, 0, None, None], "ignore") == [2]
    assert semantic_entropy([0, 0, None, None], unanswered="ignore") == 0.0
    assert semantic_entropy([None, None], unanswered="ignore") == 0.0
    assert max_semantic_entropy(1) == 0.0


def test_batch_clusters_is_computed_once_per_context():
    gathered = []
    completions = [[{"role": "assistant", "content": "Answer: 3"}], "Answer: 3", "Answer: 4", "junk"]
    ctx = make_reward_context([0.0] * 4, num_generations=2, completions=completions,
                              gather_object=lambda values: gathered.append(values) or values)
    answers, clusters = batch_clusters(ctx, "task")
    assert answers == ["3", "3", "4", None]
    assert clusters == [[0, 0], [0, None]]
    assert batch_clusters(ctx, "task") == (answers, clusters)
    assert len(gathered) == 1
