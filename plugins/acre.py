"""ACRE -- answer-consistent reasoning: re-ask with shuffled options and the same reasoning (arXiv:2510.10104).

"Answer-Consistent Chain-of-thought Reinforcement Learning for Multi-modal Large Language Models": GRPO rewards the
final answer alone, so a policy learns answers its reasoning does not support. ACRE checks the reasoning: after a
multiple-choice completion ``o = (z, y)`` (reasoning ``z``, option letter ``y``), the **options are shuffled** and the
model is **asked again with the same reasoning** ``z``; the accuracy reward is kept only when the second answer names
the same option as the first.

Per local row of a multiple-choice prompt (the row's ``options_column`` holds the option texts, rendered in the prompt
as ``option_format`` lines, one per option, letters A, B, ...):

1. Sampling stage (after generation): ``z`` is the completion before the first match of ``answer_marker`` and ``y``
   the letter after it. The options block of the prompt is replaced by the same options in a shuffled order (a
   permutation drawn from ``seed``, the step and the row's global index; never the identity), and the generation
   service continues ``[shuffled prompt] + z + answer_prefix`` (greedy by default: one short answer). The new letter
   is mapped back through the permutation to the option it names; ``consistent = (that option is the option y
   named)``, stored in the row's annotations (``acre_consistent``). A completion without an answer letter is
   inconsistent (nothing to agree with) and is not re-asked; a re-ask cut by ``max_completion_length`` before its
   first new token leaves the row unchanged. Collective: every process calls the service once per
   batch, possibly with no request.
2. Reward stage: the accuracy column (``accuracy_column``; default the first reward column that is not a
   placeholder) of an inconsistent row is multiplied by ``inconsistent_scale`` (default 0: the accuracy reward only
   when both answers agree). Rows without options, and rows of a refill round (not re-asked), are unchanged.

Neutral setting: ``inconsistent_scale=1`` -- nothing is re-asked and the rewards are TRL's (tested).
Metrics: ``consistency_rate`` (re-asked rows whose answers agree), ``reasked_fraction`` (rows re-asked),
``inconsistent_correct`` (rows whose accuracy reward was cut).

Official code: none was found; **reconstructed** from the paper's description: the prompt surgery (the rendered
options block replaced), the greedy re-ask, the multiplicative gate on the accuracy column with scale 0, the
permutation seed. The paper's models are MLLMs on video and image questions; the re-ask reads the prompt as text, so
image prompts are refused.
"""

from __future__ import annotations

import copy
import random
import re
import string
from dataclasses import dataclass
from typing import Any

import torch

from trl_plugins.api import (
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginError,
    PluginOptions,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import gather_objects_together
from trl_plugins.api.reasons import without_images
from trl_plugins.api.text import check_template, completion_text

KEY = "acre_consistent"
LETTERS = string.ascii_uppercase


@dataclass
class AcreOptions(PluginOptions):
    options_column: str = option("options", help="Dataset column with the option texts (a list), in prompt order.")
    option_format: str = option(
        "{letter}. {option}", reconstructed=True,
        help="How each option is written on its own line in the prompt ({letter}, {option}); the block of these lines "
        "is what gets shuffled.",
    )
    answer_marker: str = option(r"(?i)answer\s*:", reconstructed=True,
                                help="Regex; the reasoning is the completion before its first match, the answer "
                                "letter follows it.")
    answer_prefix: str = option("\nAnswer:", reconstructed=True,
                                help="Written after the reasoning when the question is re-asked.")
    inconsistent_scale: float = option(
        0.0, min=0.0, max=1.0, reconstructed=True,
        help="Factor on the accuracy reward of a row whose two answers disagree (0: reward only when they agree; "
        "1: neutral, nothing re-asked).",
    )
    accuracy_column: str | None = option(
        None, help="Reward column gated by the consistency (None: the first reward column that is not a placeholder).",
    )
    greedy: bool = option(True, reconstructed=True, help="Re-ask with greedy decoding (False: the run's sampling).")
    seed: int = option(0, help="Seed of the option permutations (with the step and the row's global index).")

    def validate(self) -> None:
        try:
            re.compile(self.answer_marker)
        except re.error as exc:
            raise PluginConfigError(
                f"Plugin 'acre': answer_marker={self.answer_marker!r} is not a valid regex ({exc}).") from exc
        check_template("acre", "option_format", self.option_format, ("letter", "option"))


def options_block(options: list[str], fmt: str, order: list[int] | None = None) -> str:
    """The prompt's options lines: line ``k`` is ``fmt`` with letter ``k`` and option ``order[k]``."""
    order = list(range(len(options))) if order is None else order
    return "\n".join(fmt.format(letter=LETTERS[k], option=options[j]) for k, j in enumerate(order))


def permutation(n: int, seed: int, step: int, index: int) -> list[int]:
    """A permutation of ``range(n)`` that is not the identity (n >= 2), from ``(seed, step, index)``."""
    rng = random.Random(f"{seed}/{step}/{index}")
    order = list(range(n))
    while order == list(range(n)):
        rng.shuffle(order)
    return order


def answer_letter(text: str, n: int) -> int | None:
    """Index of the first option letter (A.. the n-th) at the start of ``text`` (``B``, ``(B)``, ``B.``), or None."""
    match = re.match(r"\s*\(?([A-Za-z])(?![A-Za-z])", text)
    if match is None:
        return None
    k = LETTERS.find(match.group(1).upper())
    return k if 0 <= k < n else None


def shuffled_prompt(prompt: Any, old: str, new: str) -> Any:
    """``prompt`` (text or messages) with the options block ``old`` replaced by ``new`` in its last user turn; None
    when the block is not there."""
    if isinstance(prompt, str):
        return prompt.replace(old, new, 1) if old in prompt else None
    messages = copy.deepcopy(list(prompt))
    for message in reversed(messages):
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str) and old in content:
            message["content"] = content.replace(old, new, 1)
            return messages
    return None


