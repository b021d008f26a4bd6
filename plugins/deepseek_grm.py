"""DeepSeek-GRM -- pointwise generative reward modelling with Self-Principled Critique Tuning (SPCT) and meta-RM
guided voting at inference (arXiv:2504.02495).

A generalist generative reward model (GRM) judges each completion in text: it first writes **principles** suited to
the query, then a **critique** of the response against them, and ends with a discrete **score** from 1 to 10. At
inference the paper scales compute by sampling k judgements in parallel and **voting**: the scores of the k samples
are summed, ``S_i = sum_{j=1..k} s_{i,j}`` (range k..10k, finer-grained than one sample). A **meta RM** rates each
sampled principle+critique and only the ``k_meta`` best-rated samples are voted (``MetaRM@k``).

Here the GRM is the shared component :mod:`trl_plugins.components.genrm` (an OpenAI-compatible endpoint such as
``vllm serve`` of a DeepSeek-GRM checkpoint, a local Hugging Face model, or a task's scripted judge) and the voted
score is a reward column named ``deepseek_grm`` (TRL's weights -- ``reward_weight`` -- and logging apply)::

    s_{i,j}  = the score in the j-th sampled judgement of completion i          (1..10, parsed from \\boxed{s})
    kept_i   = the meta_keep samples of i the meta RM rates highest             (meta_rm='genrm'; all k otherwise)
    R_i      = k * mean_{j in kept_i} s_{i,j}                                   (the vote: the sum over k samples)

The column is filled at the reward-transform stage on the process holding each row (batched, bounded in concurrency,
cached by prompt and completion so a refill round never pays twice); a judge failing on one process stops every
process together. A judgement without a parsable score is counted and logged; above ``genrm_max_unparsable`` of the
batch's samples the step fails naming the judge, the row and the text; a row with no score at all gets its group's
mean (a neutral advantage, metric ``unparsable_fraction``) -- never a silent zero.

No official code was found (the paper's GRM and meta RM are trained models; the prompts below are our wording of the
paper's pointwise format): the templates, the meta RM as the same judge asked to rate a judgement (the paper trains a
separate scalar meta RM), k = 8 and meta_keep = k / 2 (the paper reports k up to 32 with k_meta = k / 2), and the
sampling temperature 0.5 are reconstructed (``trl-plugins show deepseek_grm``, docs/faithfulness.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from trl_plugins.api import OfficialSource, PluginConfigError, option
from trl_plugins.api.reasons import POINTWISE_JUDGE_TEXT_ONLY, without_images
from trl_plugins.components.genrm import GenRMOptions, GenRMTemplate, genrm_from_options

from ._pointwise_genrm import PointwiseGenRMPlugin

COLUMN = "deepseek_grm"

#: The pointwise principle + critique + score prompt (our wording of DeepSeek-GRM's pointwise format).
GRM_TEMPLATE = GenRMTemplate(
    name="deepseek_grm/pointwise",
    system=(
        "You are an expert evaluator of AI assistant responses. First write the principles that matter for judging "
        "a response to this particular question (each with a weight of importance). Then critique the response "
        "against each principle in turn. Finally give the response a score from 1 (worst) to 10 (best), written "
        "as \\boxed{score} at the very end."
    ),
    user="[Question]\n{question}\n[End of Question]\n\n[Response]\n{response}\n[End of Response]",
    verdict_regex=r"\\boxed\{\s*(\d+(?:\.\d+)?)\s*\}",
    low=1.0,
    high=10.0,
)

#: The meta-RM prompt: is a sampled judgement (principles + critique + score) sound? (reconstructed: the paper's meta
#: RM is a trained scalar model).
META_TEMPLATE = GenRMTemplate(
    name="deepseek_grm/meta",
    system=(
        "You check the work of another evaluator. Below are the request it judged and its judgement (principles, "
        "critique and score). Decide how sound the judgement is: are its principles relevant, its critique accurate "
        "and its score consistent with the critique? Rate it from 1 (unsound) to 10 (fully sound), written as "
        "\\boxed{rating} at the very end."
    ),
    user="[Judged request]\n{question}\n[End of Judged request]\n\n[Judgement]\n{response}\n[End of Judgement]",
    verdict_regex=r"\\boxed\{\s*(\d+(?:\.\d+)?)\s*\}",
    low=1.0,
    high=10.0,
)


@dataclass
class DeepseekGrmOptions(GenRMOptions):
    plugin_name: ClassVar[str] = "deepseek_grm"

    k: int = option(8, min=1, reconstructed=True, help="Sampled judgements per completion, voted (the paper: up to 32).")
    meta_rm: Literal["genrm", "none"] = option(
        "genrm", help="Meta-RM guided voting: the judge rates each sampled judgement and the meta_keep best are voted "
        "('genrm'), or every sample is voted ('none': the paper's plain voting).",
    )
    meta_keep: int | None = option(
        None, min=1, reconstructed=True, help="k_meta, the judgements kept by the meta RM (None: k / 2, at least 1).",
    )
    reward_weight: float = option(1.0, min=0.0, help="TRL reward weight of the deepseek_grm column (0: neutral).")
    genrm_temperature: float = option(0.5, min=0.0, reconstructed=True,
                                      help="Sampling temperature of the judgements (parallel samples must differ).")
    genrm_max_tokens: int = option(1024, min=1, reconstructed=True,
                                   help="Longest judgement (principles + critique + score) in tokens.")

    def validate(self) -> None:
        super().validate()
        if self.meta_keep is not None and self.meta_keep > self.k:
            raise PluginConfigError(
                f"Plugin 'deepseek_grm': meta_keep={self.meta_keep} is more than k={self.k}; allowed: 1 to k.")

    def kept(self) -> int:
        return self.meta_keep if self.meta_keep is not None else max(1, self.k // 2)


class DeepseekGrmPlugin(PointwiseGenRMPlugin):
    """Voted pointwise principle + critique + score judgements of a generative RM as a reward column."""

    name = "deepseek_grm"
    version = "0.1.0"
    paper = "Inference-Time Scaling for Generalist Reward Modeling (DeepSeek-GRM, SPCT), arXiv:2504.02495"
    summary = "Reward = the vote (sum) of k sampled principle+critique+score judgements, filtered by a meta RM."
    Options = DeepseekGrmOptions
    column = COLUMN
    score_metric = "score_mean"
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; the pointwise format, the voting (sum of k scores) and meta-RM guided "
        "voting follow the paper; the prompts, k, k_meta = k/2, the temperature and the meta RM as a prompted judge "
        "are reconstructed.",
    )
    claim_metric = ("score_mean", "mean voted judge score")
    multi_turn = POINTWISE_JUDGE_TEXT_ONLY
    image_inputs = without_images("its generative judge reads the prompt as text")
    reconstructed = (
        "prompt wording (principles, critique, \\boxed{score} from 1 to 10)",
        "meta RM = the same judge asked to rate each sampled judgement (the paper trains a scalar meta RM)",
        "k = 8, meta_keep = k / 2, temperature 0.5, max 1024 tokens",
        "rows whose k judgements hold no score get their group's mean (the paper does not say)",
    )

    def build_judge(self):
        o = self.options
        meta = o.meta_rm == "genrm"
        return genrm_from_options(o, GRM_TEMPLATE, k=o.k, aggregate="vote", device=self._device,
                                  meta_template=META_TEMPLATE if meta else None, meta_keep=o.kept() if meta else None)
