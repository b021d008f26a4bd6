"""Vision-language GRPO through the plugin trainer (issue 27, item 3).

Image prompts (TRL's ``image`` column) on a tiny Llava built offline (:mod:`trl_plugins.testing.vlm`) train through
``trl.GRPOTrainer`` and ``PluginGRPOTrainer`` alike with no plugin, and with plugins of the reward, advantage and loss
stages. Plugins that would run something without the image (in-step generation, refill or deferred rows, probes on
given token ids, text-only teachers and judges) declare it (``Plugin.image_inputs``) and are refused at construction
with the reason; an undeclared one is stopped by the framework service it calls. The classification of every built-in
is checked: each declares, and (slow) each declared to work trains a step on image prompts.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import hookimpl
from trl_plugins.api.errors import IncompatiblePluginsError, PluginConfigError, PluginError
from trl_plugins.api.plugin import Plugin
from trl_plugins.runtime.manager import available_plugins, build_plugins
from trl_plugins.runtime.trl_seam import replace_trl_method
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_tiny_trainer,
    record_run,
    temporary_plugin,
    tiny_dataset,
)
from trl_plugins.testing.vlm import IMAGE_TOKENS, make_vlm_trainer, tiny_vlm, tiny_vlm_processor, with_images


def _watch_pixels(trainer) -> list:
    """Record, per generation batch, the ``pixel_values`` TRL hands the forwards (None: the batch had no image)."""
    seen = []

    def gen(inputs):
        out = original(inputs)
        seen.append(out.get("pixel_values"))
        return out

    original = replace_trl_method(trainer, "generate_and_score_completions", gen)
    return seen


def _quiet(**config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_vlm_trainer(**config)


@pytest.fixture(scope="module")
def vanilla():
    trainer = make_vlm_trainer(GRPOTrainer)
    pixels = _watch_pixels(trainer)
    return record_run(trainer), pixels


def test_tiny_vlm_processor_expands_the_image():
    processor = tiny_vlm_processor()
    dataset = with_images(tiny_dataset(2))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True, tokenize=False,
    )
    batch = processor(images=[[dataset[0]["image"]]], text=[text], return_tensors="pt")
    assert (batch["input_ids"] == processor.image_token_id).sum() == IMAGE_TOKENS
    out = tiny_vlm(processor)(**batch)
    assert out.logits.shape[-1] == len(processor.tokenizer)


def test_image_prompts_train_the_same_without_plugins(vanilla):
    """No plugin: the plugin trainer is TRL's trainer on image prompts (every recorded quantity equal)."""
    record, pixels = vanilla
    trainer = make_vlm_trainer()
    ours_pixels = _watch_pixels(trainer)
    ours = record_run(trainer)
    assert_runs_equal(record, ours)
    assert len(pixels) == len(ours_pixels) > 0
    assert all(p is not None and p.size(0) == trainer.args.per_device_train_batch_size for p in pixels + ours_pixels)
    assert any(a.abs().sum() > 0 for a in record.advantages)  # not vacuous


def test_loss_plugin_at_neutral_setting_equals_trl(vanilla):
    """lp_reg's default rho selects k = 1 token of a 4x12 batch, i.e. none: the run is TRL's. Its advantage-stage
    head statistics and its loss run on the image batch (the policy probe passes the pixel values)."""
    record, _ = vanilla
    ours = record_run(make_vlm_trainer(plugins=["lp_reg"]))
    assert_runs_equal(record, ours)
    assert [log["plugins/lp_reg/selected_token_fraction"] for log in ours.logs if "loss" in log] == [0.0, 0.0]


@pytest.mark.parametrize(
    ("name", "options", "config", "metric"),
    [
        ("laser", {}, {}, "plugins/laser/"),  # reward stage
        ("canon", {}, {"loss_type": "dr_grpo"}, "plugins/canon/"),  # advantage stage
        # advantage + loss, from the batch's policy statistics (a second micro-step per batch: the policy moves)
        ("kl_cov", {"ratio": 0.02}, {"steps_per_generation": 2}, "plugins/kl_cov/"),
        ("lp_reg", {"kappa": 0.5, "rho": 0.5}, {}, "plugins/lp_reg/"),  # loss stage, acting
    ],
)
def test_plugins_of_each_stage_train_on_image_prompts(name, options, config, metric, vanilla):
    trainer = make_vlm_trainer(plugins=[name], plugin_config={name: options}, **config)
    pixels = _watch_pixels(trainer)
    run = record_run(trainer)
    assert pixels and all(p is not None for p in pixels)
    assert all(math.isfinite(loss) for loss in run.losses)
    assert any(key.startswith(metric) for log in run.logs for key in log), f"{name} logged no metric"
    if not config:  # the plugin acts: not TRL's run (same seed, same completions in the first batch)
        with pytest.raises(AssertionError):
            assert_runs_equal(vanilla[0], run)


