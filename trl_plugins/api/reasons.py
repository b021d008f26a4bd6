"""Reasons several plugins give, kept in one place so that the same situation reads the same everywhere.

* Why a plugin cannot run on multi-turn tool rollouts (:attr:`trl_plugins.Plugin.multi_turn`): it edits completions
  after generation (:func:`edits_completions`, :data:`EDITS_COMPLETIONS`), or it drops groups for the refill stage
  (:data:`REFILLS_GROUPS`).
* Why a plugin cannot run on image prompts (:attr:`trl_plugins.Plugin.image_inputs`): what it runs on the prompt's
  text or token ids alone, without the image (:func:`without_images`).
* Why two plugins are refused together (:attr:`trl_plugins.Plugin.conflict_reason`, "pick one"): one reason per family
  of plugins acting on the same quantity, so a plugin of the family names it here rather than importing a peer.
"""

from __future__ import annotations

__all__ = [
    "samples_outside_hf_generate",
    "ADVANTAGE_PICK_ONE",
    "CORRECTNESS_PICK_ONE",
    "EDITS_COMPLETIONS",
    "IMAGES_DEFERRED_ROWS",
    "IMAGES_GENERATION_SERVICE",
    "IMAGES_POLICY_PROBE",
    "IMAGES_REFILL",
    "IMAGES_TEXT_TEACHER",
    "ENTROPY_PICK_ONE",
    "LENGTH_COUNTS_TOOL_TOKENS",
    "POINTWISE_JUDGE_TEXT_ONLY",
    "LIKELIHOOD_PICK_ONE",
    "REFILLS_GROUPS",
    "VLLM_BRANCHING",
    "VLLM_TOOL_EPISODES",
    "edits_completions",
    "without_images",
]


def edits_completions(how: str = "replace_row / splice / in-step generation") -> str:
    """The multi-turn refusal of a plugin that edits completions after generation (``how``: what it does to them)."""
    return (
        f"it edits completions after generation ({how}), and the generation service samples single-turn text without "
        "running tools, so the edited rows would lose their tool-call turns."
    )


#: The multi-turn refusal of the plugins that replace, splice or re-generate completions after generation.
EDITS_COMPLETIONS = edits_completions()

#: The multi-turn refusal of the plugins that drop groups for the refill stage.
REFILLS_GROUPS = (
    "it rejects groups for the refill stage, which regenerates whole groups through the generation service (no tool "
    "loop); the trainer refuses refill with tools."
)

#: Why the branching seam (``ctx.continue_prefixes``) runs on TRL's HF-generate backend only; plugins that use it give
#: this reason when they are refused with vLLM or transformers' continuous batching.
VLLM_BRANCHING = (
    "the branching seam (ctx.continue_prefixes) needs a per-request max_new_tokens, stop strings and the policy's "
    "distribution at given steps; TRL's vLLM client (and transformers' continuous batching path) takes one set of "
    "sampling parameters for the whole call and returns no distribution at a step, so it runs on TRL's HF-generate "
    "backend only: set use_vllm=False (and use_transformers_continuous_batching=False)."
)


def samples_outside_hf_generate(args) -> bool:
    """Whether ``args`` (a GRPOConfig) samples outside TRL's HF-generate backend -- vLLM or transformers' continuous
    batching -- where the branching and tool-episode seams are refused (:data:`VLLM_BRANCHING`)."""
    return bool(getattr(args, "use_vllm", False) or getattr(args, "use_transformers_continuous_batching", False))


#: Why the tool-episode seam (``ctx.continue_tool_episodes``) runs on TRL's HF-generate backend only.
VLLM_TOOL_EPISODES = (
    "the tool-episode seam (ctx.continue_tool_episodes) pads every tool round of TRL's tool loop with dummy requests "
    "so that the processes generate in lockstep, and scores the new tokens with a teacher-forced forward of the "
    "training weights; it is built and tested on TRL's HF-generate backend only (TRL's vLLM server client also gathers "
    "and slices every call across processes on its own, and its colocate engine holds weights synced once per step), "
    "so it runs there only: set use_vllm=False (and use_transformers_continuous_batching=False)."
)

def without_images(what: str) -> str:
    """The image-prompt refusal of a plugin that runs ``what`` without the prompt's image (TRL passes the image's pixel
    values only with the batch's own generation and forwards; the framework services that take text or token ids
    -- the generation service, the refill and deferred-row rounds, the no-grad policy probes on given ids -- carry
    none)."""
    return f"{what}, which would not see the prompt's image (only TRL's own generation and forwards carry it)."


#: The image-prompt refusal of the plugins that sample extra completions within the step.
IMAGES_GENERATION_SERVICE = without_images(
    "it samples completions within the step through the generation service, from the prompt's token ids alone"
)

#: The image-prompt refusal of the plugins that drop groups for the refill stage.
IMAGES_REFILL = without_images(
    "it rejects groups for the refill stage, whose rounds regenerate whole groups from the prompt's token ids alone"
)

#: The image-prompt refusal of the plugins that defer rows to a later generation round.
IMAGES_DEFERRED_ROWS = without_images(
    "it defers rows to a later generation round (PromptContext.defer), which samples them from the prompt's token ids "
    "alone"
)

#: The image-prompt refusal of the plugins that run the policy on token ids they choose.
IMAGES_POLICY_PROBE = without_images(
    "it runs the policy on token ids it chooses (ctx.policy_logprobs / ctx.policy_entropies / ctx.policy_features)"
)

#: The image-prompt refusal of the plugins whose teacher (a language model or endpoint) reads the prompt as text.
IMAGES_TEXT_TEACHER = without_images("its teacher writes or scores text from the prompt's text alone")


#: The multi-turn refusal of the pointwise generative judges (deepseek_grm, libra_rm).
POINTWISE_JUDGE_TEXT_ONLY = (
    "its judge reads one question and one answer text; tool calls and tool results are not part of the judged "
    "response."
)

#: The multi-turn refusal of the length-efficient reasoning plugins (laser, dler, decs, pear, siri, hbpo).
LENGTH_COUNTS_TOOL_TOKENS = (
    "its length reward counts completion_ids, which in tool rollouts include the tool-result tokens the model did not "
    "write."
)

#: clip_cov, kl_cov, lp_reg, siren, epo, hapo: remedies for entropy collapse.
ENTROPY_PICK_ONE = (
    "each is a complete remedy for entropy collapse acting on an overlapping set of tokens (high-covariance, "
    "low-probability or high-entropy ones); stacked, their corrections compound and match neither paper"
)

#: gtpo, llds: protecting the likelihood of good responses' tokens.
LIKELIHOOD_PICK_ONE = (
    "both protect the likelihood of tokens in good responses (GTPO the tokens good and bad completions share, LLDS "
    "the tokens whose likelihood dropped), so stacked they protect the same tokens twice; LLDS is meant for "
    "tool/search RL"
)

#: rlpr, empo: replacing the correctness reward.
CORRECTNESS_PICK_ONE = (
    "both replace the correctness reward (EMPO with answer agreement, without references; RLPR with the policy's "
    "probability of the reference answer); choose by whether your dataset has reference answers"
)

#: hapo (token-level advantage), canon, prl, riskpo: advantage estimators computing the advantages from scratch.
ADVANTAGE_PICK_ONE = (
    "both compute the advantages from scratch (the later one would silently discard the other's); pick one advantage "
    "estimator"
)
