"""Libra-RM -- a reasoning generative reward model as the RL reward on unlabeled data (arXiv:2507.21645).

Libra ("Assessing and Improving Reward Model by Learning to Think") frames reward modelling for hard reasoning as a
**pointwise correctness judgement**: the judge reads a problem and one candidate response, thinks the problem and the
response through (a long reasoning trace, as a reasoning model does), and ends with a binary verdict -- the response
is correct (1) or not (0). No reference answer and no fixed answer format are needed, which is what lets the RL data
grow beyond labelled problems. The paper's Libra Bench scores judges on exactly this task (question, response,
binary correctness label; ``meituan/Libra-Bench`` on the Hugging Face Hub); its Libra-RM models are trained to judge
by rejection-sampling SFT and RL whose reward is whether the judge's verdict matches the label ("verifiable
judging"); downstream, the policy is trained with RL whose reward is the Libra-RM verdict on its responses.

This plugin is that downstream use (the judge's own training is a separate RL run of its own and not a plugin here):
the judge is the shared component :mod:`trl_plugins.components.genrm` (an OpenAI-compatible endpoint such as ``vllm
serve`` of a Libra-RM checkpoint, a local Hugging Face model, or a task's scripted judge) and the verdict is a reward
column named ``libra_rm`` (TRL's weights -- ``reward_weight`` -- and logging apply)::

    v_{i,j}  = the verdict of the j-th sampled judgement of completion i   (1 correct, 0 incorrect; the last
               \\boxed{} of the judge's answer outside its <think> block, which must hold 0 or 1)
    R_i      = mean_j v_{i,j}                                          (aggregate='mean'; k = 1: the verdict itself)
             | the most frequent v_{i,j}, ties 1/2                      (aggregate='majority')

The column is filled at the reward-transform stage on the process holding each row (batched, bounded in concurrency,
cached by prompt and completion so a refill round never pays twice); a judge failing on one process stops every
process together. A judgement without a parsable verdict is counted and logged; above ``genrm_max_unparsable`` of the
batch's samples the step fails naming the judge, the row and the text; a row with no verdict at all gets its group's
mean (a neutral advantage, metric ``unparsable_fraction``) -- never a silent zero.

No official code was found (searched GitHub and the Hub: only the Libra Bench data set is public, no judge prompt,
no Libra-RM weights, no RL recipe), so the judge prompt (our wording of the task the paper describes), the verdict
tag ``\\boxed{1}`` / ``\\boxed{0}``, one judgement per completion (k = 1), the sampling temperature 0.6 and the 8192
token budget of a thinking judge are reconstructed (``trl-plugins show libra_rm``, docs/faithfulness.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from trl_plugins.api import OfficialSource, option
from trl_plugins.api.reasons import POINTWISE_JUDGE_TEXT_ONLY, without_images
from trl_plugins.components.genrm import GenRMOptions, GenRMTemplate, genrm_from_options

from ._pointwise_genrm import PointwiseGenRMPlugin

COLUMN = "libra_rm"

#: The pointwise correctness judgement (our wording of the task Libra describes: no reference answer, think first,
#: then a binary verdict). The verdict is the last ``\\boxed{}`` of the answer; anything but 0 or 1 there is
#: unparsable (the empty group of the second alternative fails the number parse).
LIBRA_TEMPLATE = GenRMTemplate(
    name="libra_rm/correctness",
    system=(
        "You grade a candidate solution to a reasoning problem. You are not given the right answer: work the problem "
        "out yourself, then check the solution's reasoning and its final answer step by step. The solution counts as "
        "correct only when its final answer is right. Close your reply with \\boxed{1} when the solution is correct "
        "or \\boxed{0} when it is not; write nothing after it."
    ),
    user="[Question]\n{question}\n[End of Question]\n\n[Response]\n{response}\n[End of Response]",
    verdict_regex=r"\\boxed\{\s*(?:([01])|[^{}]*)\s*\}",
    low=0.0,
    high=1.0,
)


@dataclass
class LibraRmOptions(GenRMOptions):
    plugin_name: ClassVar[str] = "libra_rm"

    k: int = option(1, min=1, reconstructed=True,
                    help="Sampled verdicts per completion (the paper's RL reward reads one judgement).")
    aggregate: Literal["mean", "majority"] = option(
        "mean", help="How k > 1 verdicts become the reward: 'mean' (share judged correct) or 'majority' (the most "
        "frequent verdict, a tie 1/2). Identical at k = 1.",
    )
    reward_weight: float = option(1.0, min=0.0, help="TRL reward weight of the libra_rm column (0: neutral).")
    genrm_temperature: float = option(0.6, min=0.0, reconstructed=True,
                                      help="Sampling temperature of the judge (a thinking model's usual setting).")
    genrm_max_tokens: int = option(8192, min=1, reconstructed=True,
                                   help="Longest judgement (thinking + verdict) in tokens.")


class LibraRmPlugin(PointwiseGenRMPlugin):
    """Binary correctness verdicts of a reasoning generative RM (Libra-RM) as a reward column."""

    name = "libra_rm"
    version = "0.1.0"
    paper = "Libra: Assessing and Improving Reward Model by Learning to Think, arXiv:2507.21645"
    summary = "Reward = a thinking generative RM's binary verdict that the completion is correct (no reference needed)."
    Options = LibraRmOptions
    column = COLUMN
    score_metric = "judged_correct"
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found (only the Libra Bench data set is public); the pointwise binary correctness "
        "verdict without a reference and its use as the RL reward follow the paper; the prompt, the \\boxed{0/1} tag, "
        "k = 1, the temperature and the token budget are reconstructed.",
        variants=("aggregate",),
    )
    claim_metric = ("judged_correct", "share of completions the judge rates correct")
    multi_turn = POINTWISE_JUDGE_TEXT_ONLY
    image_inputs = without_images("its generative judge reads the prompt as text")
    reconstructed = (
        "prompt wording (solve the problem, check the response, no reference answer)",
        "verdict tag: the last \\boxed{} holds 1 (correct) or 0 (incorrect)",
        "k = 1, temperature 0.6, max 8192 tokens",
        "rows whose judgements hold no verdict get their group's mean (the paper does not say)",
    )

    def build_judge(self):
        o = self.options
        return genrm_from_options(o, LIBRA_TEMPLATE, k=o.k, aggregate=o.aggregate, device=self._device)