class _StatsWitness(Plugin):
    """Records the advantage stage's policy log-probs and the loss stage's (first micro-step: same weights)."""

    name = "stats_witness_test"
    image_inputs = True
    seen: dict = {}

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        stats = ctx.policy_stats()
        self.seen.setdefault("advantage", (stats.completion_ids.clone(), stats.per_token_logps.detach().clone()))

    @hookimpl
    def trl_plugins_loss(self, ctx):
        ids = torch.cat([ctx.inputs["prompt_ids"], ctx.inputs["completion_ids"]], dim=1)
        self.seen.setdefault("loss", (ctx.inputs["completion_ids"].clone(), ctx.per_token_logps.detach().clone(),
                                      ctx.mask.bool().clone(), ids))


def test_advantage_stage_policy_stats_see_the_image():
    """``ctx.policy_stats()`` runs TRL's forward with the batch's image fields: its log-probs equal the loss forward's
    at the first micro-step (TRL passes the pixel values there; rows matched by completion, since TRL shuffles the
    batch into micro-batches); without them the image tokens would be read as text and the two would differ."""
    _StatsWitness.seen = {}
    with temporary_plugin(_StatsWitness):
        trainer = make_vlm_trainer(plugins=["stats_witness_test"], max_steps=1)
        trainer.train()
    adv_ids, adv_logps = _StatsWitness.seen["advantage"]
    loss_ids, loss_logps, mask, _ = _StatsWitness.seen["loss"]
    assert len({tuple(r.tolist()) for r in loss_ids}) == loss_ids.size(0)  # completions identify the rows
    for row in range(loss_ids.size(0)):
        match = [j for j in range(adv_ids.size(0)) if torch.equal(adv_ids[j], loss_ids[row])]
        assert len(match) == 1
        torch.testing.assert_close(adv_logps[match[0]][mask[row]], loss_logps[row][mask[row]], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- refusals
def _declared(reason_or_true):
    return [n for n, cls in sorted(available_plugins().items()) if (cls.image_inputs is True) == reason_or_true]


def test_every_builtin_plugin_declares_image_inputs():
    undeclared = [n for n, cls in available_plugins().items()
                  if getattr(cls, "_distribution", "") != "local" and cls.image_inputs is None]
    assert not undeclared, f"built-in plugins without Plugin.image_inputs: {undeclared}"
    for name, cls in available_plugins().items():
        assert cls.image_inputs is True or (isinstance(cls.image_inputs, str) and cls.image_inputs.endswith(".")), name


#: Options a few plugins need to be built at all (an endpoint or model they would otherwise ask for).
_BUILD_OPTIONS = {"kepo": {"teacher_model": "unused"}, "listener": {"teacher_model": "unused"},
                  "rapo_retention": {"teacher_model": "unused"}, "ruscarl": {"judge": "rule"},
                  "data_prm": {"genrm": "scripted"}, "deepseek_grm": {"genrm": "scripted"},
                  "libra_rm": {"genrm": "scripted"}, "think_rm": {"genrm": "scripted"},
                  "scope": {"mode": "reference_suffix", "prm": "programmatic"}}


@pytest.mark.parametrize("name", _declared(False))
def test_refused_plugin_names_itself_and_its_reason(name):
    cls = available_plugins()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        stack = build_plugins([name], {name: _BUILD_OPTIONS[name]} if name in _BUILD_OPTIONS else None)
    with pytest.raises(IncompatiblePluginsError) as err:
        stack.check_image_inputs()
    assert f"Plugin {name!r} does not work with image prompts (an 'image' / 'images' dataset column): " in str(err.value)
    assert cls.image_inputs in str(err.value)


@pytest.mark.parametrize(
    ("name", "options", "refused"),
    [
        ("empo", {}, False),  # the vote over the G trained rollouts
        ("empo", {"mode": "majority_vote", "vote_pool": 16}, True),  # extra votes through the generation service
        ("scope", {"mode": "reference_suffix", "prm": "programmatic"}, False),  # the dataset's reference text
        ("scope", {"mode": "teacher_suffix", "teacher_base_url": "http://127.0.0.1:1/v1"}, True),  # a text teacher
        ("dno", {}, False),  # the task's scalar reward as the preference oracle
        ("dno", {"genrm": "scripted"}, True),  # a generative judge reads the prompt as text
        ("ettrl", {"fork_points": 0}, False),  # the vote and EAR
        ("ettrl", {}, True),  # ETMR's branches continue through the branching seam, from token ids alone
        ("latr", {"mix_ratios": [0.0]}, False),  # no tree rows: TRL's own sampling
        ("latr", {}, True),  # the tree's forks and lookaheads go through the branching seam, from token ids alone
        ("deepsearch", {"weight": 0.0}, False),  # no tree: TRL's own sampling and advantages
        ("deepsearch", {}, True),  # the tree's nodes go through the branching seam, from token ids alone
    ],
)
def test_refusal_decided_by_options(name, options, refused):
    stack = build_plugins([name], {name: options})
    if refused:
        with pytest.raises(IncompatiblePluginsError, match=f"Plugin {name!r} does not work with image prompts .*: with "):
            stack.check_image_inputs()
    else:
        stack.check_image_inputs()


@pytest.mark.parametrize("name", ["cure", "dynamic_sampling"])
def test_refused_when_the_trainer_is_built(name):
    """At construction (before any model work of TRL): an in-step generation plugin and a refill plugin."""
    with pytest.raises(IncompatiblePluginsError, match=f"Plugin {name!r} does not work with image prompts .*: .+"):
        make_vlm_trainer(plugins=[name])


def test_refusing_plugins_run_on_text_prompts_with_the_vlm():
    """The rule is about the prompts, not the model: a vision-language model on a text-only dataset takes them."""
    processor = tiny_vlm_processor()
    trainer = make_tiny_trainer(model=tiny_vlm(processor), tokenizer=processor, plugins=["cure"],
                                plugin_config={"cure": {"min_token_chars": 1}}, reward_funcs=[digit_fraction_reward])
    assert [p.name for p in trainer.plugin_stack] == ["cure"]
    assert not trainer.image_prompts


class _UndeclaredRefill(Plugin):
    name = "undeclared_refill_test"

    @hookimpl
    def trl_plugins_reject_groups(self, ctx):
        pass


class _UndeclaredGenerator(Plugin):
    name = "undeclared_generator_test"

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        ctx.service.generate(prompts=ctx.prompts[:1])


def test_undeclared_refill_plugin_is_refused_by_the_refill_rule():
    with temporary_plugin(_UndeclaredRefill):
        with pytest.warns(UserWarning, match="does not state whether it works with image prompts"):
            with pytest.raises(PluginConfigError, match=r"undeclared_refill_test.*image prompts \(the refill rounds"):
                make_vlm_trainer(plugins=["undeclared_refill_test"])


def test_undeclared_generation_is_stopped_by_the_generation_service():
    with temporary_plugin(_UndeclaredGenerator):
        trainer = _quiet(plugins=["undeclared_generator_test"], max_steps=1)
        with pytest.raises(PluginError, match="The generation service .* without the prompts' images"):
            trainer.train()


# ------------------------------------------------------------------------------------- every declared plugin runs
#: Settings replaced for the image run: the benchmark's settings that name data the 8-row image dataset lacks
#: (nemotron_cascade's second stage is level 2; these rows are all level 1).
#: dno's benchmark settings use the scripted judge, which reads text only: the image run uses its default (the
#: reward as the preference oracle, declared for image prompts).
_IMAGE_RUN_OPTIONS = {"nemotron_cascade": {"stages": ["1"], "domain_column": "level"}, "dno": {},
                      "ettrl": {"fork_points": 0},  # the vote and EAR (ETMR's trees are refused with images)
                      # their trees / probe rollouts sample through the generation service and are refused with
                      # images (test_refusal_decided_by_options above); what is left runs
                      "latr": {"mix_ratios": [0.0]}, "rex_rag": {"probe_slots": 0}, "deepsearch": {"weight": 0.0}}


@pytest.mark.slow
@pytest.mark.parametrize("name", _declared(True))
def test_every_plugin_declared_for_images_trains_on_image_prompts(name):
    """One optimizer step of each built-in declared ``image_inputs = True`` on image prompts of the arithmetic task
    (its columns are what the plugins read), with the options under which it acts (``scripts/bench_common.py``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from bench_common import PLUGIN_SETTINGS, demo_model_dir, load_demo_model

    if name in ("e_grpo", "funrl", "matchtir"):
        pytest.skip("reads tool-call columns (entities / gold_calls) of the tool task; single-turn image prompts "
                    "have no tool calls to score")
    options, overrides = PLUGIN_SETTINGS.get(name, ({}, {}))
    options = _IMAGE_RUN_OPTIONS.get(name, options)
    if str(demo_model_dir()) in options.values():
        load_demo_model()  # a component model of the settings (e.g. armed's encoder) is the cached demo model
    processor = tiny_vlm_processor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        trainer = make_tiny_trainer(
            model=tiny_vlm(processor), tokenizer=processor, dataset=with_images(tiny_dataset(8)),
            reward_funcs=[digit_fraction_reward], plugins=[name], plugin_config={name: options} if options else {},
            **{"max_steps": 1, **overrides},
        )
    pixels = _watch_pixels(trainer)
    trainer.train()
    assert pixels and all(p is not None for p in pixels)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(math.isfinite(x) for x in losses)
