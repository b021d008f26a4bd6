"""RL-PLUS — hybrid-policy optimisation with external demonstrations (arXiv:2508.00222, "RL-PLUS: Countering
Capability Boundary Collapse of LLMs in Reinforcement Learning with Hybrid-policy Optimization").

Pure on-policy RLVR narrows what a model can solve (its pass@k boundary shrinks). RL-PLUS mixes **external
demonstrations** into every group and trains on them with two corrections. Facts from the official code
(``YihongDong/RL-PLUS``: ``rl_plus/verl/verl/recipe/rlplus_core_alg.py``, ``rlplus_vllm_rollout.py``,
``exp_scripts/train_RL-PLUS.sh``):

1. Groups (sampling stage): ``G`` rollouts per prompt (8), of which ``num_demonstrations`` (``n_prefix=1``) are the
   dataset's demonstration in full (prefix ratio 1.0), placed in the first slots of the group and followed by EOS,
   truncated to ``max_completion_length``. The demonstration follows the original prompt; its tokens are off-policy
   (NaN sampling log-probs, never masked by TRL's off-policy mask). As the official loader does
   (``rl_dataset_with_target.py:129-130``), a demonstration starting with ``"<think>\\n"`` loses it when the training
   prompt (as tokenized) already ends with ``"<think>\\n"`` (``strip_think_prefix``; false keeps the text as written).
2. Advantage: ``A = r - mean`` over the whole group, demonstration included, without std scaling
   (``grpo_use_std=False``): set ``scale_rewards="none"`` (warned otherwise).
3. **Multiple Importance Sampling** on demonstration tokens, with the unknown demonstrator's probability estimated
   as ``omega = (p_old + 1) / 2`` and the balance-heuristic mixture of the old policy and it::

       r_MIS = p_theta / (0.5 p_old + 0.5 omega) = p_theta / (0.75 p_old + 0.25)

   bounded by 4 and never exploding when the policy finds a demonstration token unlikely (``off_policy_weight``:
   ``"mis"``; ``"none"`` is the official ``no_reshape`` strategy, ``-A p_theta`` with no exploration term either,
   ``YihongDong/RL-PLUS@eb4aa4d rl_plus/verl/verl/recipe/rlplus_core_alg.py:168-169``; ``"none_eba"``, our variant,
   keeps the exploration term on ``p_theta``).
4. **Exploration-Based Advantage** on demonstration tokens: ``A_t = A * (1 - sg(p_theta))^eta`` (``eta = 0.5`` in
   the official code), so correct tokens the policy finds unlikely -- the paths it would not explore -- weigh most.
   Official with ``"mis"`` only (``"none"`` drops it, ``"none_eba"`` keeps it).
5. Demonstration-token loss ``-r_MIS * A_t`` (no clip); every other token keeps the run's surrogate. The official
   recipe also removes the clip on policy tokens (``loss_remove_clip``), sums tokens over the longest length
   (``loss_type="dr_grpo"``), uses entropy bonus 0.001 and no KL; those are GRPOConfig settings left to the user.

Any other off-policy token of the batch (from a stacked sampling plugin) takes the same demonstration loss. The
neutral setting ``num_demonstrations=0`` injects nothing, so no token is off-policy and the run is TRL's.
Metrics: ``demonstration_rows`` (demonstrations injected on this process, counted apart from policy rollouts),
``demonstration_success_rate``, ``mis_ratio_mean`` and ``exploration_weight_mean`` on demonstration tokens.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import LossContext, OfficialSource, Plugin, PluginConfigError, RolloutContext, hookimpl, option
from trl_plugins.api.data_checks import check_column_filled
from trl_plugins.api.reasons import edits_completions
from trl_plugins.api.success import SuccessOptions


@dataclass
class RlPlusOptions(SuccessOptions):
    demonstration_column: str = option(
        "solution", help="Dataset column holding the demonstration text (official data: the teacher trace)."
    )
    num_demonstrations: int = option(
        1, min=0, help="Group slots (the first ones) filled with the demonstration (official n_prefix = 1; 0 = off)."
    )
    off_policy_weight: Literal["mis", "none", "none_eba"] = option(
        "mis", help="Weight of demonstration tokens: the MIS ratio p / (0.75 p_old + 0.25) with the exploration term "
        "(official 'RL-PLUS'); 'none': p itself without the exploration term (official 'no_reshape'); 'none_eba': p "
        "with the exploration term (not in the official code)."
    )
    strip_think_prefix: bool = option(
        True, help="Drop a leading '<think>\\n' from the demonstration when the training prompt ends with one "
        "(official loader); false: the demonstration as written."
    )
    eba_exponent: float = option(
        0.5, min=0.0, help="eta of the Exploration-Based Advantage A (1 - sg(p))^eta on demonstration tokens "
        "(official code 0.5; 0 turns it off)."
    )


# ============================================================================================= pure functions
def mis_ratio(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor) -> torch.Tensor:
    """RL-PLUS's multiple-importance-sampling ratio ``p / (0.5 p_old + 0.5 omega)``, ``omega = (p_old + 1) / 2``.

    Args:
        per_token_logps: (B, T) log p_theta, with grad.
        old_per_token_logps: (B, T) log p_old (no grad).
    Returns:
        (B, T), in ``[0, 4]``.
    """
    p_old = old_per_token_logps.detach().exp()
    omega = 0.5 * (p_old + 1.0)
    return per_token_logps.exp() / (0.5 * p_old + 0.5 * omega)


def exploration_weight(per_token_logps: torch.Tensor, exponent: float) -> torch.Tensor:
    """The Exploration-Based Advantage's factor ``(1 - sg(p))^exponent``, (B, T), no grad."""
    return (1.0 - per_token_logps.detach().exp()).clamp(min=0.0).pow(exponent)


