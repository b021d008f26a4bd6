"""SLATE: step-normalised advantages of k candidate steps from a shared prefix, winners extending the prefix."""

import functools
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import assert_reduces_to_vanilla, make_advantage_context, make_tiny_trainer, record_run, \
    script_generation
from trl_plugins_builtin.slate import ADV_KEY, LENGTH_KEY, ROUND_KEY, START_KEY, SlatePlugin, first_stop, \
    pick_winner, slate_token_advantages, step_advantages, step_reward

STEPS = {"prm": "programmatic", "step_stops": ["\n"], "answer_stops": []}


def test_step_advantages_are_eq5_within_each_step():
    r = torch.tensor([[2.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    adv = step_advantages(r)
    torch.testing.assert_close(adv[0], torch.tensor([1.0, -1.0, 0.0]) / (1.0 + 1e-6))  # mean 1, unbiased std 1
    torch.testing.assert_close(adv[1], torch.zeros(3))  # a tie teaches nothing


def test_winner_is_greedy_at_eta_zero_and_reward_weighted_otherwise():
    adv = torch.tensor([0.5, 2.0, -1.0])
    assert pick_winner(adv, 0.0) == 1
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([pick_winner(adv, 0.7, gen) for _ in range(3000)]), minlength=3).float()
    torch.testing.assert_close(counts / 3000, torch.softmax(adv / 0.7, 0), atol=0.03, rtol=0)


def test_step_reward_maps_the_prm_score_and_pays_answers_the_outcome_and_bonus():
    assert step_reward(1.0, False, 5.0, 0, 4, 0.1) == 1.0  # an intermediate step: 2 s - 1 only
    assert step_reward(0.0, False, 5.0, 0, 4, 0.1) == -1.0
    assert step_reward(None, False, 0.0, 0, 4, 0.1) == 0.0
    assert step_reward(0.5, True, 1.0, 1, 4, 0.1) == pytest.approx(0.0 + 1.0 + 0.1 * 3 / 4)  # answer at t = 1


def test_first_stop_cuts_just_after_the_first_stop_string():
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    ids = [ord(c) for c in "ab\ncd\n"]
    assert first_stop(ids, ["\n"], decode) == (3, "\n")
    assert first_stop(ids, ["d\n", "c"], decode) == (4, "c")
    assert first_stop(ids, ["x"], decode) == (6, None) and first_stop(ids, [], decode) == (6, None)


def test_token_advantages_train_the_step_and_not_the_prefix():
    out = slate_token_advantages([0, 2], [3, 4], [1.5, -2.0], 5)
    torch.testing.assert_close(out, torch.tensor([[1.5, 1.5, 1.5, 0.0, 0.0], [0.0, 0.0, -2.0, -2.0, 0.0]]))


def test_advantage_hook_places_step_advantages_and_mixes_with_weight():
    notes = [{START_KEY: 0, LENGTH_KEY: 2, ADV_KEY: 1.0, ROUND_KEY: 0}, {START_KEY: 1, LENGTH_KEY: 3, ADV_KEY: -1.0,
                                                                         ROUND_KEY: 1}, {}, {}]
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 1.0, 0.0]), num_generations=2,
                                 completion_lengths=[2, 3, 3, 3], annotations=notes)
    base = ctx.advantages.clone()
    SlatePlugin(SlatePlugin.Options(**STEPS)).trl_plugins_transform_advantages(ctx)
    torch.testing.assert_close(ctx.advantages[0], torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(ctx.advantages[1], torch.tensor([0.0, -1.0, -1.0]))
    torch.testing.assert_close(ctx.advantages[2:], base[2:, None].expand(-1, 3))  # rows without notes keep TRL's
    half = make_advantage_context(torch.tensor([1.0, 0.0, 1.0, 0.0]), num_generations=2,
                                  completion_lengths=[2, 3, 3, 3], annotations=notes)
    SlatePlugin(SlatePlugin.Options(**STEPS, weight=0.5)).trl_plugins_transform_advantages(half)
    torch.testing.assert_close(half.advantages[1], 0.5 * base[1] + 0.5 * torch.tensor([0.0, -1.0, -1.0]))
    evaluation = make_advantage_context(torch.tensor([1.0, 0.0, 1.0, 0.0]), num_generations=2, annotations=notes,
                                        completion_lengths=[2, 3, 3, 3], mode="eval")
    SlatePlugin(SlatePlugin.Options(**STEPS)).trl_plugins_transform_advantages(evaluation)
    torch.testing.assert_close(evaluation.advantages, base)


def test_neutral_setting_switches_every_hook_off_and_is_vanilla():
    stack = build_plugins(["slate"], {"slate": {**STEPS, "weight": 0.0}})
    for hook in ("trl_plugins_generation_prompts", "trl_plugins_after_generation", "trl_plugins_transform_advantages"):
        assert not stack.has(hook), hook
    assert_reduces_to_vanilla("slate", {**STEPS, "weight": 0.0}, loss_types=("grpo",))


def test_bad_options_groups_vllm_and_unmatchable_stops_are_refused():
    for bad, match in (({"k": 1}, "k"), ({"step_stops": [""]}, "step_stops"), ({"eta": -1.0}, "eta"),
                       ({"step_stops": [], "answer_stops": []}, "both empty"),
                       ({"step_stops": ["\n"], "answer_stops": ["\n"]}, "both 'step_stops' and 'answer_stops'"),
                       ({"weight": 1.5}, "weight"), ({"prm_verifier": "nope"}, "nope")):
        with pytest.raises(PluginConfigError, match=match):
            build_plugins(["slate"], {"slate": {"prm": "programmatic", **bad}})
    plugin = SlatePlugin(SlatePlugin.Options(**STEPS))  # k = 5
    with pytest.raises(PluginConfigError, match="k=5 candidates per step does not divide num_generations=4"):
        plugin.trl_plugins_configure(None, SimpleNamespace(num_generations=4))
    with pytest.raises(IncompatiblePluginsError, match="use_vllm=True"):
        plugin.trl_plugins_configure(None, SimpleNamespace(use_vllm=True, num_generations=10))

    class Lossy:  # a tokenizer that cannot write '#': a stop string holding it never matches
        def encode(self, s, add_special_tokens=False):
            return [ord(c) for c in s if c != "#"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    never = SlatePlugin(SlatePlugin.Options(prm="programmatic", step_stops=["#"], answer_stops=[]))
    with pytest.raises(PluginConfigError, match="Stop string '#' of plugin 'slate' can never match"):
        never.trl_plugins_configure(SimpleNamespace(text_tokenizer=Lossy()), SimpleNamespace(num_generations=10))


def test_one_step_on_the_tiny_model_shares_prefixes_and_extends_them_by_winners(tmp_path, monkeypatch):
    """A scripted backend writes steps alternately 'good' and 'bad' (one per line); a function PRM scores 'good' 1."""
    import trl_plugins_builtin.slate as slate_module
    from trl_plugins.components.prm import FunctionPRM

    monkeypatch.setattr(slate_module, "prm_from_options", lambda o: FunctionPRM(
        lambda row, steps: [float(s.startswith("good")) for s in steps], separator="\n"))
    seen = []
    original = SlatePlugin.trl_plugins_after_generation

    @functools.wraps(original)  # keeps the hookimpl marker
    def spy(self, ctx):
        original(self, ctx)
        seen.append(([list(c) for c in ctx.completion_ids], [dict(a) for a in ctx.annotations]))

    monkeypatch.setattr(SlatePlugin, "trl_plugins_after_generation", spy)
    trainer = make_tiny_trainer(max_steps=1, plugins=["slate"], max_completion_length=24,
                                plugin_config={"slate": {**STEPS, "k": 2, "eta": 0.0}}, output_dir=str(tmp_path))
    calls = iter(range(10_000))
    script_generation(trainer, lambda prompt, row: ("good" if next(calls) % 2 == 0 else "bad") + "\nmore\n")
    run = record_run(trainer)
    ids, notes = seen[0]
    tok = trainer.processing_class
    texts = [tok.decode(i, skip_special_tokens=True) for i in ids]
    # G = 4, k = 2, one group: rows 0-1 step 0 (empty prefix; row 0 TRL's sample cut after its first line, row 1
    # the seam's), rows 2-3 step 1 from the step-0 winner (eta = 0: the 'good' candidate)
    assert [n[ROUND_KEY] for n in notes] == [0, 0, 1, 1]
    assert texts[:2] == ["good\n", "bad\n"] and notes[0][START_KEY] == notes[1][START_KEY] == 0
    assert notes[0][ADV_KEY] > 0 > notes[1][ADV_KEY]
    start = notes[2][START_KEY]
    assert start == notes[3][START_KEY] == len(ids[0]) and ids[2][:start] == ids[3][:start] == ids[0]
    assert {t[len("good\n"):] for t in texts[2:]} == {"good\n", "bad\n"}  # one new step each
    assert notes[2][ADV_KEY] == -notes[3][ADV_KEY] != 0
    advantages = run.advantages[0]  # (N, T): the shared prefix is not trained
    assert advantages.dim() == 2 and bool((advantages[2:, :start] == 0).all())
    logs = [log for log in run.logs if "plugins/slate/step_reward_mean" in log]
    assert logs and logs[0]["plugins/slate/extra_rollouts"] == 3 and logs[0]["plugins/slate/chain_steps"] == 2
