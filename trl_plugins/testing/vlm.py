"""A tiny vision-language model, its processor and an image task, all built offline in a second on a CPU.

The kit's counterpart of :func:`trl_plugins.testing.tiny_model` for vision-language GRPO: TRL's ``GRPOTrainer`` takes a
``ProcessorMixin`` as ``processing_class`` and a dataset with an ``image`` (or ``images``) column, turns each prompt into
image + text messages, lets the processor expand the image placeholder into one token per image feature and hands the
model ``pixel_values`` with every forward (generation, old / reference log-probs, loss).

* :func:`tiny_vlm_processor`: a ``LlavaProcessor`` over the kit's character-level tokenizer
  (:func:`trl_plugins.testing.tiny_tokenizer`) with one more special token, ``<image>``, and a ``CLIPImageProcessorPil`` that
  resizes every image to ``IMAGE_SIZE`` x ``IMAGE_SIZE`` pixels (no torchvision needed). Its chat template renders
  text and image parts: ``<|user|><image>Which color?<|assistant|>``, and the processor expands ``<image>`` to
  ``IMAGE_TOKENS`` copies.
* :func:`tiny_vlm`: a freshly initialised ``LlavaForConditionalGeneration`` (a one-layer CLIP vision tower with
  ``PATCH_SIZE`` pixel patches, a projector and a tiny Llama), its special-token ids matching the processor.
* :func:`tiny_image_dataset`: prompts asking for the colour of a solid-colour image, with the ``image`` column of PIL
  images TRL reads, and the gold ``answer``; :func:`color_overlap_reward` is a dense reward on it (non-zero advantages
  on an untrained model).
* :func:`make_vlm_trainer`: a ``PluginGRPOTrainer`` (or ``trl.GRPOTrainer``) on all of that, like
  :func:`trl_plugins.testing.make_tiny_trainer`.

Llava rather than Qwen2-VL: Qwen2-VL's processor needs a video processor, which needs torchvision; Llava's needs only
an image processor, and TRL 1.16 treats both the same way (one ``pixel_values`` row per image).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "COLORS",
    "IMAGE_SIZE",
    "IMAGE_TOKEN",
    "IMAGE_TOKENS",
    "PATCH_SIZE",
    "color_overlap_reward",
    "make_vlm_trainer",
    "tiny_image_dataset",
    "tiny_vlm",
    "tiny_vlm_processor",
    "with_images",
]

IMAGE_TOKEN = "<image>"
#: Side of the (square) images the processor feeds the vision tower, in pixels.
IMAGE_SIZE = 8
#: Side of one vision patch, in pixels.
PATCH_SIZE = 4
#: Image tokens per image in the prompt: one per patch (the vision tower's CLS feature is dropped).
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
#: The task's colours: name -> RGB.
COLORS: dict[str, tuple[int, int, int]] = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255),
                                           "white": (255, 255, 255), "black": (0, 0, 0), "yellow": (255, 255, 0)}

_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>"
    "{%- elif message['role'] == 'user' -%}<|user|>"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>"
    "{%- else -%}{{ raise_exception('unsupported role ' + message['role'] + '; allowed: system, user, assistant') }}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}" + IMAGE_TOKEN + "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""The kit tokenizer's chat template (role marker tokens, ``<|end|>`` closing assistant turns) with list contents: an image part renders as
``<image>``, a text part as its text."""


def _tokenizer():
    """The kit's character-level tokenizer (:func:`trl_plugins.testing.tiny_tokenizer`) with ``<image>`` added as one
    more special token and a chat template that renders image parts."""
    from trl_plugins.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def tiny_vlm_processor():
    """A ``LlavaProcessor``: the character-level tokenizer plus ``<image>``, and a PIL CLIP image processor resizing to
    ``IMAGE_SIZE`` pixels. ``processor.tokenizer`` is the tokenizer; ``processor.image_token_id`` the ``<image>`` id."""
    from transformers import LlavaProcessor
    from transformers.models.clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=_tokenizer(), patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", chat_template=_CHAT_TEMPLATE, image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # the CLS feature, dropped by the "default" strategy
    )