def demonstration_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    off_policy_weight: str = "mis",
    eba_exponent: float = 0.5,
) -> torch.Tensor:
    """Per-token loss of demonstration tokens: ``-w * A * (1 - sg(p))^eta`` with ``w`` = :func:`mis_ratio` ("mis") or
    ``p`` ("none_eba"); ``-p * A`` ("none", the official ``no_reshape``: no exploration term).

    Args:
        per_token_logps, old_per_token_logps: (B, T).
        advantages: (B, 1) or (B, T).
    Returns:
        (B, T).
    """
    if off_policy_weight == "mis":
        weight = mis_ratio(per_token_logps, old_per_token_logps)
    elif off_policy_weight == "none":
        return -per_token_logps.exp() * advantages
    elif off_policy_weight == "none_eba":
        weight = per_token_logps.exp()
    else:
        raise ValueError(f"off_policy_weight={off_policy_weight!r} is unknown; allowed: mis, none, none_eba.")
    return -weight * (advantages * exploration_weight(per_token_logps, eba_exponent))


def demonstration_ids(text: str, tokenizer: Any, max_length: int | None) -> list[int]:
    """A demonstration's completion token ids: the policy tokenizer's ids of ``text`` (no special tokens) plus EOS,
    cut to ``max_length`` tokens (None: no cut)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return ids[:max_length] if max_length else ids


THINK_PREFIX = "<think>\n"


def strip_think_prefix(text: str, prompt_text: str) -> str:
    """The official loader's rule: a demonstration starting with ``"<think>\\n"`` loses it when the prompt already
    ends with ``"<think>\\n"`` (the chat template opened the thinking block); otherwise ``text`` unchanged."""
    if prompt_text.endswith(THINK_PREFIX) and text.startswith(THINK_PREFIX):
        return text[len(THINK_PREFIX):]
    return text


def prompt_text(ctx: RolloutContext, i: int) -> str:
    """Row ``i``'s training prompt as the policy sees it (its token ids decoded, special tokens kept)."""
    return ctx.tokenizer.decode(list(ctx.prompt_ids[i]), skip_special_tokens=False)


