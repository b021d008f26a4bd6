"""Property tests of the chained-arithmetic task: generation, verifier, PRM, feedback, rubrics, hints."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_plugins.tasks import arithmetic as A
from trl_plugins.tasks.arithmetic import (
    LEVELS,
    Problem,
    accuracy_reward,
    extract_answer,
    feedback,
    first_error_step,
    hint,
    in_split,
    make_dataset,
    make_problem,
    make_rubrics,
    prm_step_scores,
    rubric_score,
    rubric_verdict,
    split_steps,
    step_scores,
    verify,
)

EXAMPLE = Problem.from_expression([3, 4, 2, 5], ["+", "*", "-"])  # 3+4=7, 7*2=14, 14-5=9

levels = st.sampled_from(sorted(LEVELS))
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def _problem(seed: int, level: int) -> Problem:
    return make_problem(random.Random(seed), level)


# ------------------------------------------------------------------------------------------------ problems


def test_example_problem_matches_the_documented_format():
    assert EXAMPLE.question == "Compute 3+4*2-5 step by step (left to right)."
    assert EXAMPLE.solution == "3+4=7\n7*2=14\n14-5=9\nAnswer: 9"
    assert EXAMPLE.steps == [(3, "+", 4, 7), (7, "*", 2, 14), (14, "-", 5, 9)]
    assert EXAMPLE.answer == 9


def test_left_to_right_is_not_operator_precedence():
    p = Problem.from_expression([2, 3, 4], ["+", "*"])
    assert p.answer == 20  # (2+3)*4, not 2+3*4 = 14


@given(seeds, levels)
def test_generated_problems_respect_their_level(seed, level):
    p = _problem(seed, level)
    spec = LEVELS[level]
    assert p.level == level
    assert len(p.steps) == len(p.operators) == spec.num_steps
    assert len(p.operands) == spec.num_steps + 1
    assert 1 <= p.operands[0] <= spec.max_operand
    value = p.operands[0]
    for (lhs, op, rhs, result), op_q, rhs_q in zip(p.steps, p.operators, p.operands[1:]):
        assert (lhs, op, rhs) == (value, op_q, rhs_q)
        assert result == A.apply_op(lhs, op, rhs)
        assert 0 <= result <= spec.max_value
        assert 2 <= rhs <= spec.max_multiplier if op == "*" else 1 <= rhs <= spec.max_operand
        value = result
    assert p.answer == value


@given(seeds, levels)
def test_reference_solution_is_verified_and_fully_scored(seed, level):
    p = _problem(seed, level)
    assert verify(p.solution, p.answer)
    assert verify(p.solution, str(p.answer))
    assert step_scores(p, p.solution) == [1.0] * (len(p.steps) + 1)
    assert first_error_step(p, p.solution) is None
    assert feedback(p, p.solution) == "Correct."


@given(seeds, levels)
def test_json_round_trip(seed, level):
    p = _problem(seed, level)
    assert Problem.from_json(p.to_json()) == p


def test_make_problem_is_deterministic_and_rejects_unknown_levels():
    assert _problem(7, 3) == _problem(7, 3)
    with pytest.raises(ValueError, match="unknown level 9"):
        make_problem(random.Random(0), 9)


def test_from_expression_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        Problem.from_expression([1, 2], ["+", "+"])
    with pytest.raises(ValueError, match="unknown operator"):
        Problem.from_expression([1, 2], ["/"])


# --------------------------------------------------------------------------------------------------- dataset


def test_dataset_columns_and_content():
    ds = make_dataset(12, levels=(1, 2, 3), seed=3)
    assert set(ds.column_names) == {"prompt", "answer", "solution", "level", "rubrics", "problem"}
    assert len(ds) == 12
    assert ds["level"] == [1, 2, 3] * 4
    for row in ds:
        p = Problem.from_json(row["problem"])
        assert row["prompt"] == [{"role": "user", "content": p.question}]
        assert row["answer"] == str(p.answer)
        assert row["solution"] == p.solution
        assert row["level"] == p.level
        assert row["rubrics"] == make_rubrics(p)
        for item in row["rubrics"]:
            assert set(item) == {"criterion", "points", "tags"}
            assert isinstance(item["points"], float)
            assert all(isinstance(t, str) for t in item["tags"])


def test_dataset_is_deterministic_and_seed_dependent():
    assert make_dataset(8, seed=1)["problem"] == make_dataset(8, seed=1)["problem"]
    assert make_dataset(8, seed=1)["problem"] != make_dataset(8, seed=2)["problem"]


def test_train_and_test_splits_never_share_a_problem():
    train = make_dataset(300, levels=(1,), seed=0, split="train")
    test = make_dataset(100, levels=(1,), seed=1, split="test")
    assert not set(train["solution"]) & set(test["solution"])
    assert all(in_split(Problem.from_json(j), "test") for j in test["problem"])
    with pytest.raises(ValueError, match="unknown split"):
        in_split(EXAMPLE, "validation")


def test_dataset_rejects_bad_levels():
    with pytest.raises(ValueError, match="unknown level"):
        make_dataset(2, levels=(6,))
    with pytest.raises(ValueError):
        make_dataset(2, levels=())


# ---------------------------------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3+4=7\nAnswer: 7", 7),
        ("Answer:7", 7),
        ("  answer :  12 .", 12),
        ("ANSWER: -3", -3),
        ("Answer: 5\nAnswer: 6", 5),  # the first answer line counts
        ("", None),
        ("3+4=7", None),
        ("Answer:", None),
        ("Answer: seven", None),
        ("Answer: 7 or 8", None),
        ("Answer: 7.5", None),
        ("The answer is 7.", None),
        ("My Answer: 7", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@given(st.text(max_size=60))
def test_extract_answer_never_crashes(text):
    got = extract_answer(text)
    assert got is None or isinstance(got, int)


def test_verify_and_accuracy_reward():
    good, bad = EXAMPLE.solution, "3+4=7\n7*2=14\n14-5=8\nAnswer: 8"
    assert verify(good, 9) and not verify(bad, 9) and not verify("no answer", 9)
    assert accuracy_reward([good, bad], answer=["9", "9"]) == [1.0, 0.0]
    conversational = [[{"role": "assistant", "content": good}], [{"role": "assistant", "content": bad}]]
    assert accuracy_reward(conversational, answer=[9, 9], prompts=None, level=[1, 1]) == [1.0, 0.0]
    assert accuracy_reward([[]], answer=["9"]) == [0.0]
    with pytest.raises(ValueError):
        accuracy_reward([good], answer=["9", "9"])


# ------------------------------------------------------------------------------------------------------ PRM


def test_split_steps_drops_blank_lines_and_strips():
    assert split_steps("  3+4=7 \n\n 7*2=14\n   \nAnswer: 14\n") == ["3+4=7", "7*2=14", "Answer: 14"]
    assert split_steps("") == []


@pytest.mark.parametrize(
    ("text", "scores", "first"),
    [
        ("3+4=7\n7*2=14\n14-5=9\nAnswer: 9", [1, 1, 1, 1], None),
        ("3 + 4 = 7\n\n7 * 2 = 14\n14 - 5 = 9\n\nAnswer: 9", [1, 1, 1, 1], None),
        ("3+4=7\n7*2=15\n15-5=10\nAnswer: 10", [1, 0, 0, 0], 1),  # error propagates: wrong running value
        ("3+4=8\n8*2=16\n16-5=11\nAnswer: 11", [0, 0, 0, 0], 0),
        ("3+4=7\n7+2=9\n9-5=4\nAnswer: 4", [1, 0, 0, 0], 1),  # wrong operator
        ("3+4=7\n7*3=21\n21-5=16\nAnswer: 16", [1, 0, 0, 0], 1),  # wrong operand
        ("3+4=7\n7*2=14\n14-5=9\nAnswer: 8", [1, 1, 1, 0], 3),  # wrong final answer
        ("3+4=7\n7*2=14\n14-5=9", [1, 1, 1], None),  # answer missing: nothing wrong yet
        ("3+4=7\nAnswer: 9", [1, 0], 1),  # answer too early, even if right
        ("3+4=7\n7 times 2 is 14", [1, 0], 1),  # malformed step
        ("3+4=7\n7*2=14\n14-5=9\n9+1=10\nAnswer: 10", [1, 1, 1, 0, 0], 3),  # extra step
        ("3+4=7\n7*2=14\n14-5=9\nAnswer: 9\nthanks", [1, 1, 1, 1, 0], 4),  # text after the answer
        ("", [], None),
    ],
)
def test_step_scores_and_first_error(text, scores, first):
    assert step_scores(EXAMPLE, text) == [float(s) for s in scores]
    assert first_error_step(EXAMPLE, text) == first


def test_prm_step_scores_gives_one_score_per_given_step():
    """The programmatic PRM's verifier contract: one score per given step, a multi-line step scoring the minimum
    over its lines (a whole response as one step, as reasonflux_prm passes it, is 1.0 iff every line is right)."""
    right = "3+4=7\n7*2=14\n14-5=9\nAnswer: 9"
    assert prm_step_scores(EXAMPLE, right.split("\n")) == [1.0, 1.0, 1.0, 1.0]
    assert prm_step_scores(EXAMPLE, [right]) == [1.0]
    assert prm_step_scores(EXAMPLE, ["3+4=7\n7*2=15\n15-5=10\nAnswer: 10"]) == [0.0]
    assert prm_step_scores(EXAMPLE, ["3+4=7\n7*2=14", "14-5=9\nAnswer: 8"]) == [1.0, 0.0]
    assert prm_step_scores(EXAMPLE, ["3+4=7", "  \n"]) == [1.0, 0.0]


@settings(max_examples=50)
@given(seeds, levels, st.data())
def test_corrupting_one_result_moves_the_first_error_there(seed, level, data):
    p = _problem(seed, level)
    k = data.draw(st.integers(0, len(p.steps) - 1))
    delta = data.draw(st.sampled_from([-2, -1, 1, 2]))
    lines = p.solution_lines
    lhs, op, rhs, result = p.steps[k]
    lines[k] = f"{lhs}{op}{rhs}={result + delta}"
    text = "\n".join(lines)
    scores = step_scores(p, text)
    assert len(scores) == len(lines)
    assert scores[:k] == [1.0] * k and scores[k] == 0.0
    assert first_error_step(p, text) == k
    assert feedback(p, text) == f"Step {k + 1} is wrong: {lhs}{op}{rhs} is {result}, not {result + delta}."


@given(seeds, levels, st.text(alphabet="0123456789+-*= \nAnswer:", max_size=80))
def test_prm_is_consistent_with_the_verifier(seed, level, text):
    p = _problem(seed, level)
    scores = step_scores(p, text)
    assert len(scores) == len(split_steps(text))
    assert set(scores) <= {0.0, 1.0}
    if scores and all(s == 1.0 for s in scores) and extract_answer(text) is not None:
        assert verify(text, p.answer)  # all steps right and an answer line => correct
    if verify(text, p.answer) and first_error_step(p, text) is None:
        assert feedback(p, text) == "Correct."


# ------------------------------------------------------------------------------------------------- feedback


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (EXAMPLE.solution, "Correct."),
        ("3+4=7\n7*2=15\n15-5=10\nAnswer: 10", "Step 2 is wrong: 7*2 is 14, not 15."),
        ("3+4=7\n7*2=14\n14-5=9", "The final answer is missing."),
        ("3+4=7\n7*2=14\n14-5=9\nAnswer: 8", "The final answer is wrong: it should be 9, not 8."),
        ("", "The solution is empty. Write one step per line, then 'Answer: N'."),
        ("3+4=7", "The solution stops early: step 2 should compute 7*2."),
        ("3+4=7\nAnswer: 7", "Step 2 gives the answer too early: the next step should compute 7*2."),
        ("3+4=7\n8*2=16", "Step 2 is wrong: it should start from the running value 7, not 8."),
        ("3+4=7\n7+2=9", "Step 2 is wrong: the next operation is *2, not +2."),
        ("3+4=7\n7 times 2", "Step 2 is malformed: it should have the form a op b=c, here 7*2=14."),
        (
            "3+4=7\n7*2=14\n14-5=9\nThe answer is 9.",
            "Step 4 is malformed: after the last operation, write the final line as 'Answer: N'.",
        ),
        (
            "3+4=7\n7*2=14\n14-5=9\n9+1=10\nAnswer: 10",
            "Step 4 is superfluous: all 3 operations are done; write 'Answer: N' next.",
        ),
        (
            "3+4=7\n7*2=14\n14-5=9\nAnswer: 9\n9+1=10",
            "Step 5 is superfluous: the solution should end after the answer line.",
        ),
    ],
)
def test_feedback_messages(text, expected):
    assert feedback(EXAMPLE, text) == expected


@settings(max_examples=50)
@given(seeds, levels, st.data())
def test_feedback_reveals_at_most_the_first_wrong_step(seed, level, data):
    p = _problem(seed, level)
    k = data.draw(st.integers(0, len(p.steps) - 1))
    lines = [*p.step_lines[:k], "1+1=3"]
    msg = feedback(p, "\n".join(lines))
    assert msg.startswith(f"Step {k + 1} ")
    # No later step result is given away, and the final answer only if it is this step's result.
    for (lhs, op, rhs, r) in p.steps[k + 1 :]:
        assert f"{lhs}{op}{rhs} is {r}" not in msg
    assert "Answer" not in msg or "Answer: N" in msg


# -------------------------------------------------------------------------------------------------- rubrics


def test_rubric_items_have_healthbench_shape_and_math_linear_order():
    items = make_rubrics(EXAMPLE)
    assert [it["points"] for it in items] == [3.0, 1.0, 1.0, 1.0, -6.0, 2.0, 5.0]
    assert items[-1]["criterion"] == "States the correct final answer 9"
    assert "kind:format" in items[-2]["tags"]  # format item second to last, final answer last
    assert items[1]["criterion"] == "Includes the intermediate step 3+4=7"
    assert all("verifier:rule" in it["tags"] for it in items)


def _verdicts(text: str) -> dict[str, bool]:
    out = {}
    for it in make_rubrics(EXAMPLE):
        kind = next(t for t in it["tags"] if t.startswith("kind:"))
        step = next((t for t in it["tags"] if t.startswith("step:")), "")
        out[kind + step] = rubric_verdict(it, EXAMPLE, text)
    return out


def test_rubric_verdicts_on_the_reference_solution():
    assert _verdicts(EXAMPLE.solution) == {
        "kind:all_steps": True,
        "kind:stepstep:1": True,
        "kind:stepstep:2": True,
        "kind:stepstep:3": True,
        "kind:wrong_answer": False,
        "kind:format": True,
        "kind:final_answer": True,
    }


def test_rubric_verdicts_on_flawed_solutions():
    wrong = _verdicts("3+4=7\n7*2=15\n15-5=10\nAnswer: 10")
    assert wrong == {
        "kind:all_steps": False,
        "kind:stepstep:1": True,
        "kind:stepstep:2": False,
        "kind:stepstep:3": False,
        "kind:wrong_answer": True,
        "kind:format": True,
        "kind:final_answer": False,
    }
    bare = _verdicts("Answer: 9")
    assert bare["kind:final_answer"] and not bare["kind:wrong_answer"]
    assert not bare["kind:all_steps"] and not bare["kind:format"] and not bare["kind:stepstep:1"]
    informal = _verdicts("3+4=7\n7*2=14\n14-5=9\nThe answer is 9.")
    assert informal["kind:all_steps"] and not informal["kind:format"]
    assert not informal["kind:final_answer"] and not informal["kind:wrong_answer"]
    one_line = _verdicts("3+4=7 7*2=14 14-5=9 Answer: 9")
    assert not one_line["kind:format"] and not one_line["kind:final_answer"]


def test_rubric_verdict_rejects_items_it_cannot_grade():
    with pytest.raises(ValueError, match="kind"):
        rubric_verdict({"criterion": "Is polite", "points": 1.0, "tags": []}, EXAMPLE, "hi")
    with pytest.raises(ValueError, match="unknown rubric kind 'tone'"):
        rubric_verdict({"criterion": "Is polite", "points": 1.0, "tags": ["kind:tone"]}, EXAMPLE, "hi")


def test_rubric_score_matches_healthbench():
    items = [{"points": 5.0}, {"points": 3.0}, {"points": -6.0}]
    assert rubric_score(items, [True, False, True]) == pytest.approx(-0.125)
    assert rubric_score([{"points": -1.0}], [True]) == 0.0
    full = make_rubrics(EXAMPLE)
    assert rubric_score(full, [rubric_verdict(it, EXAMPLE, EXAMPLE.solution) for it in full]) == 1.0


# ----------------------------------------------------------------------------------------------------- hints


def test_hint_prefixes():
    lines = EXAMPLE.solution_lines  # 4 lines
    assert hint(EXAMPLE, 0.0) == ""
    assert hint(EXAMPLE, 0.01) == lines[0]
    assert hint(EXAMPLE, 0.25) == lines[0]
    assert hint(EXAMPLE, 0.5) == "\n".join(lines[:2])
    assert hint(EXAMPLE, 0.75) == "\n".join(lines[:3])
    assert hint(EXAMPLE, 0.99) == "\n".join(lines[:3])
    assert hint(EXAMPLE, 1.0) == EXAMPLE.solution
    with pytest.raises(ValueError, match="fraction"):
        hint(EXAMPLE, 1.5)


@given(seeds, levels, st.floats(min_value=0.0, max_value=1.0))
def test_hint_is_a_line_prefix_that_hides_the_answer_until_complete(seed, level, fraction):
    p = _problem(seed, level)
    h = hint(p, fraction)
    assert p.solution.startswith(h)
    n = len(split_steps(h))
    total = len(p.solution_lines)
    expected = 0 if fraction == 0 else max(1, int(fraction * total))
    assert n == (expected if fraction == 1.0 else min(expected, total - 1))
    if fraction < 1.0:
        assert extract_answer(h) is None
    # The hint's steps are all correct, and it never scores an error.
    assert first_error_step(p, h) is None
