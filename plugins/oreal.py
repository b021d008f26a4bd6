"""OREAL — Outcome REwArd-based reinforcement Learning (arXiv:2502.06781, "Exploring the Limit of Outcome Reward for
Learning Mathematical Reasoning").

Under binary outcome rewards, behaviour cloning on the positive samples of best-of-N sampling is enough to learn the
KL-regularised optimal policy; negative samples then need **reshaped** rewards so that their gradient is consistent
with the positives'. Defaults follow the released config without the token reward model; the with-token-RM configs
differ in three settings (filter, token reward model, actor freeze), each an option below.

Official code facts (``InternLM/OREAL@2859cc092ddfd7c530da183f6a667a94a6b36d37``; ``wo`` =
``oreal/configs/oreal_wo_tokenrm_OREAL-7B-SFT_seqlen16k.py``, ``w`` = ``oreal/configs/oreal_w_tokenrm_OREAL-7B-SFT_seqlen16k.py``
(the 32B and DeepSeek-R1-Distill ``w_tokenrm`` configs hold the same values), ``train`` = ``train_oreal.py``):

- rollouts per prompt 16 (``wo:38``, ``w:38``, ``prompt_repeat_k``);
- reward +1 correct, -1 otherwise (``oreal/judgers/math_judger.py:137``; a missing verdict is -1, ``train:550``);
- ``reward_shaping_type="rloo"`` in every config (``wo:62``); ``"grpo"`` z-scores with ``std + 1e-8`` (``train:561-565``);
- filter: ``filter_trajectory=False`` in ``wo:43`` (no filter, every rollout trained: ``train:388-391``), ``True`` in
  ``w:43`` with ``only_keep_1_pair`` defaulting to True (``oreal/datasets/trajectory.py:120``, ``:137-146``);
- ``positive_loss_factor=1.0``, ``negative_loss_factor=0.5``, ``pos_mult_adv=True`` (``wo:64-66``);
  positive / negative token counts split on ``judger_reward > 0`` (``train:619-622``, ``:805-823``);
- KL: ``kl_coef=0.01`` (``wo:67``), ``kl_type`` unset so ``"unbias"`` (k3) (``train:828-835``), on every row;
- token reward model: ``token_level_rm=None`` in ``wo:4``, the policy copy in ``w:4``; ``actor_freeze_steps`` 0
  (``wo:46``) / 10 (``w:46``); its lr 2e-6, weight decay 0.01, grad-norm clip 1 (``wo:49-52``); threshold rescale at
  0.5 / 0.5 (``wo:55-57``); topk ratios default 0.5 in ``train:792-793`` (a commented-out config line: 0.25).

1. Reward: ``correct_reward`` / ``incorrect_reward`` on the verifier column's verdict (see ``success_column``).
2. Advantage over the G rollouts of a prompt, before any filtering: RLOO, ``A_i = r_i - mean_{j != i} r_j``
   (``baseline="rloo"``), or ``(r - mean) / (std + 1e-8)`` ("grpo").
3. Filter: ``filter="none"`` (default, the ``wo`` config) trains every rollout -- all-correct and all-wrong groups
   have RLOO advantage 0 but their tokens still count in the normalisers below; ``"one_pair"`` (the ``w`` configs)
   drops uniform groups and keeps one random correct and one random wrong rollout of each mixed group; ``"all_mixed"``
   keeps every rollout of the mixed groups (``only_keep_1_pair=False``, in no released config).
4. Loss (per token, no clip)::

       positive rows:  -A * log pi_theta                 summed, / (positive tokens of the batch) * 1.0
       negative rows:  -A * pi_theta / sg(pi_old)        summed, / (negative tokens of the batch) * 0.5

   ``normalisation="official"`` reproduces the two token counts on top of TRL's ``loss_type="dapo"`` (which divides
   the batch's token sum by its token count): each row is scaled by ``tokens / positive tokens`` or
   ``tokens / negative tokens``. Dropped rows get weight 0.
5. KL to the reference: TRL's own k3 term -- set ``beta=0.01`` in the trainer arguments for the official value (TRL's
   default is 0, no KL); TRL also applies it to rows the filter dropped, which the official code leaves out of the
   batch.

6. Token-level reward model (``token_rm=true``; the ``w`` configs): a scalar head scores every completion token, is
   trained online on the kept rows by the binary cross-entropy of its sequence-mean score against the outcome (1
   correct, 0 wrong), and weights the tokens of the loss above: positive rows by ``rescale(p_t)``, negative rows by
   ``rescale(1 - p_t)``, ``p_t = sigmoid(cumulative mean of the scores up to t)``, ``rescale`` = ``threshold``
   (``clamp((p - 0.5) / 0.5, 0, 1)``, official) or ``topk``. Here the head is linear over the policy's detached last
   hidden states, with its own AdamW (official: a full copy of the policy with that head) [reconstructed]; its
   gradients are summed over processes before each optimizer step and its weights and optimizer state are saved in
   checkpoints. An untrained head gives ``p_t`` near 0.5, i.e. weights near 0 under ``threshold``: the ``w`` configs
   therefore freeze the policy for the first 10 steps while the head learns. To run the ``w`` recipe set
   ``token_rm=true, filter="one_pair", actor_freeze_steps=10``.

7. Actor freeze (``actor_freeze_steps``): the official trainer skips the actor's update during those steps
   (``train_oreal.py:426-430``). Here OREAL's loss is zeroed and, through a ``TrainerCallback.on_pre_optimizer_step``
   added at construction, the policy's gradients are set to None just before each frozen optimizer step, so the
   optimizer (PyTorch's, which skips parameters without a gradient) leaves the policy and its state untouched: no KL,
   entropy-bonus or weight-decay update and no Adam step count. Differences left: TRL's learning-rate schedule still
   advances during the freeze, and with DeepSpeed (which keeps its own gradients) only the loss is zeroed (warned at
   construction).

Not here: the official difficulty re-balancing of the prompt set.

Neutral setting: ``baseline="trl", positive_objective="policy_gradient", filter="none", normalisation="run"`` (and
``token_rm=false``, the default) trains
every row with ``-A pi/sg(pi_old)`` on TRL's advantages and aggregation -- TRL's surrogate whenever no token would be
clipped (the first pass over a batch). Metrics: ``kept_fraction``, ``positive_fraction`` (of kept rows),
``mixed_group_fraction``; with the token reward model ``token_rm_loss`` (mean cross-entropy of the micro-batch's
kept rows), ``token_rm_steps``, ``positive_token_weight`` / ``negative_token_weight`` (mean weight of the kept
positive / negative rows' tokens).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import TrainerCallback

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    hookimpl,
    option,
)
from trl_plugins.api.model_utils import unwrap_causal_lm
from trl_plugins.api.success import SuccessOptions

from ._oreal_token_rm import TokenRewardHead, oreal_token_weights, sequence_bce

POSITIVE_KEY = "oreal_positive"
SCALE_KEY = "oreal_row_scale"
KEEP_KEY = "oreal_keep"


@dataclass
class OrealOptions(SuccessOptions):
    correct_reward: float = option(1.0, help="Reward of a correct rollout (official judger: 1).")
    incorrect_reward: float = option(-1.0, help="Reward of a wrong rollout (official judger: -1).")
    baseline: Literal["rloo", "grpo", "trl"] = option(
        "rloo", help="Advantage: leave-one-out mean (official), group z-score, or TRL's own advantages (ablation)."
    )
    filter: Literal["none", "one_pair", "all_mixed"] = option(
        "none", help="Rows trained: every row (official wo_tokenrm config: filter_trajectory=False), one random "
        "correct + one random wrong per mixed group (official with-token-RM configs: filter_trajectory=True), or every "
        "row of mixed groups (only_keep_1_pair=False, in no released config)."
    )
    positive_objective: Literal["behaviour_cloning", "policy_gradient"] = option(
        "behaviour_cloning", help="Positive rows: -A log pi (official BC scaled by the advantage) or -A pi/sg(pi_old)."
    )
    positive_loss_factor: float = option(1.0, min=0.0, help="Factor of the positive loss (official 1.0).")
    negative_loss_factor: float = option(0.5, min=0.0, help="Factor of the negative loss (official 0.5).")
    normalisation: Literal["official", "run"] = option(
        "official", help="'official': positive and negative token sums each over their own token count (needs "
        "loss_type='dapo'); 'run': the run's loss_type aggregation, factors applied as is."
    )
    seed: int = option(0, help="filter='one_pair': seed of the random pair choice (with the step); also seeds the "
                       "token reward model's initial head.")
    token_rm: bool = option(
        False, help="Weight the loss's tokens by an online-trained token-level reward model (official OREAL-7B/32B "
        "configs: on, with filter='one_pair' and actor_freeze_steps=10; the wo_tokenrm config: off). Needs "
        "actor_freeze_steps of head training first."
    )
    token_rm_lr: float = option(
        1e-3, min=0.0, min_exclusive=True, reconstructed=True,
        help="token_rm: AdamW learning rate of the linear head (official 2e-6 for a full policy copy; a lone head "
        "on frozen features needs a larger one).",
    )
    token_rm_weight_decay: float = option(0.01, min=0.0, help="token_rm: AdamW weight decay (official 0.01).")
    token_rm_max_grad_norm: float = option(
        1.0, min=0.0, help="token_rm: gradient-norm clip of the head (official 1.0; 0 = none)."
    )
    token_rm_rescale: Literal["threshold", "topk"] = option(
        "threshold", help="token_rm: probability -> weight map: clamp((p - c) / (1 - c), 0, 1) (official) or the top "
        "share of each row's tokens, min-max normalised."
    )
    correct_threshold: float = option(
        0.5, min=0.0, max=1.0, help="token_rm, rescale='threshold': c of positive rows (official "
        "0.5)."
    )
    incorrect_threshold: float = option(
        0.5, min=0.0, max=1.0, help="token_rm, rescale='threshold': c of negative rows (official "
        "0.5)."
    )
    correct_topk_ratio: float = option(
        0.5, min=0.0, max=1.0, help="token_rm, rescale='topk': share of a positive row's tokens kept (official "
        "train_oreal.py default 0.5; a commented-out config line: 0.25)."
    )
    incorrect_topk_ratio: float = option(
        0.5, min=0.0, max=1.0, help="token_rm, rescale='topk': share of a negative row's tokens kept (official "
        "train_oreal.py default 0.5; a commented-out config line: 0.25)."
    )
    actor_freeze_steps: int = option(
        0, min=0, help="Optimizer steps at the start during which the policy is not updated (OREAL's loss zeroed and "
        "the policy's optimizer step skipped, as officially) while the token reward model trains (official: 0 in the "
        "wo_tokenrm config, 10 in the with-token-RM configs). The learning-rate schedule still advances."
    )

    def validate(self) -> None:
        for name in ("correct_threshold", "incorrect_threshold"):
            if getattr(self, name) >= 1.0:
                raise PluginConfigError(
                    f"Option {name!r} of plugin 'oreal' got {getattr(self, name)!r}; allowed: [0, 1) (the rescale "
                    "divides by 1 - threshold)."
                )


# ============================================================================================= pure functions
def oreal_rewards(success: torch.Tensor, correct: float = 1.0, incorrect: float = -1.0) -> torch.Tensor:
    """(N,) OREAL's binary rewards from the (N,) bool success mask."""
    return torch.where(success, torch.tensor(correct), torch.tensor(incorrect)).float()


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N,) ``r_i - mean of the other G-1 rewards of the group``."""
    r = rewards.view(-1, num_generations)
    return (r - (r.sum(-1, keepdim=True) - r) / (num_generations - 1)).view(-1)


def zscore_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N,) ``(r - mean) / (std + 1e-8)`` per group (unbiased std, as the official code)."""
    r = rewards.view(-1, num_generations)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-8)).view(-1)


