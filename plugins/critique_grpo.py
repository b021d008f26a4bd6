"""Critique-GRPO — learning from natural-language critiques and refinements (arXiv:2506.03106).

Follows the official implementation (zhangxy-2019/critique-GRPO):

1. G responses per question (TRL's own generation round).
2. One critique per response. ``critique_type``: ``simple_gt`` (default: "correct / incorrect, the ground truth is
   X"), ``simple`` ("correct / incorrect"), or ``text`` (a critic LLM, given the question, the response and the
   reference solution, describes the errors; correct responses get the fixed ``simple_gt`` string).
3. One refinement per response, sampled by the **policy** from a fresh single-turn chat (a generic system prompt;
   the user message holds the question, the previous response and the critique, and asks to fix the errors and
   reason step by step). Generated through the trainer's generation service: one collective call per batch.
4. Refinements are scored on the verifier column (``success_column``: the first reward function that is not a
   placeholder by default; other reward columns never count, as the official code scores math-verify only); per
   group **one** is picked: the first whose verifier value reaches success (``> success_threshold``; 1 for 0/1
   verifiers), else the highest-scoring one.
5. It **replaces slot 0** of its group (7 own + 1 refinement for G = 8), attached after the **original question**
   (prompt swap) and fully off-policy: shaped branch ``-A p/(p+gamma)`` with gamma = 0.1, NaN sampling log-probs.
6. Advantages are mean-centred over the G rows (``grpo_use_std=False``): use ``scale_rewards="none"`` (warned
   otherwise). The official recipe also removes the on-policy clip and aggregates as sum / L_max
   (``loss_type="dr_grpo"``); those are GRPOConfig settings left to the user.

The shipped config's ``n_prefix: -1`` would mark every row as the refinement; the debug traces and run name show
one replaced slot, which is what this plugin does (``replace_index``). Our options beyond the official code:
``refine="failed"`` (refine only failed responses), ``require_success`` (replace only with a successful refinement)
and ``warmup_steps``; their defaults reproduce the official behaviour. Metrics: ``initial_success_rate``,
``refinement_success_rate``, ``replaced_with_success_fraction``.

Official code checked against: ``zhangxy-2019/critique-GRPO@e8f03a2`` (faithful with documented options; the files and
the deviating options: ``trl-plugins show critique_grpo``, docs/faithfulness.md).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, RolloutContext, hookimpl, option
from trl_plugins.api.collectives import gather_id_lists, run_together
from trl_plugins.api.contexts import context_device
from trl_plugins.api.data_checks import check_column_filled
from trl_plugins.api.option_groups import OffPolicyOptions, WarmupOptions
from trl_plugins.api.reasons import EDITS_COMPLETIONS
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.text import check_template, completion_text
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE
from trl_plugins.components.client import endpoint_options
from trl_plugins.components.steps import question_text
from trl_plugins.components.teacher import shared_teacher

DEFAULT_SYSTEM = "You are a helpful assistant."
DEFAULT_REFINEMENT = (
    "Question:\n{question}\n\nYour previous solution:\n{response}\n\nCritique of that solution:\n{critique}\n\n"
    "Using the critique, correct the mistakes in your previous solution. Reason step by step and give the final "
    "answer at the end."
)
CRITIC_SYSTEM = (
    "You review a student's solution against a reference solution. Explain where and why the student's solution "
    "goes wrong, concisely, without writing out the full corrected solution."
)


#: ``critic_model``, ``critic_base_url``, ``critic_api_key_env``, ``critic_timeout``, ``critic_max_retries``.
CriticEndpointOptions = endpoint_options("critic", "critic")


@dataclass
class CritiqueGrpoOptions(CriticEndpointOptions, OffPolicyOptions, WarmupOptions, SuccessOptions):
    critique_type: Literal["text", "simple_gt", "simple"] = option(
        "simple_gt", help="Critique: a critic LLM's text, 'correct/incorrect + ground truth', or 'correct/incorrect'."
    )
    critic: Literal["endpoint", "hf"] = option("endpoint", help="critique_type='text': an endpoint or a local model.")
    critic_max_tokens: int = option(1024, min=1, help="Longest critique in tokens.")
    refinement_system_prompt: str | None = option(DEFAULT_SYSTEM, help="System message of the refinement chat.")
    refinement_template: str = option(
        DEFAULT_REFINEMENT, help="Refinement request; must contain {question}, {response} and {critique}."
    )
    refine: Literal["all", "failed"] = option(
        "all", help="Refine every response (official) or only the failed ones (fewer generations)."
    )
    replace_index: int = option(0, min=0, help="Group slot the chosen refinement replaces (official: 0).")
    require_success: bool = option(
        False, help="Replace only when the chosen refinement succeeds (official: always replace)."
    )
    success_threshold: float = option(
        0.5, help="A response is correct when its verifier column (success_column) is above this (official: the "
        "math-verify score equals 1)."
    )
    answer_column: str = option("answer", help="Dataset column with the ground-truth answer.")
    solution_column: str = option("solution", help="Dataset column with the reference solution (critique 'text').")

    def validate(self) -> None:
        check_template("critique_grpo", "refinement_template", self.refinement_template,
                       ("question", "response", "critique"))
        self.require_base_url("critic", "critique_grpo", active=self.critique_type == "text",
                              when="critique_type='text'", otherwise="critic='hf'")


# ============================================================================================= pure functions
def simple_critique(correct: bool, ground_truth: Any = None) -> str:
    """``simple`` (no ground truth) or ``simple_gt`` critique of a response."""
    verdict = "correct" if correct else "incorrect"
    if ground_truth is None:
        return f"The generated solution is {verdict}."
    return f"The generated solution is {verdict}, the ground truth is {ground_truth}."


def refinement_prompt(prompt: Any, response: str, critique: str, template: str, system: str | None) -> Any:
    """A fresh single-turn chat asking to refine ``response`` with ``critique`` (a string for string prompts)."""
    text = template.format(question=question_text(prompt), response=response, critique=critique)
    if isinstance(prompt, str):
        return text
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def pick_refinement(scores: list[float], threshold: float) -> int | None:
    """Index of the refinement a group keeps: the first with ``score > threshold``, else the highest-scoring (first
    of ties); None when the group has no refinement (all NaN)."""
    valid = [(j, s) for j, s in enumerate(scores) if not math.isnan(s)]
    if not valid:
        return None
    for j, s in valid:
        if s > threshold:
            return j
    return max(valid, key=lambda js: (js[1], -js[0]))[0]


# ============================================================================================= plugin
class CritiqueGrpoPlugin(Plugin):
    """Critique -> one refinement per response -> one refinement replaces slot 0, fully off-policy (sampling stage)."""

    name = "critique_grpo"
    image_inputs = IMAGES_GENERATION_SERVICE
    multi_turn = EDITS_COMPLETIONS
    version = "0.1.0"
    paper = "Critique-GRPO: Advancing LLM Reasoning with Natural Language and Numerical Feedback, arXiv:2506.03106"
    summary = "Responses get critiques, the policy refines them; one refinement per group replaces slot 0 off-policy."
    Options = CritiqueGrpoOptions
    official = OfficialSource(
        "zhangxy-2019/critique-GRPO", "e8f03a2", verdict="faithful",
        files=(
            "verl/verl/critique_grpo/critique_core_algos.py",
            "verl/verl/critique_grpo/critique_vllm_rollout_spmd.py",
        ),
        variants=("require_success",),
    )
    claim_metric = ("refinement_success_rate", "refinement success rate")
    replaces = ("one completion per group (slot 0: a refinement, off-policy)",)
    reconstructed = (
        "the wording of the refinement request and of the 'text' critic prompt (the official prompts are not copied)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.critic = None

    def required_columns(self) -> list[str]:
        o = self.options
        cols = [o.answer_column] if o.critique_type in ("simple_gt", "text") else []
        if o.critique_type == "text":
            cols.append(o.solution_column)
        return cols

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        o.check_gamma(self.name, args)
        if o.critique_type in ("simple_gt", "text"):
            check_column_filled(self.name, getattr(trainer, "train_dataset", None), o.answer_column,
                                f"critique_type={o.critique_type!r} states the ground truth in every critique")
        scale = getattr(args, "scale_rewards", "group")
        if scale not in ("none", False):
            warnings.warn(
                f"critique_grpo: the official recipe mean-centres advantages without std scaling; scale_rewards="
                f"{scale!r} divides by the group std. Set scale_rewards='none' to match it.",
                stacklevel=2,
            )
        if o.critique_type == "text" and self.critic is None:
            self.critic = shared_teacher(o.critic, **o.endpoint_kwargs("critic"), max_tokens=o.critic_max_tokens)

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        if o.warming_up(ctx.step):
            return
        G, B = ctx.num_generations, len(ctx)
        device = context_device(ctx)
        initial = ctx.reward_columns(range(B)).verifier(o.success_rule).float().cpu()  # (B,) verifier, NaN = failed
        correct = (initial > o.success_threshold).tolist()
        rows = [i for i in range(B) if o.refine == "all" or not correct[i]]
        texts = [completion_text(ctx.completions[i]) for i in rows]
        # collective: a critic failure on one process (endpoint down, timeout) stops every process together
        critiques = run_together(ctx, self.name, self._critiques, ctx, rows, texts, [correct[i] for i in rows])
        prompts = [
            refinement_prompt(ctx.prompts[i], text, critique, o.refinement_template, o.refinement_system_prompt)
            for i, text, critique in zip(rows, texts, critiques)
        ]
        refinements = ctx.service.generate(prompts=prompts)  # collective: one call per batch on every process
        local = torch.full((B, 2), math.nan)
        local[:, 0] = initial
        if rows:
            decoded = [ctx.decode(r.completion_ids, i) for i, r in zip(rows, refinements)]
            # NaN in column 1 means "not refined": a verifier None is -inf (never a success, never the best)
            local[rows, 1] = ctx.reward_columns(rows, decoded).verifier(o.success_rule, missing=-math.inf).float().cpu()
        by_row = {i: r.completion_ids for i, r in zip(rows, refinements)}
        scores = ctx.gather(local.to(device)).cpu()  # (N, 2): initial, refinement
        ids = gather_id_lists(ctx, [by_row.get(i, []) for i in range(B)])
        slot = min(o.replace_index, G - 1)
        replaced, replaced_ok = 0, 0
        for g in range(scores.size(0) // G):
            group = scores[g * G:(g + 1) * G, 1].tolist()
            j = pick_refinement(group, o.success_threshold)
            if j is None:
                continue
            ok = group[j] > o.success_threshold
            if (o.require_success and not ok) or not ids[g * G + j]:
                continue
            replaced += 1
            replaced_ok += int(ok)
            target = g * G + slot
            for i in range(B):
                if ctx.global_index[i] == target:
                    ctx.replace_row(i, ids[g * G + j], offpolicy=True, prompt_swapped=True)
                    ctx.annotations[i].update(critique_refined=True, critique_source=j)
        n_groups = scores.size(0) // G
        refined = scores[:, 1][~torch.isnan(scores[:, 1])]
        ctx.log_metric("initial_success_rate", (scores[:, 0] > o.success_threshold).float().mean().item())
        if refined.numel():
            ctx.log_metric("refinement_success_rate", (refined > o.success_threshold).float().mean().item())
        ctx.log_metric("replaced_group_fraction", replaced / max(n_groups, 1))
        ctx.log_metric("replaced_with_success_fraction", replaced_ok / max(n_groups, 1))

    def _critiques(self, ctx: RolloutContext, rows: list[int], texts: list[str], correct: list[bool]) -> list[str]:
        o = self.options
        if o.critique_type == "simple":
            return [simple_critique(ok) for ok in correct]
        truths = [ctx.rows[i].get(o.answer_column) for i in rows]
        out = [simple_critique(ok, gt) for ok, gt in zip(correct, truths)]
        if o.critique_type == "simple_gt":
            return out
        wrong = [k for k, ok in enumerate(correct) if not ok]  # 'text': the critic only sees incorrect responses
        if wrong:
            if self.critic is None:
                raise PluginConfigError("critique_grpo: critique_type='text' but no critic was configured.")
            conversations = [
                [{"role": "system", "content": CRITIC_SYSTEM}, {"role": "user", "content": (
                    f"## Question\n{question_text(ctx.prompts[rows[k]])}\n\n## Student solution\n{texts[k]}\n\n"
                    f"## Reference solution\n{ctx.rows[rows[k]].get(o.solution_column)}")}]
                for k in wrong
            ]
            for k, text in zip(wrong, self.critic.chat(conversations)):
                out[k] = text
        return out
