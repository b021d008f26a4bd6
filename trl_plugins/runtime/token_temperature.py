"""Per-token sampling temperature for TRL's transformers generation (a plugin-set rule, see
:meth:`~trl_plugins.PluginGRPOTrainer.set_token_temperature`).

TRL samples with one temperature ``T`` (``GRPOConfig.temperature``), applied by transformers' temperature warper
before top-k / top-p / min-p. A rule ``rule(logits) -> temperatures`` chooses, at every decoding step, a temperature
per row from that step's logits (e.g. from the next-token entropy). While a rule is set, TRL's ``generate`` call runs
with the temperature / top-k / top-p / min-p warpers neutral, and one logits processor does their work in
transformers' order: it divides the step's logits by the rule's temperatures, then applies top-k, top-p and min-p
with the run's settings. vLLM samples all tokens of a request at one temperature, so a rule cannot be set there.

The training forward (old log-probs, importance ratio, loss) keeps the run's single temperature ``T``: the sampled
tokens are treated as samples of ``pi_T``. A rule that moves the temperature away from ``T`` therefore trains on
slightly off-policy tokens without an importance correction (TRL's transformers path has no sampling log-probs).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from trl_plugins.api.errors import PluginConfigError
from trl_plugins.runtime.generation import transformers_generation_settings

#: ``rule(logits)``: (B, V) float logits of one decoding step -> (B,) positive temperatures.
TemperatureRule = Callable[[torch.Tensor], torch.Tensor]
#: Sampling settings the processor takes over from the generation config (neutral values while it runs).
TAKEN_OVER = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None}  # top_k None would mean 50
#: Warpers with no counterpart in the processor: refused while a rule is set.
UNSUPPORTED = ("typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")


class TokenTemperatureProcessor(LogitsProcessor):
    """Divide each row's logits by ``rule(logits)``, then apply the run's top-k / top-p / min-p warpers (in
    transformers' order).

    Args:
        rule: (B, V) logits -> (B,) temperatures.
        top_k, top_p, min_p: the run's settings (None / 0 / 1.0 = off).
    """

    def __init__(self, rule: TemperatureRule, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None):
        self.rule = rule
        self.warpers: list[LogitsProcessor] = []
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=top_p))
        if min_p is not None:
            self.warpers.append(MinPLogitsWarper(min_p=min_p))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        temperatures = self.rule(scores.float()).to(scores.dtype)
        scores = scores / temperatures.unsqueeze(1)
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        return scores


def processor_for(config: Any, rule: TemperatureRule) -> TokenTemperatureProcessor:
    """The processor that replaces ``config``'s temperature / top-k / top-p / min-p warpers."""
    for name in UNSUPPORTED:
        value = getattr(config, name, None)
        if value is not None and value not in (1.0, 0.0):
            raise PluginConfigError(
                f"A per-token sampling temperature cannot be combined with generation setting {name}={value!r} "
                f"(supported with it: {', '.join(TAKEN_OVER)})."
            )
    return TokenTemperatureProcessor(rule, getattr(config, "top_k", None), getattr(config, "top_p", None),
                                     getattr(config, "min_p", None))


@contextlib.contextmanager
def token_temperature_generation(trainer: Any, rule: TemperatureRule) -> Iterator[None]:
    """Within the block, TRL's transformers ``generate`` samples with ``rule``'s per-token temperatures.

    The taken-over settings are neutral in TRL's generation config and kwargs
    (:func:`~trl_plugins.runtime.generation.transformers_generation_settings`), and the model's ``generate`` gets the
    processor as ``logits_processor`` (set on the unwrapped model instance for the block, removed after). Greedy
    decoding (``do_sample=False``) is left alone: a per-row temperature does not move an argmax.
    """
    config = trainer.generation_config
    if not getattr(config, "do_sample", True):
        yield
        return
    processor = processor_for(config, rule)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    had_own = "generate" in vars(model)
    own = vars(model).get("generate")
    model.generate = functools.partial(model.generate, logits_processor=LogitsProcessorList([processor]))
    try:
        with transformers_generation_settings(trainer, TAKEN_OVER):
            yield
    finally:
        if had_own:
            model.generate = own
        else:
            del model.generate
