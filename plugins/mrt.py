"""MRT — Meta Reinforcement Fine-Tuning: a dense progress bonus per reasoning episode (arXiv:2503.07572).

Outcome-reward RL rewards only the end of a long trace, so the model is not pushed to make *progress* with its
intermediate tokens. MRT splits the output into episodes and rewards each episode by the change it brings in the
probability of eventual success, estimated by a "meta-prover" ``mu``: the policy itself, forced to stop thinking
after a prefix and to give its best-guess answer. Facts from the paper; no public MRT-online recipe could be found
(the "MRT-online" values below are the paper's, reconstructed here), and the official README describes a different
estimator, advantage = reward - termination reward (the reward of the forced answer), which this plugin neither
implements nor reproduces:

1. Episodes ``z_1 .. z_k`` are segments of the output stream (the paper: thinking episodes; MRT-online segments at
   most 6 episodes per rollout).
2. ``J(z_{0:j})``: the success rate of the meta-prover's answers from prefix ``z_{0:j}`` (the prompt, the first ``j``
   episodes, a forced-termination prompt: "time is up", then the model's best guess), from ``prover_samples``
   sampled answers (MRT-online: 4 termination branches per boundary).
3. Progress of episode ``j``: ``r_prg(z_j) = J(z_{0:j}) - J(z_{0:j-1})``; the objective adds
   ``alpha * sum_j r_prg(z_j)`` to the outcome reward (MRT-online: ``alpha = 1``, a per-episode dense reward).

Mapping onto TRL: the sampling stage cuts each completion into episodes after every ``episode_separator`` (matched
on token ids, the separator tokenized on its own; the bundled tasks write one step per line; at most
``max_episodes``, the last one running to the end), and asks the
generation service for ``prover_samples`` answers from ``prompt + completion[:b_j] + termination_text`` for every
boundary ``b_0 = 0 < b_1 < ... < b_k`` (the prefix-continuation path of ``cure``; collective-safe, counted in the
rollout budget: ``(k + 1) * prover_samples`` generations per rollout). Answers are judged by the verifier column
(``success_column`` above ``success_threshold``) on the prefix, the termination text and the answer together. The
advantage stage adds the dense bonus to TRL's advantages token by token: every token of episode ``j`` gets
``alpha * r_prg(z_j)`` (token-level advantages). ``alpha = 0`` generates nothing and keeps TRL's advantages.
Reconstructed: the separator, the termination text, the per-episode credit to the episode's own tokens (rather than
a return-to-go) and adding the bonus after TRL's normalisation (so it keeps its scale in units of success rate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.success import SuccessOptions
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE

#: Annotation key: ``[(b_j, J_j) for j = 0..k]``, episode boundaries (completion token index) and success rates.
PROGRESS_KEY = "mrt_progress"


@dataclass
class MrtOptions(SuccessOptions):
    alpha: float = option(1.0, min=0.0, help="Weight of the progress bonus (MRT-online recipe: 1.0); 0 switches MRT off.")
    prover_samples: int = option(
        4, min=1, help="Meta-prover answers per episode boundary that estimate J (MRT-online: 4 branches)."
    )
    max_episodes: int = option(6, min=1, help="Episodes per rollout at most (MRT-online: 6); the last runs to the end.")
    episode_separator: str = option(
        "\n", help="Text that ends an episode (the bundled tasks write one step per line).", reconstructed=True
    )
    termination_text: str = option(
        "\nTime is up. Final answer:",
        help="Forced-termination text appended to a prefix before the meta-prover's best-guess answer.",
        reconstructed=True,
    )

    def validate(self) -> None:
        if not self.episode_separator:
            raise PluginConfigError(
                "Option 'episode_separator' of plugin 'mrt' got ''; allowed: a non-empty string."
            )


def episode_boundaries(ids: list[int], separator: list[int], max_episodes: int) -> list[int]:
    """``[b_0 = 0, b_1, ..., b_k = len(ids)]``: token indices just after each ``separator`` occurrence.

    At most ``max_episodes`` episodes: the first ``max_episodes - 1`` separators cut, the last episode runs to the end.
    A separator at the very end does not open an empty episode.
    """
    cuts, n, m = [], len(ids), len(separator)
    t = 0
    while t + m <= n and len(cuts) < max_episodes - 1:
        if ids[t : t + m] == separator:
            if t + m < n:
                cuts.append(t + m)
            t += m
        else:
            t += 1
    return [0, *cuts, n]


def progress_bonus(boundaries: list[int], success_rates: list[float], alpha: float, width: int) -> torch.Tensor:
    """(width,) per-token bonus: ``alpha * (J_j - J_{j-1})`` on the tokens ``[b_{j-1}, b_j)`` of episode ``j``."""
    bonus = torch.zeros(width)
    for j in range(1, len(boundaries)):
        bonus[boundaries[j - 1] : min(boundaries[j], width)] = alpha * (success_rates[j] - success_rates[j - 1])
    return bonus


class MrtPlugin(Plugin):
    """Meta-prover success rates at episode boundaries, credited as a dense per-episode progress bonus."""
    claim_metric = ('total_progress', 'progress (change in success probability) over episodes')
    image_inputs = IMAGES_GENERATION_SERVICE
    multi_turn = (
        'its prefix continuations (the meta-prover) is generated by the generation service, which samples '
        'single-turn text without running tools, so it would not be a rollout of the same multi-turn episode.'
    )

    name = "mrt"
    version = "0.1.0"
    paper = "Optimizing Test-Time Compute via Meta Reinforcement Fine-Tuning (MRT), arXiv:2503.07572"
    summary = "Dense progress bonus per episode: change in the meta-prover's success rate from episode prefixes."
    Options = MrtOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="CMU-AIRe/MRT@1815a8c holds no RL training code, and its README describes a different estimator "
        "(advantage = reward - termination reward); the progress bonus is reconstructed from the paper.",
    )
    reconstructed = (
        "episodes end at episode_separator; the meta-prover answers after termination_text",
        "each episode's tokens get its own progress (not a return-to-go), added after TRL's normalisation",
    )

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        if o.alpha == 0.0:
            return
        tok = ctx.tokenizer
        separator = list(tok(o.episode_separator, add_special_tokens=False)["input_ids"])
        termination = list(tok(o.termination_text, add_special_tokens=False)["input_ids"])
        plan, requests = [], []
        for i in range(len(ctx)):
            ids = list(ctx.completion_ids[i])
            bounds = episode_boundaries(ids, separator, o.max_episodes)
            plan.append(bounds)
            for b in bounds:
                requests += [list(ctx.prompt_ids[i]) + ids[:b] + termination] * o.prover_samples
        answers = ctx.service.generate(prompt_ids=requests)  # collective, counted in the rollout budget
        texts, rows = [], []
        k = 0
        for i, bounds in enumerate(plan):
            for b in bounds:
                prefix = list(ctx.completion_ids[i][:b]) + termination
                for _ in range(o.prover_samples):
                    texts.append(ctx.decode(prefix + list(answers[k].completion_ids), i))
                    rows.append(i)
                    k += 1
        verdicts = ctx.success(rows, texts, o.success_rule).float() if rows else torch.zeros(0)
        k, rates_all = 0, []
        for i, bounds in enumerate(plan):
            rates = []
            for _ in bounds:
                rates.append(float(verdicts[k : k + o.prover_samples].mean()))
                k += o.prover_samples
            ctx.annotations[i][PROGRESS_KEY] = list(zip(bounds, rates))
            rates_all.append(rates)
        ctx.log_metric("extra_rollouts", len(requests))
        if rates_all:
            ctx.log_metric("episodes", sum(len(r) - 1 for r in rates_all) / len(rates_all))
            ctx.log_metric("final_success_rate", sum(r[-1] for r in rates_all) / len(rates_all))
            ctx.log_metric("total_progress", sum(r[-1] - r[0] for r in rates_all) / len(rates_all))

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.alpha == 0.0 or ctx.mode != "train":
            return
        mask = ctx.completion_mask()  # (N, T_max)
        width = mask.size(1)
        bonus = torch.zeros(len(ctx.annotations), width)
        for n, note in enumerate(ctx.annotations):
            if PROGRESS_KEY in note:
                bounds, rates = zip(*note[PROGRESS_KEY])
                bonus[n] = progress_bonus(list(bounds), list(rates), o.alpha, width)
        advantages = ctx.advantages
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1).expand(-1, width)
        bonus = bonus[:, : advantages.size(1)].to(advantages)
        ctx.advantages = advantages + bonus * mask[:, : advantages.size(1)].to(advantages)
        ctx.log_metric("bonus_abs_mean", float((bonus.abs() * mask[:, : bonus.size(1)].to(bonus)).sum()
                                               / mask.sum().clamp(min=1)))