def tiny_vlm(processor=None, seed: int = 0, hidden_size: int = 32, num_layers: int = 2):
    """A freshly initialised tiny ``LlavaForConditionalGeneration`` matching ``processor`` (default
    :func:`tiny_vlm_processor`): CLIP vision tower (one layer, width 16, ``PATCH_SIZE`` patches of ``IMAGE_SIZE``
    images), two-layer projector, Llama language model (``num_layers`` layers, width ``hidden_size``, tied
    embeddings). Generation stops at the tokenizer's EOS and pads with its pad token."""
    from transformers import CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = (processor or tiny_vlm_processor()).tokenizer
    text_config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    vision_config = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE, projection_dim=16,
    )
    config = LlavaConfig(
        text_config=text_config, vision_config=vision_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_select_strategy="default",
        vision_feature_layer=-1, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None, do_sample=False,
        max_new_tokens=64,
    )
    return model


def tiny_image_dataset(n: int = 8, seed: int = 0):
    """``n`` rows ``{"prompt": [user message], "image": PIL image, "answer": colour name}``: a solid ``IMAGE_SIZE``
    square of one of :data:`COLORS`, cycling through them (``seed`` rotates the start)."""
    from datasets import Dataset
    from PIL import Image

    names = list(COLORS)
    rows = {"prompt": [], "image": [], "answer": []}
    for i in range(n):
        name = names[(i + seed) % len(names)]
        rows["prompt"].append([{"role": "user", "content": "Which colour is this image?"}])
        rows["image"].append(Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), COLORS[name]))
        rows["answer"].append(name)
    return Dataset.from_dict(rows)


def with_images(dataset, seed: int = 0):
    """``dataset`` with an ``image`` column added: row ``i`` gets a solid square of the ``(i + seed)``-th of
    :data:`COLORS` (cycling). Turns any text task (e.g. :func:`trl_plugins.testing.tiny_dataset`, whose columns the
    built-in plugins read) into image prompts for :func:`tiny_vlm`."""
    from datasets import Dataset, Features
    from datasets import Image as ImageFeature
    from PIL import Image

    colors = list(COLORS.values())
    images = [Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), colors[(i + seed) % len(colors)]) for i in range(len(dataset))]
    features = Features({**dataset.features, "image": ImageFeature()})
    return Dataset.from_dict({**dataset.to_dict(), "image": images}, features=features)


def color_overlap_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """Dense reward of the image task: the fraction of the answer's letters that occur in the completion text, in
    [0, 1] (1 when the colour's name is written out)."""
    from trl_plugins.testing import prompt_text

    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        text = prompt_text(completion).lower()
        rewards.append(sum(ch in text for ch in gold) / len(gold))
    return rewards


def make_vlm_trainer(trainer_cls=None, *, n: int = 8, seed: int = 0, reward_funcs: Sequence[Callable] | None = None,
                     verbose: bool = False, **config: Any):
    """A trainer on :func:`tiny_vlm` with :func:`tiny_image_dataset` and :func:`color_overlap_reward`.
    ``trainer_cls`` defaults to ``PluginGRPOTrainer`` (``trl.GRPOTrainer`` for the vanilla baseline); ``config`` sets
    any (Plugin)GRPOConfig field (``plugins=[...]``, ``loss_type=...``), as in
    :func:`trl_plugins.testing.make_tiny_trainer`."""
    from trl_plugins.testing import make_tiny_trainer

    processor = tiny_vlm_processor()
    return make_tiny_trainer(
        trainer_cls, model=tiny_vlm(processor, seed=seed), tokenizer=processor, dataset=tiny_image_dataset(n, seed),
        reward_funcs=list(reward_funcs) if reward_funcs is not None else [color_overlap_reward], seed=seed,
        verbose=verbose, **config,
    )
