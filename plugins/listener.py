"""Listener-shaped reward -- a frozen listener re-reads the reasoning (arXiv:2506.22832).

"Listener-Rewarded Thinking in VLMs for Image Preferences": the policy (the *reasoner*) writes a chain of thought and
an answer; an independent **frozen listener** model re-reads the reasoner's chain of thought **without its final
answer** and is scored on how confidently it reaches the answer. That confidence is folded into the reward, so a
correct answer is worth more when its explanation also convinces a second model (and a chain of thought that argues
for another answer than the one given is penalised by a low confidence).

Per completion ``o = (z, y)`` (reasoning ``z``, answer ``y``, split at the first match of ``answer_marker``):

1. The listener reads ``[question + "\\n\\n" + z + answer_prefix]`` and gives the per-token log-probs
   ``log p_L(a_j | ...)`` of the answer tokens ``a = answer_template.format(answer=target)``, where ``target`` is the
   row's reference answer (``target="reference"``) or the reasoner's own answer ``y`` (``target="policy"``, no
   reference needed). The log-probs come from the teacher log-probs component
   (:mod:`trl_plugins.components.teacher_logprobs`): a local Hugging Face model (``teacher="hf"``) or an
   OpenAI-compatible endpoint through the completions API's echo protocol (``teacher="endpoint"``, e.g.
   ``vllm serve``), token for token on the policy's tokenizer (a listener with another tokenizer is refused when the
   trainer is built).
2. Confidence ``c = exp(sum_j log p_L(a_j))`` (the listener's probability of the whole answer,
   ``confidence="sequence"``) or ``mean_j p_L(a_j)`` (``confidence="mean_token"``, robust on long answers).
3. The reward column ``listener`` holds ``c`` in [0, 1]; TRL adds it with weight ``reward_weight`` to the run's other
   columns (the correctness reward of the task), so the total is ``r_correct + w * c``. A completion whose reasoning
   is empty, or (``target="policy"``) that gives no answer, scores 0.

Neutral setting: ``reward_weight=0`` -- the column contributes nothing and training is vanilla GRPO (tested).
Metrics: ``confidence_mean`` (mean ``c``), ``no_answer_fraction`` (completions without the answer marker).

Official code: none was found (searched the public code index for the paper and its listener reward); the method
follows the paper's text and is **reconstructed**: the listener prompt (plain text, question + reasoning +
``Answer:``), the split of the reasoning at the answer marker, the confidence as the answer's sequence probability,
the reference answer as the listener's target, and the additive folding with weight 1. The paper's listener and
reasoner are VLMs reading an image pair; here the listener reads text only, so image prompts are refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, RewardContext, hookimpl, option
from trl_plugins.api.engines import trainer_device
from trl_plugins.api.collectives import gather_objects_together
from trl_plugins.api.data_checks import check_column_filled
from trl_plugins.api.reasons import without_images
from trl_plugins.api.success import placeholder_column
from trl_plugins.api.text import check_template, completion_text
from trl_plugins.components.steps import question_text
from trl_plugins.components.teacher import TeacherOptions, teacher_from_options

COLUMN = "listener"


@dataclass
class ListenerOptions(TeacherOptions):
    """The listener is configured through the teacher options (``teacher``, ``teacher_model``,
    ``teacher_base_url``, ...): it is a teacher whose log-probs are read."""

    plugin_name: ClassVar[str] = "listener"

    target: Literal["reference", "policy"] = option(
        "reference", reconstructed=True,
        help="The answer whose listener probability is the confidence: the row's reference answer (answer_column) "
        "or the reasoner's own answer (the text after answer_marker; no reference needed).",
    )
    confidence: Literal["sequence", "mean_token"] = option(
        "sequence", reconstructed=True,
        help="sequence: exp(sum of the answer tokens' log-probs), the listener's probability of the answer; "
        "mean_token: the mean token probability.",
    )
    answer_column: str = option("answer", help="Dataset column with the reference answer (target='reference').")
    answer_marker: str = option(
        r"(?i)answer\s*:", reconstructed=True,
        help="Regex; the reasoning is the completion before its first match (the answer is not shown to the listener).",
    )
    answer_prefix: str = option("\nAnswer:", reconstructed=True,
                                help="Written after the reasoning in the listener's prompt.")
    answer_template: str = option(" {answer}", reconstructed=True,
                                  help="How the target answer follows answer_prefix ({answer} is replaced).")
    reward_weight: float = option(1.0, min=0.0, reconstructed=True,
                                  help="TRL reward weight of the listener column (0: neutral, vanilla GRPO).")

    def validate(self) -> None:
        super().validate()
        try:
            re.compile(self.answer_marker)
        except re.error as exc:
            raise PluginConfigError(
                f"Plugin 'listener': answer_marker={self.answer_marker!r} is not a valid regex ({exc}).") from exc
        check_template("listener", "answer_template", self.answer_template, ("answer",))


def split_reasoning(text: str, marker: str) -> tuple[str, str | None]:
    """``(reasoning, answer)``: the text before the first match of ``marker`` and the first line after it (None when
    the marker is absent: the whole text is the reasoning)."""
    match = re.search(marker, text)
    if match is None:
        return text.strip(), None
    rest = text[match.end():].strip().splitlines()
    return text[:match.start()].strip(), (rest[0].strip() if rest else "")


def listener_confidence(answer_logps: list[torch.Tensor], mode: str) -> torch.Tensor:
    """(B,) confidence from the listener's per-token log-probs of each answer ((len_b,) tensors): ``exp(sum)``
    (``"sequence"``) or ``mean(exp)`` (``"mean_token"``); an empty answer scores 0."""
    out = []
    for logps in answer_logps:
        if logps.numel() == 0:
            out.append(0.0)
        elif mode == "sequence":
            out.append(math.exp(float(logps.double().sum())))
        else:
            out.append(float(logps.double().exp().mean()))
    return torch.tensor(out, dtype=torch.float32)


class ListenerPlugin(Plugin):
    """Reward column = a frozen listener's confidence in the answer after re-reading the policy's reasoning."""

    name = "listener"
    version = "0.1.0"
    paper = "Listener-Rewarded Thinking in VLMs for Image Preferences, arXiv:2506.22832"
    summary = "Reward + w * a frozen listener's probability of the answer given the policy's reasoning (answer hidden)."
    Options = ListenerOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; the listener re-reading the reasoning and its confidence folded into the "
        "reward follow the paper; the prompt, the split at the answer marker, the sequence probability as the "
        "confidence, the reference answer as target and the additive weight 1 are reconstructed.",
    )
    claim_metric = ("confidence_mean", "mean listener confidence in the answer")
    multi_turn = ("its listener reads one question and one reasoning text; tool calls and tool results are not part "
                  "of what it re-reads.")
    image_inputs = without_images("its listener reads the question and the reasoning as text")
    reconstructed = (
        "listener prompt: question, blank line, the reasoning before the answer marker, then 'Answer:'",
        "confidence = the listener's probability of the whole answer (exp of the summed token log-probs)",
        "target = the reference answer; folded additively into the reward with weight 1",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self.listener = None

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(COLUMN, self.options.reward_weight)]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if o.target == "reference":
            check_column_filled(self.name, getattr(trainer, "train_dataset", None), o.answer_column,
                                "the listener is scored on its probability of the reference answer")
        if self.listener is not None:
            return
        self.listener = teacher_from_options(o, trainer_device(trainer))
        processing = getattr(trainer, "processing_class", None)
        tokenizer = getattr(processing, "tokenizer", processing)
        if tokenizer is None:
            raise PluginConfigError("listener: the trainer has no tokenizer to check the listener's against.")
        self.listener.check_logprobs(tokenizer, probe=o.teacher_probe)

    def _local_confidence(self, ctx: RewardContext) -> list[tuple[float, bool]]:
        """(B,) ``(confidence, has_answer)`` of this process's rows."""
        o, tok = self.options, ctx.tokenizer
        prompts, answers, found = [], [], []
        for row, prompt, completion in zip(ctx.local_rows, ctx.local_prompts, ctx.local_completions):
            reasoning, own = split_reasoning(completion_text(completion), o.answer_marker)
            found.append(own is not None)
            target = own if o.target == "policy" else row.get(o.answer_column)
            if not reasoning or target is None or not str(target).strip():
                prompts.append(None)
                answers.append([])
                continue
            text = f"{question_text(prompt)}\n\n{reasoning}{o.answer_prefix}"
            prompts.append(tok(text, add_special_tokens=False)["input_ids"])
            answers.append(tok(o.answer_template.format(answer=str(target).strip()),
                               add_special_tokens=False)["input_ids"])
        asked = [j for j, p in enumerate(prompts) if p is not None and answers[j]]
        logps = [torch.zeros(0) for _ in prompts]
        if asked:
            scored = self.listener.logprobs([prompts[j] for j in asked], [answers[j] for j in asked])
            for j, lp in zip(asked, scored):
                logps[j] = lp
        return list(zip(listener_confidence(logps, o.confidence).tolist(), found))

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        names = ctx.reward_func_names
        if COLUMN not in names:
            return
        if self.listener is None:
            raise PluginConfigError("listener: no listener model was built (the plugin was not configured).")
        pairs = gather_objects_together(ctx, self.name, self._local_confidence, ctx)
        values = torch.tensor([c for c, _ in pairs], dtype=torch.float32)
        ctx.log_metric("confidence_mean", values.mean().item())
        ctx.log_metric("no_answer_fraction", sum(not f for _, f in pairs) / max(len(pairs), 1))
        matrix = ctx.rewards_per_func.clone()
        matrix[:, names.index(COLUMN)] = values.to(matrix)
        ctx.rewards_per_func = matrix

