"""LUFFY — learning to reason under off-policy guidance (arXiv:2504.14945).

Each group of G rows mixes ``num_demonstrations`` off-policy demonstrations (an expert's full solution) with
G - num_demonstrations rollouts of the policy. The demonstrations are trained through the framework's shaped
off-policy branch, **policy shaping**: on a demonstration token the objective is ``-A f(p)`` with
``f(p) = p / (p + gamma)``, p = pi_theta(token), no importance ratio and no clip, which boosts the gradient of
low-probability expert tokens (weight ``gamma p / (p + gamma)^2`` on grad log p). Policy tokens keep the run's own
surrogate. Advantages are group-relative over the **whole mixed group** (the demonstration is scored by the reward
functions like any rollout), so a correct demonstration in a group of failures gets a large positive advantage.

Facts from the official code (``ElliottYan/LUFFY``, ``exp_scripts/train.sh`` and ``luffy/verl/verl/mix_src``):

* one demonstration per group of 8 (``n_prefix=1``), the whole trace (prefix ratio 1.0), the dataset's target
  solution (DeepSeek-R1 traces from OpenR1-Math) followed by EOS, in the first slot(s) of the group;
* the loader (``rl_dataset_with_target.py:129-130``) drops a demonstration's leading ``"<think>\\n"`` when the
  prompt already ends with ``"<think>\\n"`` (``strip_think_prefix``, default true; false keeps the text as written);
* ``off_policy_reshape="p_div_p_0.1"``: f(p) = p / (p + 0.1) on demonstration tokens, no clip on them;
* advantage estimator ``grpo`` with ``grpo_use_std=False``: reward minus the mean over all G rows (the demonstration
  included), no std scaling -- TRL's ``scale_rewards="none"``; the code's alternative ``grpo_split`` (mean and std over
  the on-policy rows only) is ``advantage_baseline="on_policy"`` here;
* on-policy clip removed (``loss_remove_clip=True``), sum over tokens / response length
  (``loss_remove_token_mean=True``, TRL's ``loss_type="dr_grpo"``), entropy bonus 0.001 (TRL's ``entropy_coef``), no KL,
  temperature 1.0. These are GRPOConfig settings left to the user (a warning names ``scale_rewards``); with
  ``num_iterations=1`` and ``steps_per_generation`` equal to the gradient-accumulation steps the on-policy ratio is 1,
  so TRL's clip never acts.

Rollout budget: the demonstration slots are left out of the policy's generation round (``PromptContext.defer``), so a
step costs exactly G - num_demonstrations policy rollouts per group (the official code samples all G and discards the
slot's sample). Demonstrations are counted separately as teacher rollouts (metric ``teacher_rollouts``).

Sources (``source``): the dataset column ``demonstration_column`` (official; a string, or a list of strings whose k-th
entry fills the k-th demonstration slot), or a ``teacher`` model (an endpoint or a local model, answering the prompt;
our option, for datasets without solutions). Metrics: ``teacher_rollouts`` (demonstrations in the generation batch,
all processes), ``demonstration_tokens`` (mean length), ``demonstration_truncated_fraction`` (demonstrations cut at
``max_completion_length``: they lose their EOS and, often, their final answer) and ``demonstration_advantage`` (the
mean advantage of the demonstration rows, under either baseline).

Stacking: put ``luffy`` before other sampling plugins that inspect the group (they then see the demonstrations).
Loss-stage plugins that replace the surrogate leave off-policy tokens to the shaped branch (``lp_reg``) or skip
them (``clip_cov``, ``kl_cov``). Not implemented: the official code's partial-trace prefixes (``prefix_ratio < 1``,
the policy continuing after a demonstration prefix) and its SFT-loss ablation.

Official code checked against: ``ElliottYan/LUFFY@01f4ae0`` (faithful with documented options; the files and the
deviating options: ``trl-plugins show luffy``, docs/faithfulness.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PromptContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.engines import trainer_device
from trl_plugins.api.collectives import run_together
from trl_plugins.api.data_checks import check_column_filled
from trl_plugins.api.option_groups import OffPolicyOptions
from trl_plugins.api.reasons import edits_completions
from trl_plugins.api.reasons import IMAGES_DEFERRED_ROWS
from trl_plugins.components.teacher import TeacherOptions, teacher_from_options

from .rl_plus import prompt_text, strip_think_prefix

#: Annotation of the rows holding a demonstration.
DEMONSTRATION = "luffy_demonstration"


@dataclass
class LuffyOptions(TeacherOptions, OffPolicyOptions):
    plugin_name: ClassVar[str] = "luffy"

    num_demonstrations: int = option(
        1, min=0, help="Demonstrations per group, in its first slots (official n_prefix=1 of G=8); 0 = plain GRPO."
    )
    source: Literal["column", "teacher"] = option(
        "column", help="Where demonstrations come from: the dataset column demonstration_column (official), or the "
        "teacher model's answer to the prompt (teacher_* options).",
    )
    demonstration_column: str = option(
        "solution", help="Dataset column with the demonstration: a string, or a list of strings (one per slot, "
        "cycled); the official data's column is the R1 trace ('target').",
    )
    advantage_baseline: Literal["all", "on_policy"] = option(
        "all", help="Group baseline: mean over all G rows, demonstrations included (official 'grpo'), or over the "
        "policy rollouts only (official 'grpo_split'; std from them too when scale_rewards divides by it).",
    )
    append_eos: bool = option(True, help="End each demonstration with the EOS token (official).")
    strip_think_prefix: bool = option(
        True, help="Drop a leading '<think>\\n' from the demonstration when the training prompt ends with one "
        "(official loader); false: the demonstration as written."
    )

    def validate(self) -> None:
        if self.source == "teacher":
            super().validate()


# ============================================================================================= pure functions
def demonstration_text(value: Any, slot: int) -> str | None:
    """The demonstration of slot ``slot`` from a column value: the string itself, or entry ``slot mod len`` of a list
    of strings; None when there is none (blank)."""
    if isinstance(value, (list, tuple)):
        value = value[slot % len(value)] if value else None
    return value if isinstance(value, str) and value.strip() else None


def split_group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, on_policy: torch.Tensor,
                           scale: bool, eps: float = 1e-6) -> torch.Tensor:
    """Official ``grpo_split``: A = r - mean over the group's on-policy rows (divided by their std when ``scale``;
    a zero std counts as 1, a group with one on-policy row has mean 0 and std 1).

    Args:
        rewards: (N,) combined rewards. group_ids: (N,) long. on_policy: (N,) bool.
    Returns:
        (N,) advantages.
    """
    out = torch.empty_like(rewards)
    for g in group_ids.unique().tolist():
        rows = group_ids == g
        scores = rewards[rows & on_policy]
        if scores.numel() > 1:
            mean, std = scores.mean(), scores.std()
            std = torch.ones_like(std) if std.item() == 0 else std
        else:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        out[rows] = (rewards[rows] - mean) / (std + eps) if scale else rewards[rows] - mean
    return out


# ============================================================================================= plugin
class LuffyPlugin(Plugin):
    """Demonstrations fill the first slots of each group; their tokens take the shaped off-policy branch."""
    claim_metric = ('demonstration_advantage', 'mean advantage of the demonstration rows')
    image_inputs = IMAGES_DEFERRED_ROWS
    multi_turn = edits_completions("demonstrations spliced into each group")

    name = "luffy"
    version = "0.1.1"
    paper = "LUFFY: Learning to Reason under Off-Policy Guidance, arXiv:2504.14945"
    summary = "Expert demonstrations fill part of each group, trained with policy shaping p/(p+gamma), no clip."
    Options = LuffyOptions
    official = OfficialSource(
        "ElliottYan/LUFFY", "01f4ae0", verdict="faithful",
        files=("luffy/verl/verl/mix_src/mix_core_alg.py",),
    )
    replaces = ("the first num_demonstrations completions of each group (demonstrations, off-policy)",)
    reconstructed = (
        "source='teacher' (a teacher model answering the prompt instead of the dataset's trace) is our option",
        "a list-valued demonstration column filling several slots is our convention",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.teacher = None
        self._scale = False

    def required_columns(self) -> list[str]:
        o = self.options
        return [o.demonstration_column] if o.source == "column" and o.num_demonstrations else []

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        o.check_gamma(self.name, args)
        G = args.num_generations
        if o.num_demonstrations >= G:
            raise PluginConfigError(
                f"luffy: num_demonstrations={o.num_demonstrations} leaves no policy rollout in a group of "
                f"num_generations={G}; allowed: 0 .. {G - 1}."
            )
        if not o.num_demonstrations:
            return
        if getattr(trainer, "rollout_func", None) is not None or getattr(trainer, "tools", None):
            raise PluginConfigError("luffy leaves the demonstration slots out of the generation round, which is not "
                                    "supported with rollout_func or tools.")
        if o.source == "column":
            check_column_filled(self.name, getattr(trainer, "train_dataset", None), o.demonstration_column,
                                "its text is the demonstration of every group")
        scale = getattr(args, "scale_rewards", "group")
        self._scale = scale not in ("none", False)
        if self._scale:
            warnings.warn(
                f"luffy: the official recipe centres advantages without std scaling (grpo_use_std=False); "
                f"scale_rewards={scale!r} divides by the group std. Set scale_rewards='none' to match it.",
                stacklevel=2,
            )
        if o.source == "teacher" and self.teacher is None:
            device = trainer_device(trainer)
            self.teacher = teacher_from_options(o, device)

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        k = self.options.num_demonstrations
        for i in ctx.defer_slots(lambda slot: slot < k):
            ctx.annotations[i][DEMONSTRATION] = True

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        if not o.num_demonstrations:
            return
        rows = [i for i in range(len(ctx)) if ctx.annotations[i].get(DEMONSTRATION)]
        texts = run_together(ctx, self.name, self._demonstrations, ctx, rows)  # a teacher fault stops every process
        tok = ctx.tokenizer
        limit = ctx.run.max_completion_length or None
        eos = [tok.eos_token_id] if o.append_eos else []
        lengths, truncated = [], []
        for i, text in zip(rows, texts):
            if o.strip_think_prefix:
                text = strip_think_prefix(text, prompt_text(ctx, i))
            ids = list(tok(text, add_special_tokens=False)["input_ids"]) + eos
            truncated.append(float(limit is not None and len(ids) > limit))
            ids = ids[:limit] if limit else ids
            ctx.replace_row(i, ids, offpolicy=True)
            lengths.append(len(ids))
        counts = ctx.gather(torch.tensor([float(len(rows)), float(sum(lengths)), float(sum(truncated))],
                                         device=ctx.device)).view(-1, 3).sum(0).tolist()
        ctx.log_metric("teacher_rollouts", counts[0])
        if counts[0]:
            ctx.log_metric("demonstration_tokens", counts[1] / counts[0])
            ctx.log_metric("demonstration_truncated_fraction", counts[2] / counts[0])

    def _demonstrations(self, ctx: RolloutContext, rows: list[int]) -> list[str]:
        """One demonstration text per local row in ``rows`` (column, or the teacher's answers)."""
        o = self.options
        if o.source == "teacher":
            prompts = [ctx.prompts[i] for i in rows]
            conversations = [[{"role": "user", "content": p}] if isinstance(p, str) else list(p) for p in prompts]
            return self.teacher.chat(conversations) if rows else []
        out = []
        for i in rows:
            text = demonstration_text(ctx.rows[i].get(o.demonstration_column), ctx.index_in_group[i])
            if text is None:
                raise PluginConfigError(
                    f"luffy: row {ctx.global_index[i]} has no demonstration in column {o.demonstration_column!r} "
                    f"(value {ctx.rows[i].get(o.demonstration_column)!r})."
                )
            out.append(text)
        return out

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if not o.num_demonstrations:
            return
        demo = torch.tensor([bool(a.get(DEMONSTRATION)) for a in ctx.annotations], device=ctx.rewards.device)
        if not demo.any():  # evaluation batches hold no demonstration
            return
        if o.advantage_baseline == "on_policy":
            rewards = torch.nan_to_num(ctx.rewards, nan=0.0)
            ctx.advantages = split_group_advantages(rewards, ctx.group_ids, ~demo, self._scale)
        ctx.log_metric("demonstration_advantage", ctx.advantages[demo].mean().item())