def gate(column: torch.Tensor, consistent: list[bool | None], scale: float) -> torch.Tensor:
    """(N,) accuracy column with inconsistent rows (False) multiplied by ``scale``; None rows unchanged."""
    factor = torch.tensor([scale if c is False else 1.0 for c in consistent], dtype=column.dtype,
                          device=column.device)
    return column * factor


class AcrePlugin(Plugin):
    """Accuracy reward kept only when the answer survives a shuffle of the options with the same reasoning."""

    name = "acre"
    version = "0.1.0"
    paper = ("Answer-Consistent Chain-of-thought Reinforcement Learning for Multi-modal Large Language Models (ACRE), "
             "arXiv:2510.10104")
    summary = "Shuffle the options, re-ask with the same reasoning; the accuracy reward only when both answers agree."
    Options = AcreOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; the shuffled re-ask with the same reasoning and the consistency-gated "
        "accuracy reward follow the paper; the prompt surgery, greedy re-ask, scale 0 and the seed are reconstructed.",
    )
    claim_metric = ("consistency_rate", "re-asked answers naming the same option")
    multi_turn = ("it re-asks one question with the reasoning of one assistant turn; tool calls and tool results "
                  "are not re-played.")
    image_inputs = without_images("it re-asks the question through the generation service from the prompt's text")
    reconstructed = (
        "the options block (option_format lines) replaced by a non-identity shuffle of the same options",
        "greedy re-ask continuing the same reasoning after 'Answer:'",
        "inconsistent rows: accuracy column x 0; rows without an answer letter are inconsistent",
    )

    @property
    def active(self) -> bool:
        return self.options.inconsistent_scale < 1.0

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        if not self.active:
            return
        o, tok = self.options, ctx.tokenizer
        prompts, prefixes, plans = [], [], []
        for i, row in enumerate(ctx.rows):
            options = row.get(o.options_column) if isinstance(row, dict) else None
            if not isinstance(options, (list, tuple)) or len(options) < 2:
                continue
            options = [str(x) for x in options]
            if len(options) > len(LETTERS):
                raise PluginError(f"acre: row {ctx.global_index[i]} has {len(options)} options; at most 26 letters.")
            text = completion_text(ctx.completions[i])
            match = re.search(o.answer_marker, text)
            first = answer_letter(text[match.end():], len(options)) if match else None
            if first is None:
                ctx.annotations[i][KEY] = False
                continue
            order = permutation(len(options), o.seed, ctx.step, ctx.global_index[i])
            old, new = options_block(options, o.option_format), options_block(options, o.option_format, order)
            prompt = shuffled_prompt(ctx.prompts[i], old, new)
            if prompt is None:
                raise PluginError(
                    f"acre: the prompt of row {ctx.global_index[i]} does not contain its options block "
                    f"{old!r} (column {o.options_column!r} rendered with option_format={o.option_format!r}); "
                    "set option_format to how the prompt writes the options."
                )
            prompts.append(prompt)
            prefixes.append(list(tok(text[:match.start()].rstrip() + o.answer_prefix,
                                     add_special_tokens=False)["input_ids"]))
            plans.append((i, order, first))
        answers = ctx.service.generate(prompts=prompts, prefix_ids=prefixes, greedy=o.greedy)  # collective
        agree = []
        for (i, order, first), prefix, answer in zip(plans, prefixes, answers):
            new_ids = list(answer.completion_ids)[len(prefix):]
            if not new_ids:  # the reasoning filled max_completion_length: no room for the answer, row unchanged
                continue
            k = answer_letter(tok.decode(new_ids, skip_special_tokens=True), len(order))
            ctx.annotations[i][KEY] = k is not None and order[k] == first
            agree.append(ctx.annotations[i][KEY])
        ctx.log_metric("reasked_fraction", len(plans) / max(len(ctx), 1))
        if agree:
            ctx.log_metric("consistency_rate", sum(agree) / len(agree))

    # ------------------------------------------------------------------------------------------ reward
    def _column(self, ctx: RewardContext) -> int:
        names, o = ctx.reward_func_names, self.options
        if o.accuracy_column is not None:
            if o.accuracy_column not in names:
                raise PluginConfigError(f"acre: accuracy_column={o.accuracy_column!r} is not a reward column; "
                                        f"allowed: {', '.join(names)}.")
            return names.index(o.accuracy_column)
        placeholders = ctx.run.placeholder_columns or (False,) * len(names)
        for k, placeholder in enumerate(placeholders):
            if not placeholder:
                return k
        raise PluginConfigError("acre: every reward column is a placeholder; there is no accuracy reward to gate.")

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        if not self.active:
            return
        local = list(ctx.local_annotations) or [{} for _ in ctx.local_rows]
        consistent = gather_objects_together(ctx, self.name, lambda: [a.get(KEY) for a in local])
        k = self._column(ctx)
        matrix = ctx.rewards_per_func.clone()
        before = matrix[:, k].clone()
        matrix[:, k] = gate(before, consistent, self.options.inconsistent_scale)
        ctx.rewards_per_func = matrix
        cut = ((before > 0) & (matrix[:, k] != before)).float().mean().item()
        ctx.log_metric("inconsistent_correct", cut)