def is_demonstration(value: Any) -> bool:
    """Whether a dataset value can be a demonstration (a non-blank string)."""
    return isinstance(value, str) and bool(value.strip())


# ============================================================================================= plugin
class RlPlusPlugin(Plugin):
    """Demonstrations in every group, trained with MIS and the Exploration-Based Advantage (sampling, loss)."""
    image_inputs = True
    multi_turn = edits_completions("demonstrations spliced into each group")
    claim_metric = ("demonstration_success_rate", "demonstrations that pass the verifier")

    name = "rl_plus"
    version = "0.1.0"
    paper = (
        "RL-PLUS: Countering Capability Boundary Collapse of LLMs in Reinforcement Learning with Hybrid-policy "
        "Optimization, arXiv:2508.00222"
    )
    summary = "Demonstrations replace group slots; MIS ratio and exploration-based advantage on their tokens."
    Options = RlPlusOptions
    official = OfficialSource(
        "YihongDong/RL-PLUS", "eb4aa4d", verdict="faithful",
        files=("rl_plus/verl/verl/recipe/rlplus_core_alg.py",),
        variants=("off_policy_weight",),
    )
    replaces_surrogate = True
    replaces = (
        "the first num_demonstrations completions of every group (the dataset's demonstration, off-policy)",
        "the base surrogate on off-policy tokens (-r_MIS A (1 - p)^eta instead of the shaped branch)",
    )

    def required_columns(self) -> list[str]:
        return [self.options.demonstration_column] if self.options.num_demonstrations else []

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if o.num_demonstrations >= args.num_generations:
            raise PluginConfigError(
                f"Option 'num_demonstrations' of plugin 'rl_plus' got {o.num_demonstrations}; allowed: 0 to "
                f"{args.num_generations - 1} (num_generations={args.num_generations}: a group needs a policy rollout)."
            )
        if o.num_demonstrations:
            check_column_filled(self.name, getattr(trainer, "train_dataset", None), o.demonstration_column,
                                "its text is the demonstration mixed into every group")
        scale = getattr(args, "scale_rewards", "group")
        if scale not in ("none", False):
            warnings.warn(
                f"rl_plus: the official advantage is r - group mean without std scaling; scale_rewards={scale!r} "
                "divides by the group std. Set scale_rewards='none' to match it.",
                stacklevel=2,
            )

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        rows = [i for i in range(len(ctx)) if ctx.index_in_group[i] < o.num_demonstrations]
        for i in rows:
            text = ctx.rows[i].get(o.demonstration_column)
            if not is_demonstration(text):
                raise PluginConfigError(
                    f"rl_plus: row {ctx.global_index[i]} has no demonstration in column {o.demonstration_column!r} "
                    f"(got {text!r}); a non-blank string is needed."
                )
            if o.strip_think_prefix:
                text = strip_think_prefix(text, prompt_text(ctx, i))
            ctx.replace_row(i, demonstration_ids(text, ctx.tokenizer, ctx.run.max_completion_length), offpolicy=True)
            ctx.annotations[i]["demonstration"] = True
        ctx.log_metric("demonstration_rows", len(rows))
        if rows:
            ctx.log_metric("demonstration_success_rate", ctx.success(rows, rule=o.success_rule).float().mean().item())

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        o = self.options
        off = ctx.offpolicy_mask.bool() & ctx.mask.bool()
        if bool(off.any()):
            values = demonstration_loss(ctx.per_token_logps, ctx.old_per_token_logps, ctx.advantages,
                                        off_policy_weight=o.off_policy_weight, eba_exponent=o.eba_exponent)
            ctx.replace_tokens(off, values)
        # the metrics reduce over processes: every process logs them, with or without demonstration tokens
        ratio = mis_ratio(ctx.per_token_logps.detach(), ctx.old_per_token_logps)
        ctx.log_metric("mis_ratio_mean", ctx.global_masked_mean(ratio, off.float()))
        ctx.log_metric("exploration_weight_mean",
                       ctx.global_masked_mean(exploration_weight(ctx.per_token_logps, o.eba_exponent), off.float()))
