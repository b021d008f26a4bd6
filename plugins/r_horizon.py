"""R-HORIZON — composed multi-problem prompts with a chained verifier (arXiv:2510.08189).

R-HORIZON trains long-horizon reasoning by **query composition**: ``n`` problems with integer answers are chained
into one prompt, each problem after the first depending on the previous answer, and the rollout is rewarded only
when **every** answer is right. Facts from the official code (meituan-longcat/R-HORIZON@ed98e43):

1. Data (``data_contruction/step1_filt_integer_samples.py``, ``step3_combine_problems.py``): only problems whose
   answer is an integer are composed. In problem ``j > 1`` a key integer ``v_j`` of its text is replaced by a
   variable ``[variable j]``, defined as ``[answer j-1] + (v_j - a_{j-1})`` (``a_{j-1}`` the previous answer; ``-``
   with ``|d|`` when the difference is negative: ``create_dependency_expression``, step3:58); so solving problem
   ``j`` needs the answer of ``j - 1``, and the original answers stay the targets. A closing block names the
   placeholders and asks for ``Problem i: \\boxed{...}`` lines under a "Final Answers" heading (step3:195-212); the
   target is the comma-joined answers (step3:220). Tuples of ``n`` distinct problems are drawn at random,
   duplicates skipped (step3:275). The other columns come from the last problem (step3:236).
2. Reward (``training/verl/utils/reward_score/deepscaler_math_multi_verify/math_reward.py``): the solution is the
   text after ``</think>`` (a completion without it scores 0, math_reward.py:35); the ``n`` answers are the boxed
   answers of the "Final Answers" section when it holds exactly ``n``, otherwise the last ``n`` boxed answers of the
   solution (fewer: 0; ``extract_k_boxed_answers``); the reward is 1 only when all ``n`` match their targets
   (math_reward.py:53-77, ``is_correct`` returned at :115), else 0.

Here the composition is a dataset transform (the ``trl_plugins_train_dataset`` seam: the training dataset is
replaced when the trainer is built, the same on every process, seeded by ``args.seed``) and the chained verifier is
the reward column ``r_horizon_chain``. A composed row is the last problem's row with its prompt's last user message
replaced by the composed text, its ``answer_column`` set to the last answer, and the per-problem targets in the column
``r_horizon_answers``. ``num_problems = 1`` leaves the dataset and the rewards as they are (vanilla GRPO).

Reconstructed or ours: the key integer is the first integer of the problem that is not part of a decimal, a
fraction or a power (officially GPT-4.1 picks it among the integers); the wording of the linking sentence and of the
closing block is ours (the official sentences are not copied); answers are compared by normalised exact match
(official: math-equivalence graders); ``think_end`` defaults to None (the whole completion is the solution), since the
bundled tasks do not think in tags (official: ``</think>``); ``reward='last'`` (only the last answer counts) is a
variant the paper compares against.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trl_plugins.api import (
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.answers import extract_all_boxed, normalize_answer
from trl_plugins.api.text import completion_text, last_user_text, with_last_user_text

ANSWERS_COLUMN = "r_horizon_answers"
REWARD_NAME = "r_horizon_chain"
#: an unsigned integer not glued to a letter, a decimal point, a fraction bar, a power or another digit
_KEY_INTEGER = re.compile(r"(?<![\w.^/])\d+(?![\w.^/])")
_INTEGER = re.compile(r"^\s*[-+]?\d+\s*$")
_FINAL_SECTION = re.compile(r"final\s*answers?\s*(?:\*\*)?\s*:?\s*\n(.*)$", re.IGNORECASE | re.DOTALL)


@dataclass
class RHorizonOptions(PluginOptions):
    num_problems: int = option(
        2, min=1, max=16,
        help="Problems chained into one prompt (official training data: 2); 1 = the dataset unchanged (vanilla).",
    )
    answer_column: str = option("answer", help="Dataset column holding each problem's answer (integers are composed).")
    question_column: str | None = option(
        None, help="Column holding each problem's text; None = the last user message of the prompt (or the prompt).",
    )
    num_samples: int | None = option(
        None, min=1, help="Composed rows to build; None = as many as the dataset has composable problems."
    )
    reward: Literal["all", "last"] = option(
        "all", help="'all': 1 only when every answer is right (official); 'last': only the last answer counts."
    )
    reward_weight: float = option(1.0, help="TRL reward weight of the r_horizon_chain column.")
    think_end: str | None = option(
        None,
        help="The solution is the text after this marker, a completion without it scores 0 (official: '</think>'); "
        "None = the whole completion.",
    )


# ================================================================================================ composition
def key_integer(text: str) -> tuple[int, int] | None:
    """Character span ``(start, end)`` of the key integer of ``text`` (the first plain integer), or None."""
    match = _KEY_INTEGER.search(text)
    return (match.start(), match.end()) if match else None


def as_integer(answer: Any) -> int | None:
    """The answer as an integer, or None when it is not one (``"12"`` and ``12`` are; ``"1.5"``, ``"x"`` are not)."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return answer
    if isinstance(answer, str) and _INTEGER.match(answer):
        return int(answer)
    return None


