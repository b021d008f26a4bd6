"""RLPR — Reinforcement Learning with reference Probability Reward (arXiv:2506.18254).

Verifier-free RL for free-form answers. A response ``o = (z, y)`` is its reasoning
``z`` followed by its answer ``y``. RLPR swaps the generated answer for the reference answer ``y*`` and asks the
policy itself how likely ``y*`` is after its own reasoning:

1. ``o' = z || y*``; one extra **no-grad** forward of the policy on ``[prompt + z + y*]`` gives the per-token
   probabilities ``p_j`` of the ``y*`` tokens (the framework's ``policy_logprobs`` service, TRL's log-probs:
   no full-vocabulary logits are kept, the sampling temperature applies).
2. Probability reward: the **mean** token probability ``r = (1/|y*|) sum_j p_j`` (more robust than the sequence
   likelihood, which collapses on long answers).
3. Debiasing: ``r_hat = clip(r - r_0, 0, 1)`` with ``r_0`` the same mean probability of ``y*`` directly after the
   prompt (no reasoning), so that only the reasoning's contribution is rewarded (``debias=false`` keeps ``r``).
4. Standard-deviation filtering (advantage stage): prompts whose rewards barely vary across the group carry no
   learning signal and mostly noise; groups whose ``rlpr`` reward std is below a threshold get zero advantages.
   The threshold follows an exponential moving average of the per-step mean group std (RLPR's adaptive
   curriculum); ``std_threshold`` fixes it instead.

The reward is the column ``rlpr``. Splitting ``z`` from ``y``: ``z`` is the completion up to and including the first
match of ``answer_marker`` (default: ``Answer:``, the bundled tasks' answer line), and ``y*`` is
``answer_template`` filled with the row's ``answer`` column; a completion without a marker keeps all its text as
``z`` followed by ``answer_prefix``.

Reconstructed (options marked so): the marker/template defaults (the paper uses its own answer tags), the prefix
used for ``r_0``, the EMA decay (0.99) and its initialisation (the first batch's mean std), the unbiased std, and
updating the EMA with the current batch before filtering.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from trl_plugins import AdvantageContext, Plugin, PluginConfigError, PluginOptions, StageServices, hookimpl, option
from trl_plugins.text import completion_text

COLUMN = "rlpr"
CORRECTNESS_PICK_ONE = (
    "both replace the correctness reward (EMPO with answer agreement, without references; RLPR with the policy's "
    "probability of the reference answer); choose by whether your dataset has reference answers"
)


@dataclass
class RlprOptions(PluginOptions):
    answer_column: str = option("answer", help="Dataset column with the reference answer y*.")
    answer_marker: str = option(
        r"(?i)answer\s*:", help="Regex; the reasoning z ends with its first match in the completion.",
        reconstructed=True,
    )
    answer_template: str = option(
        " {answer}", help="How the reference answer is written after the marker ({answer} is replaced).",
        reconstructed=True,
    )
    answer_prefix: str = option(
        "\nAnswer:", help="Appended to a completion without a marker (and after the prompt for r_0) before y*.",
        reconstructed=True,
    )
    debias: bool = option(True, help="Subtract the no-reasoning probability r_0 and clip to [0, 1].")
    reward_weight: float = option(1.0, help="TRL reward weight of the rlpr column.")
    std_filter: bool = option(True, help="Zero the advantages of groups whose rlpr reward std is below the threshold.")
    std_threshold: float | None = option(
        None, min=0.0, help="Fixed std threshold; None = exponential moving average of the per-step mean group std."
    )
    ema_decay: float = option(0.99, min=0.0, max=1.0, help="Decay of the threshold's moving average.",
                              reconstructed=True)

    def validate(self) -> None:
        try:
            re.compile(self.answer_marker)
        except re.error as exc:
            raise PluginConfigError(f"Option 'answer_marker' of plugin 'rlpr' is not a valid regex: {exc}.") from exc
        if "{answer}" not in self.answer_template:
            raise PluginConfigError("Option 'answer_template' of plugin 'rlpr' must contain {answer}.")


# --------------------------------------------------------------------------------------------- pure functions
def split_reasoning(text: str, marker: str, prefix: str) -> str:
    """The reasoning z: ``text`` up to and including the first ``marker`` match, else ``text + prefix``."""
    m = re.search(marker, text)
    return text[: m.end()] if m else text + prefix


def mean_token_probability(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean probability of the masked tokens per row. logps, mask: (B, A). Returns (B,) (0 for empty rows)."""
    probs = torch.exp(logps) * mask
    return probs.sum(-1) / mask.sum(-1).clamp(min=1)


def debiased_reward(r: torch.Tensor, r0: torch.Tensor) -> torch.Tensor:
    """``clip(r - r0, 0, 1)`` elementwise."""
    return torch.clamp(r - r0, min=0.0, max=1.0)


