"""FunRL — function-call RL with AST-verified rewards ("Exploring Superior Function Calls via Reinforcement Learning",
arXiv:2508.05118).

A strict, binary function-call reward: 1.0 when the completion's function calls match the gold calls exactly --
the same functions with the same arguments (names and values) -- and 0.0 otherwise (also when the calls do not
parse). Facts from the paper: the reward is binary and strict; calls are verified structurally, through their
abstract syntax tree (function name, parameter names, parameter values), not by string comparison.

Where the calls come from: the tool calls TRL parsed from every assistant turn of a multi-turn completion (TRL
``tools`` / ``environment_factory``); for a completion without structured calls, the text of its last assistant
message parsed as Python call expressions with :mod:`ast` (``search(query="Pell")``, or a list of them, BFCL's
format). Gold calls: a dataset column holding a JSON list of ``{"name": ..., "arguments": {...}}`` (the bundled tool
environment's ``gold_calls``).

Entropy-based strategic exploration (the advantage stage; "EGPO" in later versions of the paper): each rollout's
advantage gets a bonus from the mean token entropy ``H_i`` of its chain of thought, clipped so that it never
outweighs -- or flips the sign of -- the outcome advantage: ``A_i' = A_i + lambda clip(H_i, -|A_i|/alpha,
|A_i|/alpha)``, with the paper's ``lambda = 0.4`` (``entropy_weight``) and ``alpha = 2`` (``entropy_clip``). ``H_i``
is computed with no gradient from the current policy (one extra forward at the advantage stage, shared with other
plugins), over the loss tokens of the chain of thought. The official code is not released (its repository,
github.com/BingguangHao/RLFC, holds a README only); the formula and its constants are the paper's as restated by a
published reproduction plan. With token-level advantages (e.g. ``igpo`` before it) the bound ``|A|/alpha`` is per
token, so tool-result and padding tokens (advantage 0) get no bonus.

Reconstructed (options, flagged): multiple calls compared as a multiset (``order="unordered"``; the paper's
parallel-call categories are order-free), values compared after normalisation (numbers by value, strings stripped),
and where the chain of thought ends: the tokens before the ``cot_marker`` text (``</think>``, the paper's Qwen3 think
tags), the whole completion when it has no marker (the rule of the ``pear`` plugin). Not implemented here:
the data-filtering pipeline. The neutral setting is ``reward_weight = 0`` and ``entropy_weight = 0`` (the column adds
nothing to TRL's sum and the advantages are TRL's, with no extra forward).
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import AdvantageContext, OfficialSource, Plugin, PluginConfigError, PluginOptions, hookimpl, option
from trl_plugins.api.data_checks import cell_problem, check_column_values
from trl_plugins.api.tool_calls import GOLD_CALLS_ALLOWED, call_key, gold_calls_ok, parse_gold_calls

from ._phases import phase_boundary


@dataclass
class FunrlOptions(PluginOptions):
    gold_column: str = option("gold_calls", help="Dataset column with the gold calls (JSON list of {name, arguments}).")
    order: Literal["unordered", "ordered"] = option(
        "unordered", reconstructed=True, help="Compare several calls as a multiset, or in order."
    )
    reward_weight: float = option(1.0, min=0.0, help="TRL weight of the funrl column (0: the neutral setting).")
    entropy_weight: float = option(
        0.4, min=0.0,
        help="lambda of the entropy-based exploration bonus A + lambda clip(H_cot, -|A|/alpha, |A|/alpha) (paper: "
        "0.4; 0: TRL's advantages, no extra forward).",
    )
    entropy_clip: float = option(
        2.0, min=1.0, min_exclusive=True,
        help="alpha of the bonus's bound |A|/alpha (paper: 2); > 1, so the bonus never flips the advantage's sign.",
    )
    cot_marker: str = option(
        "</think>", reconstructed=True,
        help="Text that ends the chain of thought whose mean token entropy is H_cot (the paper's Qwen3 think tags); "
        "a completion without it counts whole.",
    )


def parse_text_calls(text: str) -> list[tuple] | None:
    """Calls written as Python expressions (``f(a=1)`` or ``[f(a=1), g(b="x")]``), via :mod:`ast`; None when the text
    is not a call expression (positional arguments, attribute access and non-literal values do not verify)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        calls.append(call_key(node.func.id, arguments))
    return calls