def dependency(previous: int, value: int, index: int) -> str:
    """``[answer index-1] + d`` (or ``- |d|``) that equals ``value`` when the previous answer is ``previous``."""
    d = value - previous
    return f"[answer{index - 1}] {'+' if d >= 0 else '-'} {abs(d)}"


def compose_chain(questions: Sequence[str], answers: Sequence[int]) -> str:
    """One prompt chaining ``questions`` (each with an integer answer in ``answers``).

    Problem 1 is kept as it is; in problem ``j > 1`` the key integer ``v_j`` becomes ``[variable j]``, defined from
    the previous answer as ``[answer j-1] + (v_j - a_{j-1})``. Raises ValueError when a problem after the first has
    no key integer.
    """
    parts = [f"Problem 1: {questions[0]}"]
    for j in range(2, len(questions) + 1):
        text = questions[j - 1]
        span = key_integer(text)
        if span is None:
            raise ValueError(f"problem {j} has no integer to link to problem {j - 1}: {text!r}")
        value = int(text[span[0]:span[1]])
        linked = text[:span[0]] + f"[variable{j}]" + text[span[1]:]
        parts.append(
            f"Problem {j}: Let [variable{j}] = {dependency(int(answers[j - 2]), value, j)}, where [answer{j - 1}] is "
            f"the answer to Problem {j - 1}. {linked}"
        )
    n = len(questions)
    closing = (
        "Here [answerk] stands for the answer to Problem k and [variablek] for the value Problem k derives from it. "
        "Solve the problems in order, then give every answer under the heading '### Final Answers', one line each:\n"
        + "\n".join(f"Problem {i}: \\boxed{{[answer{i}]}}" for i in range(1, n + 1))
    )
    return "\n\n".join(parts) + "\n\n" + closing


def chain_answers(solution: str, n: int) -> list[str]:
    """The ``n`` answers of a solution: the boxed answers of its 'Final Answers' section when it holds exactly ``n``
    ``Problem i:`` answers, else the last ``n`` boxed answers of the whole solution; [] when fewer than ``n``."""
    section = _FINAL_SECTION.search(solution)
    if section and re.search(r"Problem\s*\d+\s*:", section.group(1)):
        answers = extract_all_boxed(section.group(1))
        if len(answers) == n:
            return answers
    answers = extract_all_boxed(solution)
    return answers[-n:] if len(answers) >= n else []


def chain_reward(completion: str, targets: Sequence[str], mode: str = "all", think_end: str | None = None) -> float:
    """1.0 when the chained answers of ``completion`` are right (all of them, or the last with ``mode='last'``)."""
    if think_end is not None:
        if think_end not in completion:
            return 0.0
        completion = completion.split(think_end, 1)[1]
    answers = chain_answers(completion, len(targets))
    if not answers:
        return 0.0
    pairs = list(zip(answers, targets))
    if mode == "last":
        pairs = pairs[-1:]
    return float(all(normalize_answer(a) == normalize_answer(str(t)) for a, t in pairs))


# ================================================================================================ dataset transform
def question_text(row: dict, question_column: str | None) -> str:
    """A row's problem text: ``question_column``, else the prompt's last user message (or the prompt string)."""
    return str(row[question_column]) if question_column is not None else last_user_text(row["prompt"])