def pair_filter(success: torch.Tensor, num_generations: int, mode: str, generator: torch.Generator) -> torch.Tensor:
    """(N,) bool keep mask of ``filter`` ``mode``: ``one_pair`` (one random correct and one random wrong row of each
    mixed group), ``all_mixed`` (every row of mixed groups), ``none`` (every row)."""
    s = success.view(-1, num_generations)
    if mode == "none":
        return torch.ones_like(success, dtype=torch.bool)
    mixed = s.any(-1) & ~s.all(-1)
    keep = mixed.unsqueeze(-1).expand_as(s).clone()
    if mode == "one_pair":
        keep[:] = False
        for g in torch.nonzero(mixed).flatten().tolist():
            for pool in (torch.nonzero(s[g]).flatten(), torch.nonzero(~s[g]).flatten()):
                keep[g, pool[torch.randint(pool.numel(), (1,), generator=generator)]] = True
    elif mode != "all_mixed":
        raise ValueError(f"filter={mode!r} is unknown; allowed: one_pair, all_mixed, none.")
    return keep.view(-1)


def row_scales(
    positive: torch.Tensor,
    keep: torch.Tensor,
    lengths: torch.Tensor,
    positive_factor: float,
    negative_factor: float,
    normalisation: str,
) -> torch.Tensor:
    """(N,) per-row factor of the loss: 0 on dropped rows; with ``"official"`` normalisation
    ``tokens / positive tokens * positive_factor`` on kept positives and ``tokens / negative tokens * negative_factor``
    on kept negatives (``tokens`` = all rows' loss tokens, dapo's denominator), else the factors alone.

    Args:
        positive, keep: (N,) bool. lengths: (N,) loss tokens per row.
    """
    lengths = lengths.float()
    pos_rows, neg_rows = (positive & keep).float(), (~positive & keep).float()
    if normalisation == "official":
        total = lengths.sum()
        pos_scale = total / (lengths * pos_rows).sum().clamp(min=1.0) * positive_factor
        neg_scale = total / (lengths * neg_rows).sum().clamp(min=1.0) * negative_factor
    else:
        pos_scale, neg_scale = torch.tensor(positive_factor), torch.tensor(negative_factor)
    return pos_rows * pos_scale + neg_rows * neg_scale


