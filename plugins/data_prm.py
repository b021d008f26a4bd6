"""DataPRM -- an environment-aware generative process reward model with a ternary step verdict (arXiv:2604.24198).

A generative judge reads the question, the steps taken so far and one step, and gives that step a **reflection-aware
ternary verdict**: correct, a minor error the agent can still correct (exploration, a grounding slip it fixes later),
or a fatal error. Facts from the official code (zjunlp/DataMind@4b49ef0, ``dataprm/evaluate/``):

1. Verdicts (``prompt.py:5-8``): ``1`` correct and reasonable, ``0.5`` generally correct with details omitted or
   minor errors that later steps can easily fix, ``0`` fatal errors or severe omissions. The judge ends with
   ``<score>...</score>``; the last one counts and anything outside {1, 0.5, 0} is unparsable (``run_eval.py:81-98``).
2. A step ("paragraph") is one assistant message **with the environment's answer to it** (the interpreter output,
   ``run_eval.py:39-50``); the judge sees the earlier paragraphs (``run_eval.py:60-65``) and the last step is flagged
   "Note: This is the final step." (``run_eval.py:70-71``).
3. Judge sampling: one verdict per step (``--sample_num 1``), temperature 0.7, top-p 0.9, top-k 20
   (``run_eval.py:380-384``), answers up to 8192 tokens (``llm.py:35``).

The official repository releases the judge's evaluation (Best-of-N) and its SFT, not the RL integration the paper
reports; how verdicts become training signal here is **reconstructed**: each step's verdict is mapped to a step
reward (``correct_reward`` / ``neutral_reward`` / ``wrong_reward``, default the official 1 / 0.5 / 0) and paid to the
step's tokens as a dense token-level reward::

    z_{i,k}  = (r_{i,k} - mean_g(r)) / (std_g(r) + eps)     over all judged steps of the group (normalize=True)
             =  r_{i,k}                                     (normalize=False, e.g. with +1 / 0 / -1)
    A_{i,t}  = A_i + step_weight * z_{i,k(t)}               for t in step k's tokens [end_{i,k-1}, end_{i,k})

where ``A_i`` is TRL's advantage from the reward columns (the outcome) and ``end_{i,k}`` the token just after step k
(tool-result tokens are masked out of the loss anyway). ``step_weight = 0`` is vanilla TRL (the judge is not called).

Steps: with tools (TRL ``tools`` / ``environment_factory``) one step per assistant turn with its tool results (the
official paragraph); without tools the completion text is split at ``step_separator`` (reconstructed). The judge is
the shared component :mod:`trl_plugins.components.genrm` with its ternary step template
(:data:`~trl_plugins.components.genrm.TERNARY_STEP_TEMPLATE`, our wording of the official prompt); an endpoint
(``vllm serve`` of a DataPRM checkpoint), a local model (``genrm="hf"``) or a task's scripted judge. Unparsable
verdicts are counted (metric ``unparsable_fraction``), a step without one gets no dense term, and above
``genrm_max_unparsable`` of a batch's samples the step fails naming the judge, the row and the text.

Deviation: the official judge runs Python against the agent's workspace (up to 10 rounds) before it answers and sees
its own earlier verdicts in the history; here it reads the steps and their tool results only, and the steps of a
batch are judged in one call (no earlier verdicts in the history).

Metrics: ``step_reward_mean``, ``correct_fraction``, ``neutral_fraction``, ``wrong_fraction``,
``unparsable_fraction``, ``steps_mean``, ``dense_advantage_abs_mean``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import ClassVar

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
from trl_plugins.api.engines import trainer_device
from trl_plugins.api.collectives import gather_objects_together
from trl_plugins.api.reasons import without_images
from trl_plugins.api.text import completion_text
from trl_plugins.components.genrm import GenRMOptions, TERNARY_STEP_TEMPLATE, genrm_from_options
from trl_plugins.components.steps import question_text, split_steps, token_boundary

FINAL_NOTE = "Note: This is the final step."


@dataclass
class DataPrmOptions(GenRMOptions):
    plugin_name: ClassVar[str] = "data_prm"

    step_weight: float = option(
        1.0, min=0.0, reconstructed=True,
        help="Weight of the dense step rewards added to TRL's advantages per token (0 = vanilla TRL, no judge call).",
    )
    correct_reward: float = option(1.0, help="Step reward of the verdict 'correct' (official score 1).")
    neutral_reward: float = option(
        0.5, help="Step reward of the verdict 'minor, correctable error' (official score 0.5).")
    wrong_reward: float = option(0.0, help="Step reward of the verdict 'fatal error' (official score 0).")
    normalize: bool = option(
        True, reconstructed=True,
        help="Standardise the step rewards over all judged steps of the group before they reach the tokens.",
    )
    eps: float = option(1e-6, min=0.0, min_exclusive=True, help="Std floor of the step normalisation.")
    k: int = option(1, min=1, help="Sampled verdicts per step, averaged (official --sample_num 1).")
    step_separator: str = option(
        "\n\n", reconstructed=True,
        help="Without tools: the step separator of the completion text (with tools a step is an assistant turn "
        "and its tool results, official).",
    )
    genrm_temperature: float = option(0.7, min=0.0, help="Sampling temperature of the judge (official 0.7).")
    genrm_max_tokens: int = option(8192, min=1, help="Longest judge answer in tokens (official 8192).")

    def validate(self) -> None:
        super().validate()
        values = (self.correct_reward, self.neutral_reward, self.wrong_reward)
        if not all(math.isfinite(v) for v in values) or not (
                self.wrong_reward <= self.neutral_reward <= self.correct_reward and self.wrong_reward < self.correct_reward):
            raise PluginConfigError(
                f"Options correct_reward / neutral_reward / wrong_reward of plugin 'data_prm' are {values!r}; allowed: "
                "finite numbers with wrong_reward <= neutral_reward <= correct_reward and wrong_reward < correct_reward "
                "(a verdict must not pay more than a better one)."
            )
        if not self.step_separator:
            raise PluginConfigError("Option 'step_separator' of plugin 'data_prm' is ''; allowed: a non-empty string.")


def verdict_reward(verdict: float, correct: float, neutral: float, wrong: float) -> float:
    """Step reward of a (mean of k) verdict in [0, 1]: 1 -> ``correct``, 0.5 -> ``neutral``, 0 -> ``wrong``, linear
    in between (k > 1 sampled verdicts average); NaN (no verdict) stays NaN."""
    if math.isnan(verdict):
        return math.nan
    if verdict >= 0.5:
        return neutral + (verdict - 0.5) * 2 * (correct - neutral)
    return wrong + verdict * 2 * (neutral - wrong)


def step_token_rewards(step_rewards: list[list[float]], step_ends: list[list[int]], group_size: int, width: int,
                       normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Dense per-token step rewards (N, width): token t of row i in step k (``end_{k-1} <= t < end_k``, ``end_{-1} =
    0``) gets step k's reward, standardised over the group's judged steps with ``normalize`` (a group with one judged
    step uses std 1). Steps without a verdict (NaN) and tokens after the last step get 0.

    Args:
        step_rewards: N lists r_{i,k}. step_ends: N lists, the token index just after each step (non-decreasing).
        group_size: G (contiguous rows). width: T.
    """
    out = torch.zeros(len(step_rewards), width)
    for g in range(0, len(step_rewards), group_size):
        judged = [r for i in range(g, g + group_size) for r in step_rewards[i] if not math.isnan(r)]
        if not judged:
            continue
        values = torch.tensor(judged, dtype=torch.float64)
        mean = values.mean().item() if normalize else 0.0
        std = (values.std().item() if values.numel() > 1 else 1.0) + eps if normalize else 1.0
        for i in range(g, g + group_size):
            start = 0
            for r, end in zip(step_rewards[i], step_ends[i]):
                end = min(end, width)
                if not math.isnan(r) and end > start:
                    out[i, start:end] = (r - mean) / std
                start = max(start, end)
    return out


