"""ReasonFlux-PRM — trajectory-aware process rewards, ungated (arXiv:2506.18896).

ReasonFlux-PRM scores a reasoning trajectory with a process reward model and pays that score to **every** rollout
(no outcome gate, unlike Posterior-GRPO). In its online-RL recipe the PRM reward and the rule-based outcome reward
are mixed with a fixed weight::

    r_i = beta * PRM(question, completion_i) + (1 - beta) * r_outcome_i,     beta = 0.75

Facts from the official code (CloudEngineHub/ReasonFlux@b4922b7, mirror of Gen-Verse/ReasonFlux,
``ReasonFlux_PRM/Application/verl/workers/fsdp_workers.py``): the whole response is sent to the PRM as **one step**
(the response followed by one ``<extra_0>`` step token, :1276), its score is the positive-class probability at
that token (``make_step_rewards``, :1358-1371), and ``BETA = 0.75`` mixes it with the rule-based score (:1374-1375);
the mixed score is then TRL-style GRPO's sequence reward (one value per rollout, group-normalised).

This plugin, ``mode="trajectory"`` (default, official):

* ``granularity="trajectory"`` (official): the completion is one step; the PRM's score of it is the process reward.
  ``granularity="steps"``: the completion is split into steps (the PRM's separator) and the step scores are
  aggregated (``aggregate``: mean / min / last / prod) -- the paper's step-level reward, our reconstruction.
* the process reward fills the reward column ``reasonflux_prm`` whose TRL weight is ``beta / (1 - beta)`` (3.0 at
  the official 0.75): against an outcome column of weight 1 the combined reward is the official mix up to the factor
  ``1 / (1 - beta)``, which GRPO's group standardisation (``scale_rewards="group"``) removes. ``beta = 0`` is vanilla
  TRL (the column has weight 0 and the PRM is not called).

``mode="dense"`` (reconstructed, not in the official code): the step scores become **dense per-token advantages**,
DeepSeekMath's process-supervision rule applied to PRM step scores (arXiv:2402.03300 §4.1.3)::

    r~_{i,k} = (s_{i,k} - mean_g(s)) / (std_g(s) + eps)      over all steps of the group's rollouts
    A_{i,t}  = A_i + dense_weight * sum_{k : t < end_{i,k}} r~_{i,k}     (end_{i,k}: token just after step k)

where ``A_i`` is the advantage from the other reward columns (TRL's). The advantages become (N, T). With
``dense_weight = 0`` the advantages are TRL's.

**Fin-PRM** (arXiv:2508.15202) is a mode of this plugin, not a plugin of its own: its online-RL code
(Amazing-J/qwen-dianjin@06e4583, ``DianJin-PRM/src/verl/workers/fsdp_workers.py``) is ReasonFlux-PRM's with the
mix removed -- the whole response is one step (``<extra_0>`` after it, :1287), the reward is the PRM's score at the
first step token (the ``<extra_0>`` / ``<extra_1>`` positions, :1380-1385) **alone** (:1386; the rule-based score of
:1336 is computed but unused). Here: ``reasonflux_prm`` with the Fin-PRM model as ``prm_model`` and the outcome
columns weighted 0 (TRL's ``reward_weights``); the PRM column alone then decides the group-standardised advantage.
What is Fin-PRM's own -- step labels from Monte-Carlo importance, an LLM judge and knowledge checks, trajectory labels
from the outcome and knowledge coverage, combined into the PRM's training targets -- trains the reward model and is
not a GRPO plugin.

The PRM is the shared component :mod:`trl_plugins.components.prm` (one instance with scope / posterior_grpo when
configured alike). Metrics: ``process_reward_mean``, ``process_reward_std``; dense mode: ``dense_advantage_abs_mean``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginError,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import gather_objects_together
from trl_plugins.api.reasons import without_images
from trl_plugins.api.success import mark_placeholder, placeholder_column
from trl_plugins.api.text import completion_text
from trl_plugins.components.prm import PRMOptions, prm_from_options
from trl_plugins.components.steps import aggregate_step_scores, token_boundary

COLUMN = "reasonflux_prm"


@dataclass
class ReasonFluxPRMOptions(PRMOptions):
    plugin_name: ClassVar[str] = "reasonflux_prm"

    mode: Literal["trajectory", "dense"] = option(
        "trajectory",
        help="trajectory: the PRM score is a reward column mixed with the outcome (official); dense: step scores "
        "become per-token advantages (DeepSeekMath process supervision) [reconstructed].",
    )
    beta: float = option(
        0.75, min=0.0, max=1.0,
        help="trajectory mode: weight of the PRM score in beta * PRM + (1 - beta) * outcome (official BETA = 0.75); "
        "the column's TRL weight is beta / (1 - beta); 0 = vanilla TRL.",
    )
    granularity: Literal["trajectory", "steps"] = option(
        "trajectory",
        help="trajectory: the whole completion is one PRM step (official); steps: split into steps and aggregate "
        "[reconstructed]. Dense mode always uses steps.",
    )
    aggregate: Literal["mean", "min", "last", "prod"] = option(
        "mean", reconstructed=True, help="granularity='steps': how step scores become one process reward."
    )
    dense_weight: float = option(
        1.0, min=0.0, reconstructed=True,
        help="dense mode: weight of the per-token process advantage added to TRL's advantage (0 = vanilla TRL).",
    )
    eps: float = option(1e-6, min=0.0, min_exclusive=True, help="dense mode: std floor of the step normalisation.")
    step_separator: str | None = option(None, help="Step separator (None: the PRM's convention).")
    problem_column: str = option("problem", help="Dataset column read by the programmatic PRM.")

    def validate(self) -> None:
        super().validate()
        if self.beta >= 1.0:
            raise PluginConfigError(
                f"Option 'beta' of plugin 'reasonflux_prm' is {self.beta!r}; allowed: 0 <= beta < 1 (the outcome "
                "keeps weight 1 - beta; the column's TRL weight is beta / (1 - beta))."
            )


#: one process reward from step scores (the shared rule of :mod:`trl_plugins.components.steps`)
aggregate_steps = aggregate_step_scores


def column_weight(beta: float) -> float:
    """TRL weight of the PRM column so that, against an outcome of weight 1, the mix is beta : (1 - beta)."""
    return beta / (1.0 - beta)


def dense_process_advantages(step_scores: list[list[float]], step_ends: list[list[int]], group_size: int, width: int,
                             eps: float = 1e-6) -> torch.Tensor:
    """Per-token process advantages (N, width) from PRM step scores (DeepSeekMath process supervision).

    Args:
        step_scores: N lists, the step scores s_{i,k} of each row. step_ends: N lists, the token index just after
            each step (same lengths). group_size: G. width: T.

    Each step score is standardised over all steps of its group (mean 0, std 1 with ``eps``; a group with one step
    in all uses std 1), and token t of row i receives the sum of the standardised scores of the steps ending after t.
    """
    N = len(step_scores)
    out = torch.zeros(N, width)
    positions = torch.arange(width)
    for g in range(0, N, group_size):
        flat = [s for i in range(g, g + group_size) for s in step_scores[i]]
        if not flat:
            continue
        values = torch.tensor(flat, dtype=torch.float32)
        mean = values.mean()
        std = values.std() if values.numel() > 1 else torch.tensor(1.0)
        for i in range(g, g + group_size):
            for score, end in zip(step_scores[i], step_ends[i]):
                out[i] += ((score - mean) / (std + eps)) * (positions < end).float()
    return out


class ReasonFluxPRMPlugin(Plugin):
    """Ungated PRM process reward: a trajectory reward column (official mix) or dense per-token advantages."""

    name = "reasonflux_prm"
    image_inputs = without_images("its process reward model reads the prompt as text")
    multi_turn = (
        "its process reward model scores the reasoning steps of one answer text; tool-call turns and tool results "
        "are not steps it knows."
    )
    version = "0.1.0"
    paper = "ReasonFlux-PRM: Trajectory-Aware PRMs for Long Chain-of-Thought Reasoning in LLMs, arXiv:2506.18896"
    summary = "PRM process reward for every rollout (no outcome gate): trajectory reward column or dense advantages."
    Options = ReasonFluxPRMOptions
    official = OfficialSource(
        "CloudEngineHub/ReasonFlux", "b4922b7", verdict="faithful",
        files=("ReasonFlux_PRM/Application/verl/workers/fsdp_workers.py",),
        note="A mirror of Gen-Verse/ReasonFlux. compute_rm_score: the response as one <extra_0> step, BETA = 0.75 "
        "mix with the rule-based score; mode='dense' and granularity='steps' are reconstructed.",
        variants=("granularity", "mode"),
    )
    claim_metric = ("process_reward_mean", "mean PRM process reward")
    reconstructed = (
        "granularity='steps' with an aggregate (the paper's step-level reward; the official RL code scores one step)",
        "mode='dense': DeepSeekMath process-supervision advantages over the PRM step scores",
        "the mix through a TRL column weight beta / (1 - beta) (equal to the official mix under group scaling)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.prm = None
        self._batch: list | None = None

    def required_columns(self) -> list[str]:
        return [self.options.problem_column] if self.options.prm == "programmatic" else []

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        if self.options.mode != "trajectory":
            return []
        return [mark_placeholder(placeholder_column(COLUMN, column_weight(self.options.beta)))]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if self.prm is None and self._active():
            self.prm = prm_from_options(self.options)

    def _active(self) -> bool:
        o = self.options
        return o.beta > 0 if o.mode == "trajectory" else o.dense_weight > 0

    def _score(self, ctx: RewardContext) -> list[list[float]]:
        """(B,) lists of step scores of this process's rows (one PRM batch)."""
        texts = [completion_text(c) for c in ctx.local_completions]
        if self.options.mode == "trajectory" and self.options.granularity == "trajectory":
            # official: the whole response is one step
            return self.prm.score_step_lists(ctx.local_rows, [[t.strip()] if t.strip() else [] for t in texts])
        return self.prm.score_steps(ctx.local_rows, texts)

    def _local_rows(self, ctx: RewardContext) -> list:
        scores = self._score(ctx)
        if self.options.mode == "trajectory":
            how = "last" if self.options.granularity == "trajectory" else self.options.aggregate
            return [aggregate_steps(s, how) for s in scores]
        if ctx.local_completion_ids is None:
            raise PluginError(f"{self.name}: dense mode needs the completions' token ids at the reward stage.")
        tok = ctx.tokenizer
        rows = []
        for j, s in enumerate(scores):
            ids = list(ctx.local_completion_ids[j])
            spans = self.prm.steps(completion_text(ctx.local_completions[j]))
            ends = [token_boundary(ids, span.end, lambda x: tok.decode(x, skip_special_tokens=True)) for span in spans]
            rows.append((list(s), ends))
        return rows

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        if not self._active():
            return
        if self.prm is None:
            self.prm = prm_from_options(self.options)
        # (N,) collective; a PRM failing on one process stops every process together
        gathered = gather_objects_together(ctx, self.name, self._local_rows, ctx)
        if self.options.mode == "dense":
            self._batch = gathered
            flat = [x for s, _ in gathered for x in s]
            process = torch.tensor(flat or [0.0])
        else:
            process = torch.tensor(gathered, dtype=torch.float32)
            col = ctx.reward_func_names.index(COLUMN)
            matrix = ctx.rewards_per_func.clone()
            matrix[:, col] = process.to(matrix)
            ctx.rewards_per_func = matrix
        ctx.log_metric("process_reward_mean", process.mean().item())
        ctx.log_metric("process_reward_std", process.std().item() if process.numel() > 1 else 0.0)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.mode != "dense" or not self._active():
            return
        if self._batch is None or len(self._batch) != ctx.rewards.numel():
            raise PluginError(f"{self.name}: the reward stage did not record this batch's step scores.")
        mask = ctx.completion_mask()
        dense = ctx.add_token_advantages(dense_process_advantages(
            [s for s, _ in self._batch], [e for _, e in self._batch], ctx.num_generations, mask.size(1), o.eps),
            o.dense_weight)
        ctx.log_metric("dense_advantage_abs_mean", (dense.abs().sum() / mask.float().sum().clamp(min=1)).item())
        self._batch = None