def group_std(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Unbiased std per group (NaN ignored; 0 for groups with fewer than two values). values (N,) -> (N/G,)."""
    v = values.view(-1, group_size).float()
    valid = ~torch.isnan(v)
    n = valid.sum(1)
    mean = torch.where(valid, v, 0).sum(1) / n.clamp(min=1)
    sq = torch.where(valid, (v - mean.unsqueeze(1)) ** 2, 0).sum(1)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    return torch.where(n >= 2, std, torch.zeros_like(std))


def ema_update(previous: float | None, value: float, decay: float) -> float:
    """``decay * previous + (1 - decay) * value``; the first value initialises the average."""
    return value if previous is None else decay * previous + (1.0 - decay) * value


class RlprPlugin(Plugin):
    """Reference-answer probability reward (reward stage) with std filtering of low-variance groups (advantage)."""

    name = "rlpr"
    version = "0.1.0"
    paper = "RLPR: Extrapolating RLVR to General Domains without Verifiers, arXiv:2506.18254"
    summary = "Verifier-free reward: the policy's mean probability of the reference answer after its own reasoning."
    Options = RlprOptions
    replaces = ("the correctness reward (reference-answer probability column)",)
    conflicts_with = ("empo",)
    conflict_reason = CORRECTNESS_PICK_ONE
    reconstructed = (
        "answer_marker / answer_template / answer_prefix defaults fit the bundled tasks (paper: its answer tags)",
        "threshold EMA: decay 0.99, initialised with the first batch's mean group std, updated before filtering",
        "unbiased (Bessel) group std",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.services: StageServices | None = None
        self.threshold: float | None = None

    def required_columns(self) -> list[str]:
        return [self.options.answer_column]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        # the reward function runs inside TRL's reward call, outside any stage context: it uses the run's services
        self.services = trainer.plugin_services

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        plugin = self

        def rlpr(prompts, completions, **kwargs):
            return plugin.rewards(prompts, completions, kwargs)

        rlpr.reward_weight = self.options.reward_weight
        return [rlpr]

    # ------------------------------------------------------------------------------------------ reward
    def answer_probabilities(self, contexts: list[list[int]], targets: list[list[int]]) -> torch.Tensor:
        """Mean probability of each ``targets[i]`` after ``contexts[i]`` under the current policy (no grad); (R,)."""
        logps = self.services.policy_logprobs(contexts, targets)  # one (len(targets[i]),) tensor per row
        return torch.stack([
            mean_token_probability(lp.float().unsqueeze(0), torch.ones(1, lp.numel(), device=lp.device))[0]
            for lp in logps
        ]).cpu()

    def rewards(self, prompts: list, completions: list, columns: dict) -> list[float]:
        o = self.options
        if self.services is None:
            raise PluginConfigError("rlpr: the plugin was not configured with a trainer.")
        refs = columns.get(o.answer_column)
        if refs is None:
            raise PluginConfigError(f"rlpr: the reward function got no {o.answer_column!r} column.")
        tok = self.services.tokenizer
        prompt_ids = self.services.tokenize_prompts(list(prompts))

        def encode(text: str) -> list[int]:
            return list(tok(text=text, add_special_tokens=False)["input_ids"])

        targets = [encode(o.answer_template.format(answer=str(a))) for a in refs]
        contexts = [
            p + encode(split_reasoning(completion_text(c), o.answer_marker, o.answer_prefix))
            for p, c in zip(prompt_ids, completions, strict=True)
        ]
        r = self.answer_probabilities(contexts, targets)
        if o.debias:
            unique: dict[tuple, int] = {}
            base_ctx, base_tgt, index = [], [], []
            for p, t in zip(prompt_ids, targets):
                key = (tuple(p), tuple(t))
                if key not in unique:
                    unique[key] = len(base_ctx)
                    base_ctx.append(p + encode(o.answer_prefix))
                    base_tgt.append(t)
                index.append(unique[key])
            r0 = self.answer_probabilities(base_ctx, base_tgt)[torch.tensor(index)]
            reward = debiased_reward(r, r0)
        else:
            reward = r
        log_metric = columns.get("log_metric")
        if callable(log_metric):
            log_metric("plugins/rlpr/answer_probability", float(r.mean()))
        return reward.tolist()

    # ------------------------------------------------------------------------------------------ advantage
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if not o.std_filter:
            return
        values = ctx.rewards_per_func[:, self._column(ctx)]
        stds = group_std(values, ctx.num_generations)
        training = ctx.mode == "train"
        if o.std_threshold is not None:
            threshold = o.std_threshold
        else:
            threshold = ema_update(self.threshold, float(stds.mean()), o.ema_decay)
            if training:
                self.threshold = threshold
        keep = stds >= threshold
        rows = keep.repeat_interleave(ctx.num_generations).to(ctx.advantages.device, ctx.advantages.dtype)
        ctx.advantages = ctx.advantages * rows.view((-1,) + (1,) * (ctx.advantages.dim() - 1))
        ctx.log_metric("std_threshold", float(threshold))
        ctx.log_metric("kept_group_fraction", float(keep.float().mean()))
        ctx.log_metric("reward_std", float(stds.mean()))

    def _column(self, ctx: AdvantageContext) -> int:
        names = ctx.run.reward_func_names
        if COLUMN in names:
            return names.index(COLUMN)
        return ctx.rewards_per_func.size(1) - 1

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"threshold": self.threshold}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.threshold = state.get("threshold")