def compose_dataset(dataset: Any, num_problems: int, seed: int, answer_column: str = "answer",
                    question_column: str | None = None, num_samples: int | None = None) -> Any:
    """The composed training dataset: ``num_samples`` rows, each chaining ``num_problems`` distinct composable rows
    (integer answer; an integer to link to, after the first) drawn with ``random.Random(seed)``, duplicates skipped.

    Returns a ``datasets.Dataset`` with the last problem's columns, the composed prompt, ``answer_column`` = the last
    answer (as a string) and :data:`ANSWERS_COLUMN` (every answer, as strings). Raises PluginConfigError when fewer
    than ``num_problems`` rows can be composed.
    """
    import datasets

    columns = list(dataset[0].keys()) if len(dataset) else []
    for column in (answer_column, question_column or "prompt"):
        if column not in columns:
            raise PluginConfigError(
                f"r_horizon: the training dataset has no {column!r} column (columns: {columns}); set answer_column / "
                "question_column to the columns holding each problem's answer and text."
            )
    rows = [dict(dataset[i]) for i in range(len(dataset))]
    texts = [question_text(r, question_column) for r in rows]
    answers = [as_integer(r[answer_column]) for r in rows]
    usable = [i for i in range(len(rows)) if answers[i] is not None]
    linkable = [i for i in usable if key_integer(texts[i]) is not None]
    if len(usable) < num_problems or (num_problems > 1 and not linkable):
        raise PluginConfigError(
            f"r_horizon: num_problems={num_problems} needs at least {num_problems} rows with an integer "
            f"{answer_column!r} (and, after the first, an integer in the problem to link to); the training dataset "
            f"has {len(usable)} with an integer answer, {len(linkable)} of them linkable."
        )
    rng = random.Random(seed)
    target = num_samples or len(usable)
    seen: set[tuple[int, ...]] = set()
    composed: list[dict] = []
    for _ in range(target * 5):
        if len(composed) == target:
            break
        first = rng.choice(usable)
        rest_pool = [i for i in linkable if i != first]
        if len(rest_pool) < num_problems - 1:
            continue
        chain = (first, *rng.sample(rest_pool, num_problems - 1))
        if chain in seen:
            continue
        seen.add(chain)
        last = rows[chain[-1]]
        row = dict(last)
        row["prompt"] = with_last_user_text(last["prompt"], compose_chain([texts[i] for i in chain],
                                                                     [answers[i] for i in chain]))
        row[answer_column] = str(answers[chain[-1]])
        row[ANSWERS_COLUMN] = [str(answers[i]) for i in chain]
        composed.append(row)
    return datasets.Dataset.from_list(composed)


# ================================================================================================ plugin
class RHorizonPlugin(Plugin):
    """Chains several problems into one prompt and rewards only fully right chains (sampling data and reward)."""

    name = "r_horizon"
    multi_turn = "R-HORIZON composes single-turn problems into one prompt and verifies the final text's answers."
    image_inputs = (
        "it composes several problems' text into one prompt, and an image prompt's image belongs to its own problem."
    )
    version = "0.1.0"
    paper = "R-Horizon: How Far Can Your Large Reasoning Model Really Go in Breadth and Depth?, arXiv:2510.08189"
    summary = "Composes n dependent problems into one prompt (each uses the previous answer); reward when all are right."
    Options = RHorizonOptions
    official = OfficialSource(
        "meituan-longcat/R-HORIZON", "ed98e43", verdict="faithful",
        files=("data_contruction/step3_combine_problems.py",
               "training/verl/utils/reward_score/deepscaler_math_multi_verify/math_reward.py"),
        note="The key integer is picked by a rule (official: GPT-4.1); answers by normalised exact match (official: "
        "math-equivalence graders); the prompt wording is ours.",
        variants=("reward",),
        non_official_defaults={"think_end": "'</think>' (the official solution is the text after it); None here, "
                               "the whole completion, since the bundled tasks do not think in tags"},
    )
    claim_metric = ("chain_accuracy", "composed prompts fully solved")
    replaces = ("the training dataset (composed prompts)",)
    reconstructed = (
        "the key integer of a problem is its first integer outside decimals, fractions and powers (official: chosen by "
        "GPT-4.1)",
        "the wording of the linking sentence and of the closing answer-format block (not the official sentences)",
        "answers compared by normalised exact match (official: mathd / sympy equivalence)",
    )

    def hook_enabled(self, hook: str) -> bool:
        return self.options.num_problems > 1  # one problem per prompt: the dataset and the rewards as they are

    def required_columns(self) -> list[str]:
        return [self.options.answer_column] + ([self.options.question_column] if self.options.question_column else [])

    @hookimpl
    def trl_plugins_train_dataset(self, dataset, args):
        o = self.options
        return compose_dataset(dataset, o.num_problems, int(args.seed), o.answer_column, o.question_column,
                               o.num_samples)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        o = self.options

        def r_horizon_chain(completions, **kwargs):
            targets = kwargs.get(ANSWERS_COLUMN)
            if targets is None:  # rows this plugin did not compose (an eval dataset): not applicable (NaN)
                return [None] * len(completions)
            return [chain_reward(completion_text(c), t, o.reward, o.think_end) for c, t in zip(completions, targets)]

        r_horizon_chain.reward_weight = o.reward_weight
        return [r_horizon_chain]

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Read (never change) the chained verifier column: log how many composed prompts were fully solved."""
        column = ctx.rewards_per_func[:, ctx.reward_func_names.index(REWARD_NAME)]
        ctx.log_metric("chain_accuracy", float((column > 0.5).float().mean()))