def _tool_step_texts(messages: list) -> list[str]:
    """One step per assistant message with the tool results that answer it (official paragraph)."""
    steps: list[str] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        content = content if isinstance(content, str) else ""
        if role == "assistant":
            calls = [c.get("function", c) for c in message.get("tool_calls") or []]
            text = "\n".join([content.strip()] + [f"Tool call: {json.dumps(c, default=str)}" for c in calls]).strip()
            steps.append(text)
        elif role == "tool" and steps:
            steps[-1] += f"\nTool result: {content.strip()}"
    return steps


class DataPrmPlugin(Plugin):
    """Ternary generative step verdicts (DataPRM) paid to each step's tokens as dense rewards."""

    name = "data_prm"
    image_inputs = without_images("its judge reads the question and the steps as text")
    multi_turn = True
    version = "0.1.0"
    paper = ("Rewarding the Scientific Process: Process-Level Reward Modeling for Agentic Data Analysis, "
             "arXiv:2604.24198")
    summary = "Generative PRM gives each step (tool turn) a ternary verdict; dense step rewards on the step's tokens."
    Options = DataPrmOptions
    official = OfficialSource(
        "zjunlp/DataMind", "4b49ef0", verdict="reconstructed",
        files=("dataprm/evaluate/prompt.py", "dataprm/evaluate/run_eval.py", "dataprm/evaluate/llm.py"),
        note="The official code is the judge's evaluation and SFT: the ternary verdict {1, 0.5, 0} and its parsing, "
        "steps = assistant message + interpreter output, judge sampling. The RL use (dense step rewards on the "
        "step's tokens) is reconstructed; the judge does not run code against the environment here.",
        variants=("normalize",),
    )
    claim_metric = ("step_reward_mean", "mean step reward of the judged steps")
    reconstructed = (
        "dense step rewards on each step's tokens added to TRL's advantage (the paper's RL code is not released)",
        "group standardisation of the step rewards (normalize=True)",
        "steps of a text completion split at step_separator",
        "no environment probing by the judge; no earlier verdicts in the history",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.grm = None
        self._device = None
        self._batch: list | None = None

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self._device = trainer_device(trainer)

    def _judge(self):
        if self.grm is None:
            self.grm = genrm_from_options(self.options, TERNARY_STEP_TEMPLATE, k=self.options.k, aggregate="mean",
                                          device=self._device)
        return self.grm

    def _steps(self, ctx: RewardContext, j: int) -> tuple[list[str], list[int]]:
        """Step texts and token ends of local row j."""
        completion = ctx.local_completions[j]
        ids = list(ctx.local_completion_ids[j]) if ctx.local_completion_ids is not None else None
        turns = ctx.local_turns[j] if ctx.local_turns else None
        if turns is not None and turns.num_turns > 1 and not isinstance(completion, str):
            texts = _tool_step_texts(completion)[: turns.num_turns]
            starts = [s for s, _ in turns.assistant_spans[1: len(texts)]]
            return texts, starts + [len(turns.tool_mask)]
        if ids is None:
            raise PluginError(f"{self.name}: dense step rewards need the completions' token ids at the reward stage.")
        text = completion_text(completion)
        spans = split_steps(text, self.options.step_separator)
        tok = ctx.tokenizer
        return [s.text for s in spans], [token_boundary(ids, s.end, lambda x: tok.decode(x, skip_special_tokens=True))
                                         for s in spans]

    def _local_rows(self, ctx: RewardContext) -> list[tuple[list[float], list[int]]]:
        o = self.options
        requests, owners, ends = [], [], []
        for j, prompt in enumerate(ctx.local_prompts):
            question = question_text(prompt) if prompt is not None else ""
            texts, row_ends = self._steps(ctx, j)
            ends.append(row_ends)
            for k, step in enumerate(texts):
                history = "\n".join(f"[Paragraph_{m + 1}]\n{t}\n[/Paragraph_{m + 1}]" for m, t in enumerate(texts[:k]))
                current = f"[Paragraph_{k + 1}]\n{step}\n[/Paragraph_{k + 1}]"
                requests.append((question, history, current + ("\n" + FINAL_NOTE if k == len(texts) - 1 else "")))
                owners.append(j)
        verdicts = self._judge().judge_steps(*zip(*requests)).values if requests else []
        rows: list[tuple[list[float], list[int]]] = [([], e) for e in ends]
        for j, verdict in zip(owners, verdicts):
            rows[j][0].append(verdict_reward(verdict, o.correct_reward, o.neutral_reward, o.wrong_reward))
        return [(scores, e[: len(scores)] if scores else []) for (scores, _), e in zip(rows, ends)]

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        if o.step_weight == 0:
            return
        # (N,) collective; a judge failing on one process stops every process together
        self._batch = gather_objects_together(ctx, self.name, self._local_rows, ctx)
        flat = [r for scores, _ in self._batch for r in scores]
        judged = [r for r in flat if not math.isnan(r)]
        ctx.log_metric("steps_mean", len(flat) / max(len(self._batch), 1))
        ctx.log_metric("unparsable_fraction", (len(flat) - len(judged)) / len(flat) if flat else 0.0)
        ctx.log_metric("step_reward_mean", sum(judged) / len(judged) if judged else 0.0)
        for label, value in zip(("correct", "neutral", "wrong"), (o.correct_reward, o.neutral_reward, o.wrong_reward)):
            ctx.log_metric(f"{label}_fraction", sum(r == value for r in judged) / len(judged) if judged else 0.0)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if o.step_weight == 0:
            return
        if self._batch is None or len(self._batch) != ctx.rewards.numel():
            raise PluginError(f"{self.name}: the reward stage did not record this batch's step verdicts.")
        mask = ctx.completion_mask()
        dense = ctx.add_token_advantages(step_token_rewards(
            [s for s, _ in self._batch], [e for _, e in self._batch], ctx.num_generations, mask.size(1), o.normalize,
            o.eps), o.step_weight)
        ctx.log_metric("dense_advantage_abs_mean", (dense.abs().sum() / mask.float().sum().clamp(min=1)).item())
        self._batch = None
