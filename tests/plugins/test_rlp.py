"""rlp: information-gain reward of a thought against an EMA no-think baseline, on plain text.

The document split and the eq. 7 advantage are checked on small inputs; the reward exactly against direct forwards of
the tiny policy and of a copy holding the EMA weights; the EMA update against the parameters before and after one
optimizer step; the neutral setting (weight 0, TRL's advantages) reproduces trl.GRPOTrainer; bad settings are refused
at construction."""

import random

import pytest
import torch
from datasets import Dataset
from trl import GRPOTrainer

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.engines import check_engine_support
from trl_plugins.api.errors import IncompatiblePluginsError
from trl_plugins.testing import digit_fraction_reward, make_advantage_context, make_tiny_trainer, record_run, run_hook
from trl_plugins_builtin.rlp import (
    ParameterEMA,
    RlpOptions,
    cut_document,
    document_cuts,
    ema_update_,
    information_gain,
    rlp_advantages,
    split_documents,
)

DOCS = [
    "The sun rises in the east and sets in the west on every single day of the year.",
    "Water boils at one hundred degrees at sea level and freezes at zero on that scale.",
    "Plants need light and water to grow, and they turn carbon dioxide into sugar and oxygen.",
    "too short",
]


def _documents():
    return Dataset.from_dict({"text": DOCS, "source": ["a", "b", "c", "d"]})


# ------------------------------------------------------------------------------------------ data
def test_document_split():
    text = "a bb  ccc dddd e"
    assert cut_document(text, 2, 1, None) == ("a bb", "  ccc")
    assert cut_document(text, 3, 2, 1) == ("ccc", " dddd e")
    assert document_cuts(text, 10, 2, 1, random.Random(0)) == [2, 3, 4]  # every cut leaving 2 words before, 1 after
    assert document_cuts(text, 2, 4, 2, random.Random(0)) == []  # 4 + 2 > 5 words
    assert len(document_cuts(text, 2, 1, 1, random.Random(0))) == 2
    rows = split_documents(_documents(), RlpOptions(contexts_per_document=2), seed=3)
    assert len(rows) == 6  # two rows from each long document, none from "too short"
    for row in rows:
        assert row["prompt"].endswith(" <think>")
        context = row["prompt"][: -len(" <think>")]
        doc = next(i for i, d in enumerate(DOCS) if d.startswith(context + row["continuation"]))
        assert len(context.split()) >= 8 and len(row["continuation"].split()) == 1
        assert row["source"] == "abc"[doc]  # the document's other columns are copied, the document dropped
    assert rows.column_names == ["source", "prompt", "continuation"]
    assert split_documents(_documents(), RlpOptions(contexts_per_document=2), seed=3)["prompt"] == rows["prompt"]
    with pytest.raises(PluginConfigError, match="no document of column 'text' has the 30 \\+ 1 words"):
        split_documents(_documents(), RlpOptions(min_context_words=30), seed=0)