def oreal_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    positive: torch.Tensor,
    scale: torch.Tensor,
    positive_objective: str = "behaviour_cloning",
) -> torch.Tensor:
    """(B, T) per-token loss: positives ``-A log pi`` (or ``-A r``), negatives ``-A r`` with the unclipped ratio
    ``r = pi / sg(pi_old)``; each row times ``scale``.

    Args:
        per_token_logps, old_per_token_logps: (B, T). advantages: (B, 1) or (B, T).
        positive: (B,) bool. scale: (B,) row factors (:func:`row_scales`).
    """
    ratio = torch.exp(per_token_logps - old_per_token_logps.detach())
    negative_loss = -(ratio * advantages)
    if positive_objective == "behaviour_cloning":
        positive_loss = -advantages * per_token_logps
    elif positive_objective == "policy_gradient":
        positive_loss = negative_loss
    else:
        raise ValueError(f"positive_objective={positive_objective!r} is unknown; allowed: behaviour_cloning, "
                         "policy_gradient.")
    loss = torch.where(positive.bool().unsqueeze(-1), positive_loss, negative_loss)
    return loss * scale.to(loss.dtype).unsqueeze(-1)


# ============================================================================================= plugin
class FreezeActorCallback(TrainerCallback):
    """Skips the policy's optimizer step while ``state.global_step < steps``: its gradients become None just before
    the step, and PyTorch's optimizers leave a parameter without a gradient (and its state) untouched."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None and state.global_step < self.steps:
            model.zero_grad(set_to_none=True)


class OrealPlugin(Plugin):
    """Behaviour cloning on positives, reshaped rewards on negatives, one pair per mixed group (advantage, loss)."""
    image_inputs = True
    multi_turn = True
    claim_metric = ("positive_fraction", "kept rows that are correct")

    name = "oreal"
    version = "0.1.0"
    paper = "Exploring the Limit of Outcome Reward for Learning Mathematical Reasoning (OREAL), arXiv:2502.06781"
    summary = ("Behaviour cloning on positive rollouts, reshaped (leave-one-out) rewards on negatives, optional pair "
               "filtering and token-level reward model.")
    Options = OrealOptions
    official = OfficialSource(
        "InternLM/OREAL", "2859cc0", verdict="faithful",
        files=("train_oreal.py",),
    )
    reconstructed = (
        "token_rm: the token-level reward model is a linear head over the policy's detached hidden states with its own "
        "AdamW, stepped at every optimizer step (official: a full policy copy with a scalar head, stepped once per "
        "generation batch)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        o = self.options
        self.needs_head_stats = o.token_rm  # the hidden states the token reward model reads
        self.token_rm = TokenRewardHead(o.token_rm_lr, o.token_rm_weight_decay, o.token_rm_max_grad_norm, o.seed)
        self.optimizer_steps = 0
        self._reduce = None  # sum over processes of the head's gradient (set at configure with several processes)

    def overwritten(self) -> tuple[str, ...]:
        # baseline 'rloo' / 'zscore' recompute the advantages from the verdicts; 'trl' keeps the incoming ones
        return () if self.options.baseline == "trl" else ("advantages",)
    replaces_surrogate = True
    replaces = ("the advantages (leave-one-out on +-1 rewards)", "the base surrogate on every loss token")

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if o.normalisation == "official" and args.loss_type != "dapo":
            raise IncompatiblePluginsError(
                f"oreal: normalisation='official' divides positive and negative token sums by their own counts on top "
                f"of loss_type='dapo', but loss_type={args.loss_type!r}. Set loss_type='dapo', or normalisation='run'."
            )
        if o.baseline == "rloo" and args.num_generations < 2:
            raise IncompatiblePluginsError("oreal: the leave-one-out baseline needs num_generations >= 2.")
        model = getattr(trainer, "model", None)
        config = getattr(unwrap_causal_lm(model), "config", None) if model is not None else None
        if o.token_rm and config is not None:  # built now so that every process holds it before the first step
            text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
            self.token_rm.build(int(text_config.hidden_size), trainer.accelerator.device)
        if o.actor_freeze_steps and hasattr(trainer, "add_callback"):
            trainer.add_callback(FreezeActorCallback(o.actor_freeze_steps))
            if getattr(trainer, "is_deepspeed_enabled", False):
                warnings.warn(
                    "oreal: with DeepSpeed actor_freeze_steps only zeroes OREAL's loss; DeepSpeed's optimizer step "
                    "still applies the KL, entropy-bonus and weight-decay terms during the freeze (the official code "
                    "skips the actor update).",
                    stacklevel=2,
                )
        accelerator = getattr(trainer, "accelerator", None)
        if getattr(accelerator, "num_processes", 1) > 1:
            self._reduce = lambda t: accelerator.reduce(t, reduction="sum")

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        self.optimizer_steps = int(step)
        if self.options.token_rm:
            self.token_rm.step(self._reduce)  # collective with several processes

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"optimizer_steps": self.optimizer_steps, "token_rm": self.token_rm.state_dict()}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        state = state or {}
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.token_rm.load_state_dict(state.get("token_rm", {}))

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        G = ctx.num_generations
        success = ctx.success(o.success_rule).cpu()
        if o.baseline == "trl":
            advantages = ctx.advantages.float().cpu()
            if advantages.dim() > 1:
                raise IncompatiblePluginsError("oreal: baseline='trl' needs per-row advantages (N,) before it.")
        else:
            rewards = oreal_rewards(success, o.correct_reward, o.incorrect_reward)
            advantages = rloo_advantages(rewards, G) if o.baseline == "rloo" else zscore_advantages(rewards, G)
        generator = torch.Generator().manual_seed(o.seed * 1_000_003 + ctx.step)
        keep = pair_filter(success, G, o.filter, generator)
        scale = row_scales(success, keep, ctx.completion_lengths.cpu(), o.positive_loss_factor,
                           o.negative_loss_factor, o.normalisation)
        device = ctx.advantages.device
        ctx.advantages = (advantages * keep.float()).to(device=device, dtype=ctx.advantages.dtype)
        ctx.extras[POSITIVE_KEY] = success.float().to(device)
        ctx.extras[SCALE_KEY] = scale.to(device)
        ctx.extras[KEEP_KEY] = keep.float().to(device)
        s = success.view(-1, G)
        ctx.log_metric("kept_fraction", keep.float().mean().item())
        ctx.log_metric("positive_fraction", (success & keep).sum().item() / max(int(keep.sum()), 1))
        ctx.log_metric("mixed_group_fraction", (s.any(-1) & ~s.all(-1)).float().mean().item())

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        if POSITIVE_KEY not in ctx.extras:  # a batch the advantage hook did not see
            return
        o = self.options
        positive, scale = ctx.extras[POSITIVE_KEY] > 0.5, ctx.extras[SCALE_KEY]
        values = oreal_token_loss(ctx.per_token_logps, ctx.old_per_token_logps, ctx.advantages, positive, scale,
                                  o.positive_objective)
        if o.token_rm:
            values = values * self._token_rm_weights(ctx, positive).to(values.dtype)
        if self.optimizer_steps < o.actor_freeze_steps:
            values = values * 0.0  # the policy waits while the token reward model learns (graph kept)
        ctx.replace_tokens(ctx.mask.bool(), values)

    def _token_rm_weights(self, ctx: LossContext, positive: torch.Tensor) -> torch.Tensor:
        """(B, T) token weights of the reward model's scores; trains it on the kept rows (first pass, train mode)."""
        o = self.options
        hidden = ctx.head_stats().hidden_c  # (B, T, d) states predicting the completion tokens
        self.token_rm.build(hidden.size(-1), hidden.device)
        scores = self.token_rm.scores(hidden)  # (B, T), graph to the head only
        mask = ctx.mask.float()
        keep = ctx.extras.get(KEEP_KEY, torch.ones_like(positive, dtype=torch.float)) > 0.5
        if ctx.mode == "train" and ctx.iteration == 0 and torch.is_grad_enabled():
            losses = sequence_bce(scores[keep], mask[keep], positive[keep].float())
            self.token_rm.accumulate(losses.sum(), int(keep.sum()))
            if losses.numel():
                ctx.log_metric("token_rm_loss", float(losses.detach().mean()))
        ctx.log_metric("token_rm_steps", self.token_rm.steps)
        weights = oreal_token_weights(scores, mask, positive, o.token_rm_rescale, o.correct_threshold,
                                      o.incorrect_threshold, o.correct_topk_ratio, o.incorrect_topk_ratio)
        for name, rows in (("positive_token_weight", positive & keep), ("negative_token_weight", ~positive & keep)):
            tokens = mask[rows].sum()
            if tokens > 0:
                ctx.log_metric(name, float((weights[rows] * mask[rows]).sum() / tokens))
        return weights
