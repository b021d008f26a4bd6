"""The chat-arithmetic task: deterministic datasets, disjoint splits, the lenient verifier and the columns the
guidance plugins read."""

import pytest

from trl_plugins.tasks.arithmetic import Problem, step_scores
from trl_plugins.tasks.chat_arith import (
    chat_accuracy_reward,
    chat_question,
    make_chat_dataset,
    reply_numbers,
    verify_reply,
)


def test_dataset_is_a_function_of_its_arguments_and_the_splits_never_share_a_problem():
    a = make_chat_dataset(64, seed=3, split="train")
    assert a.to_dict() == make_chat_dataset(64, seed=3, split="train").to_dict()
    assert a.to_dict() != make_chat_dataset(64, seed=4, split="train").to_dict()
    test = make_chat_dataset(64, seed=3, split="test")
    assert not {r["problem"] for r in a} & {r["problem"] for r in test}
    assert set(a.column_names) == {"prompt", "answer", "solution", "problem", "op"}


def test_rows_hold_question_answer_reference_reply_and_problem():
    for row in make_chat_dataset(40, seed=0, ops=("+", "-", "*"), max_operand=40):
        p = Problem.from_json(row["problem"])
        (a, b), op = p.operands, p.operators[0]
        assert row["prompt"] == [{"role": "user", "content": chat_question(a, op, b)}]
        assert row["prompt"][0]["content"] == f"What is {a} {op} {b}? Reply with only the number."
        assert int(row["answer"]) == p.answer >= 0 and row["op"] == op
        assert row["solution"] == f"{a} {op} {b} = {p.answer}"
        assert verify_reply(row["solution"], row["answer"], p.operands)  # the reference reply passes the verifier
        assert step_scores(p, row["solution"]) == [1.0]  # ... and the programmatic PRM (SCOPE)
        if op == "+":
            assert 1 <= a <= 40 and 1 <= b <= 40
        elif op == "-":
            assert 1 <= b <= a <= 40
        else:
            assert 2 <= a <= 12 and 2 <= b <= 9


def test_ops_cycle_in_order():
    assert make_chat_dataset(6, ops=("+", "*"))["op"] == ["+", "*", "+", "*", "+", "*"]


@pytest.mark.parametrize("text, ok", [
    ("40", True), ("40.", True), ("The answer is 40.", True), ("23 + 17 = 40", True), (" 40\nBecause 23+17", True),
    ("41", False), ("40 or 41", False), ("23-17=6", False), ("23 + 17", False), ("The sum of twenty-three and seventeen", False),
    ("", False), ("one two three four five six seven eight 40", False),  # the number must come early
])
def test_verifier_accepts_the_right_number_early_and_nothing_else(text, ok):
    assert verify_reply(text, "40", (23, 17)) is ok


def test_reward_reads_the_problem_column_and_without_it_only_the_answer_may_appear():
    problem = Problem.from_expression([23, 17], ["+"]).to_json()
    completions = ["23 + 17 = 40", "39", [{"role": "assistant", "content": "40"}]]
    assert chat_accuracy_reward(completions, ["40"] * 3, [problem] * 3) == [1.0, 0.0, 1.0]
    assert chat_accuracy_reward(completions, ["40"] * 3) == [0.0, 0.0, 1.0]
    assert reply_numbers("a 1,234 b -5 23-17=6") == [1234, -5, 23, 17, 6]
    assert verify_reply("23-17=6", 6, (23, 17))


@pytest.mark.parametrize("kwargs, match", [
    (dict(ops=("/",)), "unknown operation"), (dict(ops=()), "at least one"), (dict(max_operand=1), ">= 2"),
    (dict(n=-1), "n must be"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_chat_dataset(**{"n": 4, **kwargs})


def test_hint_prefixes_of_the_reference_reply_never_show_the_answer():
    """hint_scaffold's default hints (25/50/75 % of the solution by characters) stop before the answer."""
    from trl_plugins_builtin.hint_scaffold import hint_text

    for row in make_chat_dataset(300, seed=0, max_operand=40):
        for fraction in (0.25, 0.5, 0.75):
            hint = hint_text(row["solution"], fraction, "chars")
            assert row["solution"].startswith(hint) and hint.partition("=")[2].strip() == ""