# ------------------------------------------------------------------------------------------ formulas
def test_advantage_is_the_corrected_inclusive_mean():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 0.0, float("nan"), 3.0])
    adv = rlp_advantages(r, 3)
    # G/(G-1) (r - mean): 1.5 * ([1,2,3] - 2); a constant group gives 0; NaN left out of the mean and given 0
    torch.testing.assert_close(adv, torch.tensor([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0, -2.25, 0.0, 2.25]))
    ctx = make_advantage_context(r[:6], num_generations=3)
    run_hook("rlp", "trl_plugins_transform_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, torch.tensor([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0]))
    ctx = make_advantage_context(r[:6], num_generations=3)
    before = ctx.advantages.clone()
    run_hook("rlp", "trl_plugins_transform_advantages", ctx, options={"advantage": "trl"})
    torch.testing.assert_close(ctx.advantages, before, rtol=0, atol=0)


def test_information_gain_and_ema_update():
    gain = information_gain([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
                            [torch.tensor([-2.5, -1.0]), torch.tensor([-0.25])])
    torch.testing.assert_close(gain, torch.tensor([0.5, -0.25]))
    ema = [torch.tensor([1.0, 2.0])]
    ema_update_(ema, [torch.tensor([3.0, 0.0], dtype=torch.bfloat16)], 0.75)
    torch.testing.assert_close(ema[0], torch.tensor([1.5, 1.5]))


def test_parameter_ema_tracks_trainable_parameters_and_swaps_back():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].weight.requires_grad_(False)  # frozen: not averaged
    ema = ParameterEMA(model, decay=0.5)
    ema.init_from_model()
    assert ema.names == ["0.bias", "1.weight", "1.bias"]
    start = [p.detach().clone() for p in (model[0].bias, model[1].weight, model[1].bias)]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    for e, s in zip(ema.values, start):
        torch.testing.assert_close(e, s + 0.5)
    live = [p.detach().clone() for p in model.parameters()]
    with ema.swapped_in():
        torch.testing.assert_close(model[1].bias.detach(), start[2] + 0.5)
        torch.testing.assert_close(model[0].weight.detach(), live[0])  # frozen weights untouched
    for p, q in zip(model.parameters(), live):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    other = ParameterEMA(model, decay=0.5, device="cpu")
    other.load_state_dict(ema.state_dict())
    for a, b in zip(other.values, ema.values):
        torch.testing.assert_close(a, b)
    with pytest.raises(PluginConfigError, match="do not match"):
        other.load_state_dict({"names": ["x"], "values": [torch.zeros(1)]})


# ------------------------------------------------------------------------------------------ reward
def _sum_logprob(model, context, target):
    ids = torch.tensor([context + target])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
    return float(logp[-len(target):].sum())


def test_reward_is_the_information_gain_over_the_ema_baseline(tmp_path):
    rows = split_documents(_documents(), RlpOptions(), seed=0)
    trainer = make_tiny_trainer(plugins=["rlp"], plugin_config={"rlp": {"continuation_tokens": 2}}, dataset=rows,
                                reward_funcs=[], output_dir=str(tmp_path), log_level="error")
    plugin = trainer.plugin_stack.plugins[0]
    func = trainer.reward_funcs[-1]
    prompt, cont = rows[0]["prompt"], rows[0]["continuation"]
    completions = ["the sun goes</think> down", "no close tag at all"]
    plugin.ema.init_from_model()
    gen = torch.Generator().manual_seed(0)
    for v in plugin.ema.values:  # an EMA baseline different from the policy
        v.add_(0.05 * torch.randn(v.shape, generator=gen))
    live = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rewards = func(prompts=[prompt] * 2, completions=completions, completion_ids=[[1]] * 2,
                   continuation=[cont] * 2)
    for n, p in trainer.model.named_parameters():  # the EMA weights were swapped back out
        torch.testing.assert_close(p.detach(), live[n], rtol=0, atol=0)
    tok = trainer.processing_class
    enc = lambda s: tok(text=s, add_special_tokens=False)["input_ids"]  # noqa: E731
    p_ids = trainer.generation_service.tokenize([prompt])[0]
    c_ids = trainer.generation_service.tokenize([prompt[: -len(" <think>")]])[0]
    target = enc(cont)[:2]
    params = dict(trainer.model.named_parameters())
    with torch.no_grad():  # the policy with the EMA weights, loaded by hand
        for n, v in zip(plugin.ema.names, plugin.ema.values):
            params[n].copy_(v)
        s_ema = _sum_logprob(trainer.model, c_ids, target)
        for n, p in params.items():
            p.copy_(live[n])
    for reward, thought in zip(rewards, ["the sun goes</think>", "no close tag at all</think>"]):
        s_pred = _sum_logprob(trainer.model, p_ids + enc(thought), target)
        assert reward == pytest.approx(s_pred - s_ema, abs=1e-5)
    assert rewards[0] != rewards[1]
    with pytest.warns(UserWarning, match="returned None for every one"):  # no continuation column: not applicable
        assert func(prompts=[prompt], completions=["x"], completion_ids=[[1]]) == [None]


def test_ema_follows_the_optimizer_steps_and_checkpoints(tmp_path):
    rows = split_documents(_documents(), RlpOptions(contexts_per_document=2), seed=0)
    trainer = make_tiny_trainer(plugins=["rlp"], plugin_config={"rlp": {"ema_decay": 0.75}}, dataset=rows,
                                reward_funcs=[], output_dir=str(tmp_path), max_steps=1, log_level="error",
                                learning_rate=1e-2)
    plugin = trainer.plugin_stack.plugins[0]
    start = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    end = {n: p.detach().float() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(start[n], end[n]) for n in start)
    for n, v in zip(plugin.ema.names, plugin.ema.values):
        torch.testing.assert_close(v, 0.75 * start[n] + 0.25 * end[n])
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert "plugins/rlp/information_gain" in logs[0] and "plugins/rlp/baseline_logprob" in logs[0]
    state = plugin.trl_plugins_state_dict()
    fresh = build_plugins(["rlp"]).plugins[0]
    fresh.trl_plugins_load_state_dict(state)  # before configure: kept until the model is known
    fresh.trl_plugins_configure(trainer, trainer.args)
    for a, b in zip(fresh.ema.values, plugin.ema.values):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lora_averages_the_adapter_only(tmp_path):
    from peft import LoraConfig

    trainer = make_tiny_trainer(plugins=["rlp"], dataset=_documents(), reward_funcs=[], output_dir=str(tmp_path),
                                log_level="error", peft_config=LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert trainer.train_dataset["prompt"] == split_documents(_documents(), RlpOptions(), seed=0)["prompt"]
    plugin = trainer.plugin_stack.plugins[0]
    plugin.ema.init_from_model()
    assert plugin.ema.names and all("lora_" in n for n in plugin.ema.names)


# ------------------------------------------------------------------------------------------ neutral setting
def test_neutral_setting_is_vanilla(tmp_path):
    rows = split_documents(_documents(), RlpOptions(contexts_per_document=2), seed=0)
    run = dict(dataset=rows, reward_funcs=[digit_fraction_reward], max_steps=2, log_level="error")
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, output_dir=str(tmp_path / "v"), **run))
    ours = record_run(make_tiny_trainer(plugins=["rlp"],
                                        plugin_config={"rlp": {"reward_weight": 0.0, "advantage": "trl"}},
                                        output_dir=str(tmp_path / "p"), **run))
    for x, y in zip(vanilla.completion_ids, ours.completion_ids):
        assert torch.equal(x, y)
    for x, y in zip(vanilla.rewards, ours.rewards):
        torch.testing.assert_close(x, y[:, :1], rtol=0, atol=0)
        assert torch.isfinite(y[:, 1]).all()  # the rlp column was computed, with weight 0
    for x, y in zip(vanilla.advantages, ours.advantages):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(vanilla.losses), torch.tensor(ours.losses), rtol=0, atol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], ours.params[key], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ refusals
def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(PluginConfigError, match="ema_decay"):
        build_plugins(["rlp"], {"rlp": {"ema_decay": 1.5}})
    with pytest.raises(PluginConfigError, match="'thought_close' of plugin 'rlp' got ' '"):
        build_plugins(["rlp"], {"rlp": {"thought_close": " "}})
    with pytest.raises(PluginConfigError, match="neither a 'prompt' column nor the document column 'body'"):
        make_tiny_trainer(plugins=["rlp"], plugin_config={"rlp": {"text_column": "body"}}, dataset=_documents(),
                          reward_funcs=[], output_dir=str(tmp_path))
    with pytest.raises(PluginConfigError, match="prompts must be plain text"):
        make_tiny_trainer(plugins=["rlp"], reward_funcs=[], output_dir=str(tmp_path),
                          dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4,
                                                     "continuation": [" a"] * 4}))
    for engine, name in (("zero3", "ZeRO-3"), ("fsdp2", "FSDP2")):
        with pytest.raises(IncompatiblePluginsError, match=f"rlp: the EMA no-think baseline .* under {name}"):
            check_engine_support(build_plugins(["rlp"]).plugins, engine)
    check_engine_support(build_plugins(["rlp"]).plugins, "zero2")
