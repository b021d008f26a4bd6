"""KEPO — knowledge-enhanced preference optimization (arXiv:2602.00400).

Two mechanisms on top of GRPO, as the paper's abstract states them (no official code is public; every detail below
beyond these two sentences is a **reconstruction**, exposed as an option with our default):

1. **Quality-gated on-policy distillation.** Dense token-level supervision from a teacher model, applied only to
   high-quality trajectories: the rollouts that succeed (verifier column above ``success_threshold``). Their tokens are
   scored by the teacher (the framework's teacher log-prob channel: ``AdvantageContext.attach_teacher_logps`` at the
   advantage stage, ``LossContext.teacher_logps`` (B, T) at the loss stage, NaN on rows outside the gate). With
   ``distill="advantage"`` the token advantage of a gated row becomes::

       A[b, t] = lam * A_GRPO[b] + (1 - lam) * A_teacher[b, t],   A_teacher[b, t] = log pi_T(y_t) - log pi_old(y_t)

   (``A_teacher`` is the per-token negative reverse KL, the on-policy-distillation signal; other rows keep
   ``A_GRPO``). With ``distill="kl_penalty"`` a per-token term ``kl_coef * KL_k3(pi_theta || pi_T)`` is added on the
   gated tokens instead (TRL's k3 estimator, as for its reference KL).
2. **Knowledge-enhanced exploration.** On hard prompts -- groups in which every rollout fails -- a teacher hint is
   added to the prompt, each failed rollout is re-sampled once by the policy under the hinted prompt (the trainer's
   generation service, counted in the rollout budget), and the reward-positive samples replace their rows (rejection
   sampling). They are trained under the **original** prompt (prompt swap: NaN sampling log-probs) and, by default,
   through the shaped off-policy branch ``-A p/(p+gamma)`` (they were sampled under another prompt).

Neutral setting: ``lam=1`` (or ``distill="none"``) and ``hints="none"`` is plain GRPO. The teacher must share the
policy's tokenizer (refused at construction otherwise); a teacher endpoint is probed at construction
(``teacher_probe``) and, when it dies later, retried with backoff before every process stops with its URL in the
error. Metrics: ``gated_fraction`` (rows scored by the teacher), ``teacher_advantage`` (mean ``A_teacher`` on gated
tokens), ``teacher_kl`` (k3 on gated tokens), ``hard_group_fraction``, ``hinted_success_rate``, ``hinted_rows``.

Stacking: put ``kepo`` after sampling plugins that fill rows (``luffy``'s demonstrations), so that a group counts as
all-fail on its final rows. The teacher log-probs are raw (temperature 1); the policy's are TRL's temperature-scaled
ones, so ``A_teacher`` is exact at ``temperature=1.0``.

No official code was reachable, so the method is reconstructed from its paper; the two
mechanisms of the abstract match; the loss weights, the gate and the hint protocol are reconstructed (``trl-plugins show
kepo``, docs/faithfulness.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.engines import trainer_device
from trl_plugins.api.collectives import gather_floats, run_together
from trl_plugins.api.data_checks import check_column_filled
from trl_plugins.api.option_groups import OffPolicyOptions
from trl_plugins.api.reasons import edits_completions
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.text import check_template
from trl_plugins.api.reasons import IMAGES_TEXT_TEACHER
from trl_plugins.components.steps import question_text
from trl_plugins.components.teacher import TeacherOptions, teacher_from_options

HINT_REQUEST = (
    "A student could not solve the following problem. Write one short hint that points to the key idea or the first "
    "step, without giving the final answer.\n\nProblem:\n{question}"
)
HINT_TEMPLATE = "{question}\n\nHint: {hint}"
#: Annotation of rows replaced by a hinted re-sample.
HINTED = "kepo_hinted"


@dataclass
class KepoOptions(TeacherOptions, OffPolicyOptions, SuccessOptions):
    plugin_name: ClassVar[str] = "kepo"

    distill: Literal["advantage", "kl_penalty", "none"] = option(
        "advantage", reconstructed=True,
        help="Dense teacher supervision on gated rows: mix the teacher's per-token advantage into A (lam), add a "
        "k3 KL(pi || teacher) term (kl_coef), or none.",
    )
    lam: float = option(
        0.5, min=0.0, max=1.0, reconstructed=True,
        help="distill='advantage': A = lam * A_GRPO + (1 - lam) * A_teacher on gated rows (1 = no distillation).",
    )
    kl_coef: float = option(0.1, min=0.0, reconstructed=True, help="distill='kl_penalty': weight of the KL term.")
    success_threshold: float = option(
        0.5, reconstructed=True,
        help="Quality gate and hard-prompt test: a rollout is high-quality when its verifier column (success_column) "
        "is above this value.",
    )
    hints: Literal["teacher", "column", "none"] = option(
        "teacher", reconstructed=True,
        help="Hints for all-fail groups: written by the teacher (hint_request), read from hint_column, or none "
        "(no re-sampling).",
    )
    hint_column: str = option("hint", help="hints='column': dataset column holding the hint text.")
    hint_request: str = option(HINT_REQUEST, reconstructed=True,
                               help="hints='teacher': what the teacher is asked; must contain {question}.")
    hint_template: str = option(HINT_TEMPLATE, reconstructed=True,
                                help="How the hint joins the question; must contain {question} and {hint}.")
    hinted_offpolicy: bool = option(
        True, reconstructed=True,
        help="Train accepted hinted samples through the shaped off-policy branch (True) or the plain surrogate.",
    )

    @property
    def needs_teacher(self) -> bool:
        return self.distilling or self.hints == "teacher"

    @property
    def distilling(self) -> bool:
        return self.distill == "kl_penalty" or (self.distill == "advantage" and self.lam < 1.0)

    def validate(self) -> None:
        if self.needs_teacher:
            TeacherOptions.validate(self)
        check_template("kepo", "hint_request", self.hint_request, ("question",))
        check_template("kepo", "hint_template", self.hint_template, ("question", "hint"))


# ============================================================================================= pure functions
def mixed_advantages(advantages: torch.Tensor, teacher_logps: torch.Tensor, old_logps: torch.Tensor,
                     mask: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KEPO's advantage mixing on the tokens the teacher scored.

    Args:
        advantages: (B, T) token advantages (A_GRPO broadcast along each row).
        teacher_logps: (B, T) log pi_T of the completion tokens, NaN where absent.
        old_logps: (B, T) log pi_old of the same tokens (no grad).
        mask: (B, T) loss mask.
    Returns:
        ``(A, present)``: (B, T) ``lam * A + (1 - lam) * (teacher_logps - old_logps)`` where the teacher scored an
        unmasked token, ``A`` elsewhere; (B, T) bool of those tokens.
    """
    present = ~torch.isnan(teacher_logps) & mask.bool()
    teacher_advantage = torch.nan_to_num(teacher_logps, nan=0.0) - old_logps.detach()
    mixed = lam * advantages + (1.0 - lam) * teacher_advantage
    return torch.where(present, mixed, advantages), present