def completion_calls(completion: Any) -> list[tuple] | None:
    """The calls of a completion: TRL's parsed tool calls of every assistant turn, else the last assistant text."""
    if isinstance(completion, list):
        structured = [
            call_key((c.get("function") or c).get("name"), (c.get("function") or c).get("arguments") or {})
            for message in completion if isinstance(message, dict) and message.get("role") == "assistant"
            for c in message.get("tool_calls") or []
        ]
        if structured:
            return structured
        texts = [m.get("content") for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        text = texts[-1] if texts and isinstance(texts[-1], str) else ""
    else:
        text = str(completion)
    return parse_text_calls(text)


def calls_match(predicted: list[tuple] | None, gold: list[tuple], ordered: bool) -> bool:
    if predicted is None:
        return False
    return predicted == gold if ordered else Counter(predicted) == Counter(gold)


def gold_calls(value: Any) -> list[tuple]:
    return [call_key(c["name"], c["arguments"]) for c in parse_gold_calls(value)]


def entropy_advantages(advantages: torch.Tensor, entropy: torch.Tensor, weight: float, alpha: float) -> torch.Tensor:
    """``A + weight clip(H, -|A|/alpha, |A|/alpha)``.

    Args:
        advantages: (N,) per row or (N, T) per token. entropy: (N,) chain-of-thought mean token entropy per row.
    Returns:
        the shape of ``advantages``.
    """
    H = entropy.to(advantages.dtype)
    H = H if advantages.dim() == 1 else H.unsqueeze(1).expand_as(advantages)
    bound = advantages.abs() / alpha
    return advantages + weight * torch.clamp(H, -bound, bound)


class FunrlPlugin(Plugin):
    name = "funrl"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "Exploring Superior Function Calls via Reinforcement Learning (FunRL), arXiv:2508.05118"
    summary = (
        "Strict binary function-call reward (calls verified against gold calls by their syntax tree) and a clipped "
        "chain-of-thought entropy bonus on the advantages."
    )
    Options = FunrlOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="BingguangHao/RLFC@1297925 holds only a README: the call ordering and the reasoning marker are "
        "reconstructed from the paper's abstract.",
    )
    claim_metric = ("cot_entropy", "mean token entropy of the chain of thought")
    reconstructed = (
        "several calls compared as a multiset",
        "values normalised (numbers by value, strings stripped)",
        "the chain of thought: tokens before cot_marker ('</think>'), the whole completion without it",
    )

    def required_columns(self) -> list[str]:
        return [self.options.gold_column]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        check_column_values(self.name, getattr(trainer, "train_dataset", None), self.options.gold_column,
                            gold_calls_ok, GOLD_CALLS_ALLOWED)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        column, ordered = self.options.gold_column, self.options.order == "ordered"

        def funrl(completions, **kwargs):
            golds = kwargs[column]
            for i, g in enumerate(golds):  # a streamed row (the reward guard raises it on every process together)
                problem = cell_problem("funrl", column, i, g, gold_calls_ok, GOLD_CALLS_ALLOWED)
                if problem:
                    raise PluginConfigError(problem.replace(f" in row {i};", f" in row {i} of the reward call;"))
            return [float(calls_match(completion_calls(c), gold_calls(g), ordered)) for c, g in zip(completions, golds)]

        funrl.reward_weight = self.options.reward_weight
        return [funrl]

    def cot_entropies(self, ctx: AdvantageContext) -> torch.Tensor:
        """(N,) mean policy token entropy of each row's chain of thought (its loss tokens before ``cot_marker``;
        0 for a row with none), from one no-grad forward over this process's rows, gathered."""
        stats = ctx.policy_stats()
        tokenizer = ctx.tokenizer

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=False)

        full = ctx.local_completion_mask  # the completion (tool results included), for the marker search
        lengths = [stats.mask.size(1)] * len(stats.mask) if full is None else full.sum(-1).long().tolist()
        local = []
        for entropies, ids, mask, length in zip(stats.entropies, stats.completion_ids, stats.mask, lengths):
            boundary = phase_boundary(ids[:length].tolist(), decode, self.options.cot_marker)
            cot = mask[:boundary] > 0
            local.append(float(entropies[:boundary][cot].float().mean()) if cot.any() else 0.0)
        return ctx.gather(torch.tensor(local, device=ctx.advantages.device))

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.entropy_weight == 0:
            return
        entropy = self.cot_entropies(ctx).to(ctx.advantages.device)
        before = ctx.advantages
        ctx.advantages = entropy_advantages(before, entropy, o.entropy_weight, o.entropy_clip)
        ctx.log_metric("cot_entropy", float(entropy.mean()))
        ctx.log_metric("entropy_bonus_mean", float((ctx.advantages - before).abs().mean()))
