"""IKEA -- Reinforced Internal-External Knowledge Synergistic Reasoning for Efficient Adaptive Search Agent
(arXiv:2505.07596).

A knowledge-boundary-aware reward for search agents: answer from internal knowledge when it suffices, search when
it does not. With ``RT`` the number of retrievals of a rollout (its search-tool calls, from the turn structure TRL's
tool loop produces) and correctness decided on the verifier column (the framework's success rule), the paper's reward
is ``R = r_ans + r_kb`` with

* a correct answer: ``r_kb = r_kb_plus * (1 - RT / RT_max)`` (at least 0) -- fewer retrievals, more reward;
* an incorrect answer that searched: ``r_kb = r_kb_minus`` -- a small credit for resorting to retrieval;
* an incorrect answer without search: ``r_kb = 0``.

Constants from the official code: ``r_kb_plus = 0.6``, ``r_kb_minus = 0.05``, ``RT_max = 3`` (0.6, 0.4, 0.2, 0 for
0, 1, 2, 3+ searches; ``hzy312/knowledge-r1@79c38e8d4b1df0304fe1765e31fc7f4230637b74``
``verl/utils/reward_score/qa_em.py:140-149`` counts ``<search>`` tags, ``:182`` adds the exact-match score, ``:185``
gives 0.05, ``:189`` -1 for a malformed rollout; ``train_grpo_kb.sh:87`` runs at most 3 turns). ``r_ans`` is the run's verifier column (official: exact match); ``r_kb`` is this plugin's own
reward column ``ikea`` (a placeholder filled at the reward stage), so TRL's weighted sum gives ``R`` and success is
still decided on the untouched verifier column. Not implemented here: the official code's -1 for a malformed
rollout (its own tag format; the framework has no format rule) and the paper's knowledge-boundary-aware training
data (a dataset choice). ``reward_weight = 0`` is the neutral setting (the column adds nothing to TRL's sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, RewardContext, hookimpl, option
from trl_plugins.api.errors import suggest
from trl_plugins.api.success import SuccessOptions, placeholder_column

COLUMN = "ikea"


@dataclass
class IkeaOptions(SuccessOptions):
    r_kb_plus: float = option(
        0.6, min=0.0, help="Knowledge-boundary reward of a correct answer without retrieval; falls linearly to 0 at "
        "rt_max retrievals (official: 0.6)."
    )
    r_kb_minus: float = option(
        0.05, min=0.0, help="Reward of an incorrect answer that searched: credit for retrieving when internal "
        "knowledge falls short (official: 0.05). An incorrect answer without search gets 0."
    )
    rt_max: int = option(3, min=1, help="Retrievals at which a correct answer's knowledge-boundary reward is 0 "
                                        "(official: 3, its maximum number of turns).")
    search_tools: list[str] = option(
        default_factory=lambda: ["search"],
        help="Names of the tools whose calls count as retrievals (empty list: every tool call counts).",
    )
    reward_weight: float = option(1.0, min=0.0, help="TRL weight of the ikea column (0: the neutral setting).")


def knowledge_boundary_reward(
    correct: torch.Tensor, retrievals: torch.Tensor, r_kb_plus: float, r_kb_minus: float, rt_max: int
) -> torch.Tensor:
    """(N,) ``r_kb`` of rollouts with (N,) bool ``correct`` and (N,) retrieval counts (see the module docstring)."""
    retrievals = retrievals.float()
    reward_correct = r_kb_plus * (1 - retrievals / rt_max).clamp(min=0.0)
    reward_wrong = torch.where(retrievals > 0, torch.full_like(retrievals, r_kb_minus), torch.zeros_like(retrievals))
    return torch.where(correct, reward_correct, reward_wrong)


def retrieval_count(tool_calls: list[list[dict]], search_tools: list[str]) -> int:
    """The calls of a completion's turns (``TurnStructure.tool_calls``) to one of ``search_tools`` (all if empty)."""
    names = {name.strip() for name in search_tools}
    return sum(1 for calls in tool_calls for c in calls if not names or str(c.get("name", "")).strip() in names)


class IkeaPlugin(Plugin):
    name = "ikea"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = ("Reinforced Internal-External Knowledge Synergistic Reasoning for Efficient Adaptive Search Agent (IKEA), "
             "arXiv:2505.07596")
    summary = "Knowledge-boundary reward: correct answers with fewer searches score more; failed searches a little."
    Options = IkeaOptions
    official = OfficialSource(
        "hzy312/knowledge-r1", "79c38e8", verdict="equal",
        files=("verl/utils/reward_score/qa_em.py",),
    )
    claim_metric = ("retrievals_mean", "search calls per rollout")

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        tools = [getattr(t, "__name__", str(t)) for t in getattr(trainer, "tools", None) or []]
        names = [str(n).strip() for n in self.options.search_tools]
        unknown = [n for n in names if n not in tools]
        if tools and unknown:  # a misspelt name would count 0 retrievals forever
            raise PluginConfigError(
                f"Option 'search_tools' of plugin 'ikea' got {list(self.options.search_tools)!r}; "
                f"{', '.join(repr(n) for n in unknown)} {'is' if len(unknown) == 1 else 'are'} not a tool of this run "
                f"(tools: {', '.join(tools)}).{suggest(unknown[0], tools)} Allowed: names of the run's tools, or [] "
                "to count every tool call as a retrieval."
            )

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        # r_kb needs the verifier's verdict: the reward transform fills the column in
        return [placeholder_column("ikea", self.options.reward_weight)]

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        opts = self.options
        local = [retrieval_count(t.tool_calls, opts.search_tools) for t in ctx.local_turns]
        retrievals = torch.tensor(ctx.gather_object(local or [0] * len(ctx.local_rows)), dtype=torch.long)
        correct = ctx.success(opts.success_rule).cpu()
        values = knowledge_boundary_reward(correct, retrievals, opts.r_kb_plus, opts.r_kb_minus, opts.rt_max)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = values.to(rewards)
        ctx.rewards_per_func = rewards
        ctx.log_metric("retrievals_mean", float(retrievals.float().mean()))
        ctx.log_metric("retrievals_correct", float(retrievals[correct].float().mean()) if correct.any() else 0.0)
        ctx.log_metric("no_search_correct_fraction", float((correct & (retrievals == 0)).float().mean()))
        ctx.log_metric("r_kb_mean", float(values.mean()))