def teacher_kl_k3(logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_T) on sampled tokens, ``exp(d) - d - 1`` with
    ``d = log pi_T - log pi_theta`` (grad through ``logps``); 0 where ``teacher_logps`` is NaN. (B, T)."""
    d = torch.nan_to_num(teacher_logps, nan=0.0) - logps
    kl = torch.exp(d) - d - 1
    return torch.where(torch.isnan(teacher_logps), torch.zeros_like(kl), kl)


def with_hint(prompt: Any, hint: str, template: str) -> Any:
    """The prompt with ``hint`` joined to its question (the last user message of a conversation, or the text)."""
    if isinstance(prompt, str):
        return template.format(question=prompt, hint=hint)
    messages = copy.deepcopy(list(prompt))
    for message in reversed(messages):
        if message.get("role") == "user":
            message["content"] = template.format(question=message["content"], hint=hint)
            return messages
    raise PluginConfigError("kepo: the prompt has no user message to attach the hint to.")


def all_fail_groups(success: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N // G,) bool: groups in which no rollout succeeds, from the (N,) gathered success flags."""
    return ~success.view(-1, num_generations).bool().any(dim=1)


# ============================================================================================= plugin
class KepoPlugin(Plugin):
    """Quality-gated teacher distillation (advantage / loss stages) and teacher hints for all-fail groups (sampling)."""
    claim_metric = ('gated_fraction', 'rollouts that pass the quality gate and get teacher supervision')
    image_inputs = IMAGES_TEXT_TEACHER
    multi_turn = edits_completions("teacher-hinted re-samples replacing failed rows")

    name = "kepo"
    version = "0.1.0"
    paper = "KEPO: Knowledge-Enhanced Preference Optimization, arXiv:2602.00400"
    summary = ("Teacher per-token supervision on successful rollouts only, and teacher-hinted rejection sampling "
               "for all-fail groups.")
    Options = KepoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; the two mechanisms of the abstract match; the loss weights, the gate and the "
        "hint protocol are reconstructed.",
    )
    replaces = ("failed rows of all-fail groups (by reward-positive hinted re-samples, trained under the original "
                "prompt)",)
    reconstructed = (
        "everything beyond the abstract: the gate (verifier success), the teacher signal (per-token log-ratio "
        "A_teacher, or a k3 KL term), lam, kl_coef, the hint request and template, one hinted re-sample per failed "
        "row, off-policy shaping of accepted hinted samples",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.teacher = None

    def required_columns(self) -> list[str]:
        return [self.options.hint_column] if self.options.hints == "column" else []

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        o.check_gamma(self.name, args)
        if o.hints == "column":
            check_column_filled(self.name, getattr(trainer, "train_dataset", None), o.hint_column,
                                "its text is the hint of an all-fail group")
        if not o.needs_teacher or self.teacher is not None:
            return
        self.teacher = teacher_from_options(o, trainer_device(trainer))
        if o.distilling:
            processing = getattr(trainer, "processing_class", None)
            tokenizer = getattr(processing, "tokenizer", processing)
            if tokenizer is None:
                raise PluginConfigError("kepo: the trainer has no tokenizer to check the teacher's against.")
            self.teacher.check_logprobs(tokenizer, probe=o.teacher_probe)

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        if o.hints == "none":
            return
        G, B = ctx.num_generations, len(ctx)
        success = ctx.success(range(B), rule=o.success_rule)
        hard = all_fail_groups(gather_floats(ctx, success.float().tolist()) > 0, G)  # groups straddle processes
        rows = [i for i in range(B) if bool(hard[ctx.group_ids[i]])]
        hints = run_together(ctx, self.name, self._hints, ctx, rows)  # a teacher fault stops every process together
        prompts = [with_hint(ctx.prompts[i], h, o.hint_template) for i, h in zip(rows, hints)]
        samples = ctx.service.generate(prompts=prompts)  # collective: one call per batch on every process
        decoded = [ctx.decode(s.completion_ids, i) for i, s in zip(rows, samples)]
        accepted = ctx.success(rows, decoded, rule=o.success_rule).tolist() if rows else []
        for i, sample, ok in zip(rows, samples, accepted):
            if ok and sample.completion_ids:
                ctx.replace_row(i, sample.completion_ids, offpolicy=o.hinted_offpolicy, logprobs=sample.logprobs,
                                prompt_swapped=True)
                ctx.annotations[i][HINTED] = True
        counts = ctx.gather(torch.tensor([float(len(rows)), float(sum(accepted))], device=ctx.device)).view(-1, 2)
        tried, kept = counts.sum(0).tolist()
        ctx.log_metric("hard_group_fraction", hard.float().mean().item())
        ctx.log_metric("hinted_rows", kept)
        if tried:
            ctx.log_metric("hinted_success_rate", kept / tried)

    def _hints(self, ctx: RolloutContext, rows: list[int]) -> list[str]:
        """One hint per local row in ``rows``: the column's, or the teacher's (asked once per local group)."""
        o = self.options
        if o.hints == "column":
            out = []
            for i in rows:
                hint = ctx.rows[i].get(o.hint_column)
                if not isinstance(hint, str) or not hint.strip():
                    raise PluginConfigError(f"kepo: row {ctx.global_index[i]} has no hint in column "
                                            f"{o.hint_column!r} (value {hint!r}).")
                out.append(hint)
            return out
        firsts = {}
        for i in rows:
            firsts.setdefault(ctx.group_ids[i], i)
        requests = [[{"role": "user", "content": o.hint_request.format(question=question_text(ctx.prompts[i]))}]
                    for i in firsts.values()]
        answers = dict(zip(firsts, self.teacher.chat(requests))) if requests else {}
        return [answers[ctx.group_ids[i]].strip() for i in rows]

    # ------------------------------------------------------------------------------------------ advantage
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if not o.distilling or ctx.mode != "train":
            return
        gate = ctx.success(o.success_rule)[ctx.process_slice]
        rows = torch.nonzero(gate).flatten().tolist()
        ctx.attach_teacher_logps(self.teacher, rows)  # collective: every process, possibly with no rows
        ctx.log_metric("gated_fraction", ctx.success(o.success_rule).float().mean().item())

    # ------------------------------------------------------------------------------------------ loss
    @hookimpl
    def trl_plugins_loss_advantages(self, ctx: LossContext):
        o = self.options
        teacher = ctx.teacher_logps
        if o.distill != "advantage" or o.lam >= 1.0 or teacher is None:
            return
        ctx.advantages, present = mixed_advantages(ctx.advantages, teacher, ctx.old_per_token_logps, ctx.mask, o.lam)
        teacher_advantage = torch.nan_to_num(teacher, nan=0.0) - ctx.old_per_token_logps
        ctx.log_metric("teacher_advantage", ctx.global_masked_mean(teacher_advantage, present.float()))

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        teacher = ctx.teacher_logps
        if o.distill != "kl_penalty" or teacher is None:
            return
        present = ~torch.isnan(teacher) & ctx.mask.bool()
        kl = teacher_kl_k3(ctx.per_token_logps, torch.where(present, teacher, torch.full_like(teacher, float("nan"))))
        ctx.add_token_loss(o.kl_coef * kl)
        ctx.log_metric("teacher_kl", ctx.global_masked_mean(kl.detach(), present.float()))
