"""replay: per-prompt buffers of successful rollouts spliced into later all-fail groups (SPEAR, RAPO).

Hook tests chain the plugin's hooks over several steps on the kit's contexts (the same plugin instance, as in a
run); trainer-level tests check the neutral setting against trl.GRPOTrainer and a checkpoint round trip."""

import hashlib
import io
import math
import os

import pytest
import torch

from trl_plugins import Plugin, PluginConfigError, build_plugins, hookimpl
from trl_plugins.api.contexts import BEHAVIOUR_LOGPS_KEY
from trl_plugins.testing import (
    assert_group_sizes,
    assert_offpolicy_logprobs_nan,
    assert_reduces_to_vanilla,
    build_stack,
    char_encode,
    digit_fraction_reward,
    make_advantage_context,
    make_rollout_context,
    make_tiny_trainer,
    prompt_text,
    run_hook,
    run_on_processes,
    stub_policy_stats,
    stub_rows,
    temporary_plugin,
    tiny_dataset,
)
from trl_plugins_builtin.replay import (
    REPLAY_ADVANTAGE,
    REPLAYED,
    cosine_ramp,
    own_rows_advantages,
    spear_baseline_advantage,
)

G = 4
AFTER = "trl_plugins_after_generation"
ADVANTAGES = "trl_plugins_transform_advantages"


def right(completions, **kwargs):
    """Verifier: 1.0 when the completion says 'right'."""
    return [1.0 if "right" in prompt_text(c) else 0.0 for c in completions]


def rollout(groups, step, first_group=0, **kwargs):
    """A rollout context of the given groups (lists of G texts), groups asking Q{first_group}, Q{first_group+1}..."""
    rows = stub_rows(len(groups), G, first_group=first_group)
    return make_rollout_context(groups, rows=rows, reward_funcs=[right], step=step, **kwargs)


def plugin_of(plugins):
    (plugin,) = list(plugins)
    return plugin


def stack(**options):
    return build_stack("replay", {"replay": options}, num_generations=G)


FAIL = ["no a", "no b", "no c", "no d"]
#: SPEAR's advantages spliced into groups (RAPO's placement) with the per-step replay and no ramp (SPEAR's own
#: placement, gate and ramp are pinned separately).
EVERY_STEP = {"placement": "group", "replay_gate": "always", "replay_coef_warmup_steps": 0}


# ============================================================================================ splice
def test_splice_only_in_all_fail_groups_of_a_prompt_with_a_stored_success():
    s = stack()
    # step 0: Q0 has a success, Q1 fails everywhere but nothing is stored for it yet: no row changes
    ctx0 = run_hook(s, AFTER, rollout([["no", "right 0", "no", "no"], FAIL], step=0))
    assert ctx0.changed == set()
    assert ctx0.metrics["plugins/replay/stored_rollouts"] == [1]
    # step 1: Q0 and Q1 fail everywhere, Q2 (never seen) too; Q3 has a success -> only Q0's group gets the replay
    groups = [FAIL, FAIL]
    ctx1 = run_hook(s, AFTER, rollout(groups, step=1))
    assert ctx1.changed == {0}  # slot replace_index=0 of Q0's group
    assert ctx1.completion_ids[0] == char_encode("right 0")
    assert ctx1.completion_ids[1:] == [char_encode(t) for t in ["no b", "no c", "no d"] + FAIL]
    ctx2 = run_hook(s, AFTER, rollout([FAIL, ["right 3", "no", "no", "no"]], step=2, first_group=2))
    assert ctx2.changed == set()  # Q2 has no stored success, Q3 has its own success
    assert_group_sizes(ctx1, G)
    assert ctx1.metrics["plugins/replay/replayed_group_fraction"] == [0.5]
    assert ctx1.metrics["plugins/replay/all_fail_group_fraction"] == [1.0]


def test_a_group_with_a_success_is_never_spliced_even_with_a_stored_one():
    s = stack()
    run_hook(s, AFTER, rollout([["right a", "no", "no", "no"]], step=0))
    ctx = run_hook(s, AFTER, rollout([["no", "no", "right b", "no"]], step=1))
    assert ctx.changed == set()


def test_replace_index_chooses_the_slot():
    s = stack(replace_index=3)
    run_hook(s, AFTER, rollout([["right a", "no", "no", "no"]], step=0))
    ctx = run_hook(s, AFTER, rollout([FAIL], step=1))
    assert ctx.changed == {3} and ctx.completion_ids[3] == char_encode("right a")


def test_key_column_identifies_prompts_across_wordings():
    s = stack(key_column="id")
    rows0 = stub_rows(1, G, first_group=0, id="p7")
    rows1 = stub_rows(1, G, first_group=5, id="p7")  # another wording, same id
    run_hook(s, AFTER, make_rollout_context([["right a", "no", "no", "no"]], rows=rows0, reward_funcs=[right]))
    ctx = run_hook(s, AFTER, make_rollout_context([FAIL], rows=rows1, reward_funcs=[right], step=1))
    assert ctx.changed == {0}


# ============================================================================================ provenance
@pytest.mark.parametrize("tokens", ["offpolicy", "policy"])
def test_provenance_and_nan_sampling_logprobs_on_the_replayed_row(tokens):
    s = stack(replay_tokens=tokens)
    run_hook(s, AFTER, rollout([["no", "right 0", "no", "no"]], step=0))
    ctx = run_hook(s, AFTER, rollout([FAIL], step=3))
    n = len(char_encode("right 0"))
    assert ctx.offpolicy[0] == [tokens == "offpolicy"] * n
    assert len(ctx.sampling_logprobs[0]) == n and all(math.isnan(x) for x in ctx.sampling_logprobs[0])
    assert ctx.sampling_logprobs[1] == [-1.0] * len(char_encode("no b"))  # own rows keep their log-probs
    assert ctx.prompt_swapped[0] is False
    assert ctx.annotations[0][REPLAYED] is True and ctx.annotations[0]["replay_stored_step"] == 0
    assert ctx.metrics["plugins/replay/replay_age"] == [3.0]
    assert_offpolicy_logprobs_nan(ctx)


@pytest.mark.parametrize("tokens", ["offpolicy", "policy"])
def test_replayed_rows_never_enter_the_buffer(tokens):
    """Only the policy's own rollouts of the step are stored (the replay is spliced after the store): a replay that
    'succeeds' again must not refresh its entry, whatever its provenance flags."""
    s = stack(max_age_steps=2, replay_tokens=tokens)
    run_hook(s, AFTER, rollout([["right a", "no", "no", "no"]], step=0))
    for step in (1, 2):  # replayed in both steps (its tokens are 'right a', a success for the verifier)
        ctx = run_hook(s, AFTER, rollout([FAIL], step=step))
        assert ctx.changed == {0}
        assert ctx.metrics["plugins/replay/stored_rollouts"] == [0]
    ctx = run_hook(s, AFTER, rollout([FAIL], step=3))
    assert ctx.changed == set()  # the step-0 entry expired: its replays did not renew it


# ============================================================================================ staleness / size
def test_staleness_eviction():
    s = stack(max_age_steps=2)
    run_hook(s, AFTER, rollout([["right a", "no", "no", "no"]], step=0))
    assert run_hook(s, AFTER, rollout([FAIL], step=2)).changed == {0}  # 2 steps old: still replayable
    ctx = run_hook(s, AFTER, rollout([FAIL], step=3))
    assert ctx.changed == set()
    assert ctx.metrics["plugins/replay/buffer_prompts"] == [0]  # evicted, prompt dropped


def test_buffer_size_limit_keeps_the_newest():
    s = stack(buffer_size=2)
    plugin = plugin_of(s)
    run_hook(s, AFTER, rollout([["right a", "right b", "right c", "no"]], step=0))
    (entries,) = plugin.buffers.values()
    assert [e["ids"] for e in entries] == [char_encode("right b"), char_encode("right c")]
    run_hook(s, AFTER, rollout([["no", "no", "right d", "no"]], step=1))
    (entries,) = plugin.buffers.values()
    assert [e["ids"] for e in entries] == [char_encode("right c"), char_encode("right d")]
    assert [e["step"] for e in entries] == [0, 1]
    ctx = run_hook(s, AFTER, rollout([FAIL], step=2))
    assert ctx.completion_ids[0] == char_encode("right d")  # pick='latest'


def test_random_pick_is_seeded_and_draws_from_the_buffer():
    picks = []
    for _ in range(2):
        s = stack(buffer_size=3, pick="random")
        run_hook(s, AFTER, rollout([["right a", "right b", "right c", "no"]], step=0))
        picks.append([char_encode_text(run_hook(s, AFTER, rollout([FAIL], step=k)).completion_ids[0])
                      for k in range(1, 9)])
    assert picks[0] == picks[1]  # same seed, same draws
    assert set(picks[0]) <= {"right a", "right b", "right c"} and len(set(picks[0])) > 1


def char_encode_text(ids):
    return "".join(chr(i) for i in ids)


def test_neutral_max_age_zero_never_replays():
    s = stack(max_age_steps=0)
    run_hook(s, AFTER, rollout([["right a", "no", "no", "no"]], step=0))
    ctx = run_hook(s, AFTER, rollout([FAIL], step=1))
    assert ctx.changed == set()


def lucky(completions, **kwargs):
    """A verifier that is deterministic per completion and succeeds on about a third of them."""
    return [1.0 if hashlib.sha1(prompt_text(c).encode()).digest()[0] % 3 == 0 else 0.0 for c in completions]


def test_neutral_setting_reduces_to_vanilla_grpo():
    """Two prompts drawn at every step: with the default options step 3 replays into an all-fail group (checked
    in test_default_setting_replays_in_the_neutral_test_run); with max_age_steps=0 the run is vanilla GRPO."""
    runs = assert_reduces_to_vanilla("replay", {"max_age_steps": 0}, loss_types=("dapo",), steps=3,
                                     reward_funcs=[lucky, digit_fraction_reward], dataset=tiny_dataset(2),
                                     per_device_train_batch_size=8)
    logs = [log for log in runs["dapo"].logs if "plugins/replay/all_fail_group_fraction" in log]
    assert logs[0]["plugins/replay/stored_rollouts"] > 0  # something was stored ...
    assert any(log["plugins/replay/all_fail_group_fraction"] > 0 for log in logs[1:])  # ... and could be replayed
    assert all(log["plugins/replay/replayed_group_fraction"] == 0 for log in logs)


@pytest.mark.slow
def test_default_setting_replays_in_the_neutral_test_run():
    trainer = make_tiny_trainer(reward_funcs=[lucky, digit_fraction_reward], dataset=tiny_dataset(2),
                                per_device_train_batch_size=8, max_steps=3, plugins=["replay"])
    trainer.train()
    replayed = [h["plugins/replay/replayed_group_fraction"] for h in trainer.state.log_history
                if "plugins/replay/replayed_group_fraction" in h]
    assert max(replayed) > 0


# ============================================================================================ advantages
def _replayed_batch(s, step=1):
    """Step 0 stores Q0's success; step ``step`` replays it into Q0's all-fail group (row 0)."""
    run_hook(s, AFTER, rollout([["no", "right a", "no", "no"]], step=0))
    run_hook(s, ADVANTAGES, make_advantage_context([0.0, 1.0, 0.0, 0.0], num_generations=G, step=0))
    return run_hook(s, AFTER, rollout([FAIL], step=step))


def test_group_advantage_is_trls_with_the_replay_as_a_member():
    s = stack()
    ctx = _replayed_batch(s)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])  # what TRL scores on the spliced batch
    actx = make_advantage_context(rewards, num_generations=G, annotations=ctx.annotations, step=1)
    expected = actx.advantages.clone()
    run_hook(s, ADVANTAGES, actx)
    torch.testing.assert_close(actx.advantages, expected)
    assert actx.advantages[0] > 0 and (actx.advantages[1:] < 0).all()


def test_spear_baseline_recalibrates_the_replay_and_leaves_own_rows_as_without_it():
    s = stack(advantage="spear_baseline", **EVERY_STEP)
    plugin = plugin_of(s)
    ctx = _replayed_batch(s)
    assert plugin.group_means == [0.25]  # step 0's group (no replay in it)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    actx = make_advantage_context(rewards, num_generations=G, annotations=ctx.annotations, step=1)
    run_hook(s, ADVANTAGES, actx)
    std = torch.tensor([0.0, 1.0, 0.0, 0.0]).std().item()  # SPEAR's in_group_std: torch's (unbiased) std
    assert actx.advantages[0].item() == pytest.approx((1.0 - 0.25) / (std + 1e-6))
    assert actx.advantages[1:].tolist() == [0.0, 0.0, 0.0]  # all own rows failed: no signal without the replay
    assert plugin.group_means == [0.25, 0.0]  # this step's own rows (replay excluded)


def test_spear_replays_only_over_one_and_a_half_full_and_then_empties_its_buffers():
    # SPEAR's is_full_capacity (size > 1.5 buffer_size) and reset_buffer after the replay; gate_capacity 2: replay
    # once more than 3 rollouts are held. buffer_size 4 per prompt so Q0's successes accumulate.
    s = stack(advantage="spear_baseline", placement="group", gate_capacity=2, buffer_size=4)
    plugin = plugin_of(s)
    run_hook(s, AFTER, rollout([["right a", "right b", "no", "no"]], step=0))  # 2 stored
    ctx = run_hook(s, AFTER, rollout([FAIL], step=1))  # 2 held, not over 3: no replay, entries kept
    assert ctx.changed == set() and sum(map(len, plugin.buffers.values())) == 2
    run_hook(s, AFTER, rollout([["no", "no", "no", "right c"]], step=2))  # 3 held: still not over 3
    ctx = run_hook(s, AFTER, rollout([FAIL], step=3))
    assert ctx.changed == set()
    run_hook(s, AFTER, rollout([["no", "right d", "no", "no"]], step=4))  # 4 held > 3
    ctx = run_hook(s, AFTER, rollout([FAIL, ["right e", "no", "no", "no"]], step=5))  # the replay step
    assert ctx.changed == {0} and ctx.completion_ids[0] == char_encode("right d")  # the newest (pick='latest')
    # emptied when the replay is taken; this step's success (Q1's "right e") is stored after, as SPEAR adds its batch
    assert sum(map(len, plugin.buffers.values())) == 1
    assert ctx.metrics["plugins/replay/buffer_rollouts"] == [1]
    assert run_hook(s, AFTER, rollout([FAIL, FAIL], step=6)).changed == set()
    # the RAPO path ('group') and replay_gate 'always' keep replaying every step
    for options in ({}, {"advantage": "spear_baseline", "placement": "group", "replay_gate": "always"}):
        every = stack(gate_capacity=2, **options)
        run_hook(every, AFTER, rollout([["right a", "no", "no", "no"]], step=0))
        assert run_hook(every, AFTER, rollout([FAIL], step=1)).changed == {0}
        assert run_hook(every, AFTER, rollout([FAIL], step=2)).changed == {0}  # the entry stays


def test_spear_ramp_defaults_to_the_recipe_scripts_300_steps():
    from trl_plugins_builtin.replay import SPEAR_WARMUP_STEPS

    assert SPEAR_WARMUP_STEPS == 300
    assert plugin_of(stack(advantage="spear_decay"))._warmup() == 300
    assert plugin_of(stack())._warmup() == 0  # RAPO: no ramp
    assert plugin_of(stack(advantage="spear_decay", replay_coef_warmup_steps=5))._warmup() == 5


def test_spear_baseline_clamps_negative_advantages_to_zero():
    assert spear_baseline_advantage(0.2, [0.5, 0.9, 0.7], [0.1, 0.1, 0.1], scale_by_std=False) == 0.0
    assert spear_baseline_advantage(1.0, [0.5, 0.9, 0.7], [0.1, 0.3, 0.2], scale_by_std=True) == pytest.approx(
        (1.0 - 0.7) / (0.2 + 1e-6))


def test_spear_decay_uses_the_stored_advantage():
    s = stack(advantage="spear_decay", advantage_decay=0.5, **EVERY_STEP)
    ctx = _replayed_batch(s)
    stored = make_advantage_context([0.0, 1.0, 0.0, 0.0], num_generations=G).advantages[1].item()
    assert ctx.annotations[0][REPLAY_ADVANTAGE] == pytest.approx(stored)
    actx = make_advantage_context([1.0, 0.0, 0.0, 0.0], num_generations=G, annotations=ctx.annotations, step=1)
    run_hook(s, ADVANTAGES, actx)
    assert actx.advantages[0].item() == pytest.approx(0.5 * stored)


def test_replay_coefficient_ramps_on_a_cosine():
    assert cosine_ramp(0, 0) == 1.0 and cosine_ramp(0, 10) == 0.0 and cosine_ramp(10, 10) == 1.0
    assert cosine_ramp(5, 10) == pytest.approx(0.5) and cosine_ramp(50, 10) == 1.0
    s = stack(replay_coef=2.0, replay_coef_warmup_steps=4)
    ctx = _replayed_batch(s, step=1)
    actx = make_advantage_context([1.0, 0.0, 0.0, 0.0], num_generations=G, annotations=ctx.annotations, step=1)
    trl = actx.advantages.clone()
    run_hook(s, ADVANTAGES, actx)
    assert actx.advantages[0].item() == pytest.approx(trl[0].item() * 2.0 * cosine_ramp(1, 4))
    torch.testing.assert_close(actx.advantages[1:], trl[1:])


def test_own_rows_advantages_follow_trls_scaling():
    r = torch.tensor([0.0, 0.5, 1.0])
    torch.testing.assert_close(own_rows_advantages(r, "none", 9.0), r - 0.5)
    torch.testing.assert_close(own_rows_advantages(r, "group", 9.0), (r - 0.5) / (r.std() + 1e-4))
    torch.testing.assert_close(own_rows_advantages(r, "batch", 2.0), (r - 0.5) / (2.0 + 1e-4))


# ============================================================================================ checkpoints
def test_state_round_trip_and_the_resumed_plugin_keeps_replaying():
    s = stack(advantage="spear_baseline", buffer_size=2, **EVERY_STEP)
    _replayed_batch(s)
    state = plugin_of(s).trl_plugins_state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = stack(advantage="spear_baseline", buffer_size=2, **EVERY_STEP)
    plugin_of(resumed).trl_plugins_load_state_dict(torch.load(buffer, weights_only=True))
    assert plugin_of(resumed).buffers == plugin_of(s).buffers
    assert plugin_of(resumed).group_means == plugin_of(s).group_means
    ctx = run_hook(resumed, AFTER, rollout([FAIL], step=2))
    assert ctx.changed == {0} and ctx.completion_ids[0] == char_encode("right a")


def phase_reward(phase):
    def reward(completions, **kwargs):
        return [1.0 if phase["succeed"] else 0.0 for _ in completions]
    return reward


def test_buffers_are_saved_in_checkpoints_and_a_resumed_run_replays_them(tmp_path):
    """A run where everything succeeds saves its buffer at checkpoint-1; the resumed run fails everywhere, so each
    of its groups can only be rescued by what the checkpoint restored."""
    phase = {"succeed": True}
    reward = phase_reward(phase)
    dataset = tiny_dataset(1)
    kw = dict(reward_funcs=[reward], dataset=dataset, plugins=["replay"], output_dir=str(tmp_path),
              save_strategy="steps", save_steps=1)
    first = make_tiny_trainer(max_steps=1, **kw)
    first.train()
    saved = torch.load(os.path.join(tmp_path, "checkpoint-1", "trl_plugins_state.pt"), weights_only=True)
    assert saved["replay"]["buffers"], "the plugin state in the checkpoint holds no buffer"
    phase["succeed"] = False
    resumed = make_tiny_trainer(max_steps=2, **kw)
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "checkpoint-1"))
    plugin = plugin_of(resumed.plugin_stack)
    logged = [h["plugins/replay/replayed_group_fraction"] for h in resumed.state.log_history
              if "plugins/replay/replayed_group_fraction" in h]
    assert logged and logged[-1] == 1.0
    offpolicy = [h["plugins/framework/offpolicy_token_fraction"] for h in resumed.state.log_history
                 if "plugins/framework/offpolicy_token_fraction" in h]
    assert offpolicy and offpolicy[-1] > 0  # the replayed row reached the loss through the off-policy branch
    assert plugin.buffers.keys() == saved["replay"]["buffers"].keys()


# ============================================================================================ processes
def test_two_processes_keep_identical_buffers_and_splice_across_them():
    """G=4 over 2 processes with 2 rows each: a group straddles the processes. The success is on process 1;
    the all-fail group's slot 0, on process 0, receives it."""
    stacks = [stack(), stack()]

    def work(rank, gather):
        texts = [["no", "no"], ["right x", "no"]][rank]
        rows = stub_rows(1, G)[:2]
        run_hook(stacks[rank], AFTER, make_rollout_context(texts, num_generations=G, rows=rows, reward_funcs=[right],
                                                           process_index=rank, gather=gather, step=0))
        ctx = run_hook(stacks[rank], AFTER, make_rollout_context(["no", "no"], num_generations=G, rows=rows,
                                                                 reward_funcs=[right], process_index=rank,
                                                                 gather=gather, step=1))
        return ctx.changed, [list(ids) for ids in ctx.completion_ids], plugin_of(stacks[rank]).buffers

    (changed0, ids0, buf0), (changed1, ids1, buf1) = run_on_processes(2, work)
    assert buf0 == buf1 and len(buf0) == 1
    assert changed0 == {0} and ids0[0] == char_encode("right x")
    assert changed1 == set()


# ============================================================================================ options
@pytest.mark.parametrize("options, match", [
    ({"buffer_size": 0}, "buffer_size"),
    ({"max_age_steps": -1}, "max_age_steps"),
    ({"advantage": "luffy"}, "advantage"),
    ({"replay_tokens": "teacher"}, "replay_tokens"),
    ({"advantage_decay": 0.0}, "advantage_decay"),
    ({"advantage_decay": 1.5}, "advantage_decay"),
    ({"key_column": ""}, "key_column"),
    ({"pick": "oldest"}, "pick"),
])
def test_bad_options_are_refused_at_construction(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["replay"], {"replay": options})


def test_replace_index_outside_the_group_is_refused_at_configure():
    with pytest.raises(PluginConfigError, match=r"replace_index.*0 to 3"):
        stack(replace_index=4)



# ============================================================================================ tool-call reward (SPEAR)
from trl_plugins.api.turns import build_turn_structure  # noqa: E402
from trl_plugins.testing import make_reward_context  # noqa: E402
from trl_plugins_builtin.replay import TOOL_CALL_COLUMN, tool_call_reward, tool_call_schedule  # noqa: E402


def _tool_turns(*calls):
    """A completion with one assistant turn per entry of ``calls`` (the number of tool calls of that turn)."""
    mask, messages = [], []
    for n in calls:
        mask += [1, 1, 0]
        messages += [{"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "search", "arguments": {}}}] * n},
                     {"role": "tool", "name": "search", "content": "doc"}]
    return build_turn_structure(list(range(len(mask) + 2)), mask + [1, 1],
                                messages + [{"role": "assistant", "content": "Answer: 1"}])


def test_tool_call_schedule_follows_spears_cosine_constant_and_none():
    assert tool_call_schedule("none", 0, 200) == 0.0
    assert tool_call_schedule("constant", 10_000, 200) == 1.0
    assert tool_call_schedule("cosine", 0, 200) == pytest.approx(1.0)
    assert tool_call_schedule("cosine", 50, 200) == pytest.approx((math.cos(math.pi / 4) + 1) / 2)
    assert tool_call_schedule("cosine", 100, 200) == pytest.approx(0.5)
    assert tool_call_schedule("cosine", 200, 200) == pytest.approx(0.0)
    assert tool_call_schedule("cosine", 201, 200) == 0.0


def test_tool_call_reward_counts_calling_turns_capped():
    turns = torch.tensor([0, 1, 3, 10, 14])
    assert tool_call_reward(turns, 0.1, 1.0, 1.0).tolist() == pytest.approx([0.0, 0.1, 0.3, 1.0, 1.0])
    assert tool_call_reward(turns, 0.1, 1.0, 0.5).tolist() == pytest.approx([0.0, 0.05, 0.15, 0.5, 0.5])


def test_tool_call_column_counts_turns_that_called_a_tool_and_decays():
    turns = [_tool_turns(), _tool_turns(1), _tool_turns(2, 1), _tool_turns(1, 0)]  # 0, 1, 2, 1 calling turns
    matrix = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    for step, weight in [(0, 1.0), (100, 0.5), (300, 0.0)]:
        ctx = make_reward_context(matrix, num_generations=2, reward_func_names=["accuracy", TOOL_CALL_COLUMN],
                                  turns=turns, step=step)
        run_hook("replay", "trl_plugins_transform_rewards", ctx, {"replay": {"tool_call_reward": "cosine"}})
        assert torch.equal(ctx.rewards_per_func[:, 0], matrix[:, 0])  # the verifier (success) is untouched
        assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([0.0, 0.1 * weight, 0.2 * weight, 0.1 * weight])


def test_tool_call_reward_none_adds_no_column_and_no_hook():
    plugin = plugin_of(build_plugins(["replay"], {"replay": {}}))
    assert not plugin.hook_enabled("trl_plugins_reward_functions")
    assert not plugin.hook_enabled("trl_plugins_transform_rewards")
    on = plugin_of(build_plugins(["replay"], {"replay": {"tool_call_reward": "cosine"}}))
    assert [f.__name__ for f in on.trl_plugins_reward_functions(None)] == [TOOL_CALL_COLUMN]


@pytest.mark.parametrize("options, match", [
    ({"tool_call_reward": "linear"}, "tool_call_reward"),
    ({"tool_call_reward_steps": 0}, "tool_call_reward_steps"),
    ({"tool_call_bonus": -0.1}, "tool_call_bonus"),
    ({"tool_call_cap": -1.0}, "tool_call_cap"),
])
def test_bad_tool_call_options_are_refused_at_construction(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["replay"], {"replay": options})


# ============================================================================================ tool episodes (SPEAR)
class _LossProbe(Plugin):
    """Records, per loss call, the behaviour log-probs riding with the batch and the loss's old log-probs / ratio."""

    name = "test_replay_loss_probe"
    multi_turn = True
    seen: list = []

    @hookimpl
    def trl_plugins_loss(self, ctx):
        behaviour = ctx.inputs.get(BEHAVIOUR_LOGPS_KEY)
        _LossProbe.seen.append({k: None if v is None else v.detach().clone() for k, v in (
            ("behaviour", behaviour), ("old", ctx.old_per_token_logps), ("new", ctx.per_token_logps),
            ("log_ratio", ctx.log_ratio), ("ids", ctx.inputs["completion_ids"]))})


def _replay_of(trainer):
    return next(p for p in trainer.plugin_stack if p.name == "replay")


@pytest.fixture(scope="module")
def tool_replay(tmp_path_factory):
    """Two steps on the bundled tool environment, one prompt, G=4: step 0 succeeds everywhere (gold traces with tool
    calls: the newest success is stored with its behaviour log-probs), step 1 fails everywhere (answers at once), so
    its group receives the stored episode in slot 0."""
    from trl_plugins.tasks.tools import make_tool_dataset
    from trl_plugins.testing import gold_then_wrong_script, make_tool_trainer, record_run

    script, bind = gold_then_wrong_script(make_tool_dataset(1), from_step=1)
    _LossProbe.seen = []
    with temporary_plugin(_LossProbe):
        tr = make_tool_trainer(n=1, plugins=["replay", "test_replay_loss_probe"], max_steps=2, script=script,
                               loss_type="dr_grpo", output_dir=str(tmp_path_factory.mktemp("tool_replay")))
        bind(tr)
        run = record_run(tr)
    return tr, run, list(_LossProbe.seen)


@pytest.mark.slow
def test_a_stored_tool_episode_replays_token_exact_into_an_all_fail_group(tool_replay):
    tr, run, _ = tool_replay
    (entry,) = next(iter(_replay_of(tr).buffers.values()))
    stored = entry["episode"]
    first, second = run.completion_ids  # (G, T) each, padded
    L = len(stored["completion_ids"])
    assert first[3, :L].tolist() == stored["completion_ids"] and 0 in stored["tool_mask"]  # the newest success
    assert second[0, :L].tolist() == stored["completion_ids"]
    assert all(second[j, :L].tolist() != stored["completion_ids"] for j in (1, 2, 3))
    assert run.rewards[1][:, 0].tolist() == [1.0, 0.0, 0.0, 0.0]  # TRL's reward pass scored the replayed messages
    logs = [h for h in tr.state.log_history if "plugins/replay/replayed_group_fraction" in h]
    assert [h["plugins/replay/replayed_group_fraction"] for h in logs] == [0.0, 1.0]


@pytest.mark.slow
def test_a_replayed_episode_trains_against_its_stored_behaviour_logprobs(tool_replay):
    tr, _, seen = tool_replay
    (entry,) = next(iter(_replay_of(tr).buffers.values()))
    stored = entry["episode"]
    calls = [c for c in seen if c["behaviour"] is not None]
    assert calls and all(c["behaviour"] is None for c in seen[: len(seen) - len(calls)])  # step 0 has no replay
    (row,) = [(c, r) for c in calls for r in range(c["ids"].size(0)) if torch.isfinite(c["behaviour"][r]).any()]
    c, r = row
    model = torch.tensor(stored["tool_mask"]) == 1
    L = len(stored["completion_ids"])
    assert c["ids"][r, :L].tolist() == stored["completion_ids"]
    behaviour = torch.tensor(stored["logprobs"], dtype=c["old"].dtype)
    assert torch.equal(c["old"][r, :L][model], behaviour[model])  # the ratio's denominator is pi_behaviour exactly
    assert torch.allclose(c["log_ratio"][r, :L][model], c["new"][r, :L][model] - behaviour[model])
    assert torch.isnan(c["behaviour"][r, :L][~model]).all()  # tool-result tokens keep TRL's (masked anyway)
    others = [j for j in range(c["ids"].size(0)) if j != r]
    assert torch.isnan(c["behaviour"][others]).all()


def test_behaviour_tokens_need_tool_episodes():
    with pytest.raises(PluginConfigError, match=r"replay_tokens.*'behaviour'.*allowed without tools"):
        stack(replay_tokens="behaviour")


@pytest.mark.slow
def test_tool_call_reward_on_real_tool_rollouts():
    from trl_plugins.testing import make_tool_trainer, record_run

    run = record_run(make_tool_trainer(plugins=["replay"], max_steps=1, plugin_config={
        "replay": {"max_age_steps": 0, "tool_call_reward": "constant"}}))
    rewards = run.rewards[0]
    assert rewards.shape[1] == 2
    # the scripted gold traces call one tool per calling turn: lookup questions search once, scaled ones search then
    # compute; shortcut answers call nothing
    assert set(torch.round(rewards[:, 1] * 10).tolist()) <= {0.0, 1.0, 2.0}
    assert (rewards[:, 1] > 0).any()
    assert any("plugins/replay/tool_call_turns_mean" in log for log in run.logs)


# ============================================================================================ SPEAR's replay batch
def _batch_step(s, rewards, step, scheduled, **kwargs):
    """One advantage stage of the batch placement; rows the plugin schedules go into ``scheduled``."""
    ctx = make_advantage_context(torch.tensor(rewards), num_generations=G, step=step,
                                 policy_stats=stub_policy_stats(len(rewards), 4, seed=step),
                                 replay_update=scheduled.extend, **kwargs)
    run_hook(s, ADVANTAGES, ctx)
    return ctx


def test_spear_placement_is_a_replay_batch_by_default_with_a_spear_advantage():
    assert plugin_of(stack(advantage="spear_baseline"))._placement() == "batch"
    assert plugin_of(stack(advantage="spear_decay"))._placement() == "batch"
    assert plugin_of(stack())._placement() == "group"  # RAPO
    assert plugin_of(stack(advantage="spear_baseline", placement="group"))._placement() == "group"
    assert not plugin_of(stack(advantage="spear_baseline")).hook_enabled(AFTER)  # nothing spliced, nothing sampled


def test_spear_batch_stores_positive_advantages_then_trains_the_recalibrated_buffer_when_full():
    """SPEAR's TrajectoryBufferBatch: rows with a positive advantage are stored with their behaviour log-probs; once
    more than 1.5 x buffer_size rows lie above the p50 of the group means, the buffer is recalibrated (r - p50) /
    (p50 std + 1e-6), a random power-of-two subset (at most buffer_size) is scheduled, and the buffer is emptied
    before this step's rows are stored."""
    s = stack(advantage="spear_baseline", gate_capacity=2, replay_coef_warmup_steps=0)
    plugin = plugin_of(s)
    scheduled: list = []
    ctx = _batch_step(s, [1.0, 0.0, 0.0, 0.0], 0, scheduled)
    assert plugin.buffers.total() == 1 and ctx.policy_stats_calls == [False]
    (entry,) = plugin.buffers[0]
    stats = stub_policy_stats(4, 4, seed=0)
    assert torch.equal(entry["ids"], stats.completion_ids[0].to(torch.int32))
    assert torch.equal(entry["logps"], stats.per_token_logps[0].float())
    # compact CPU tensors, not Python lists (about 8 times the memory)
    assert (entry["prompt_ids"].dtype, entry["mask"].dtype, entry["logps"].dtype) == (torch.int32, torch.bool,
                                                                                      torch.float32)
    for field in ("prompt_ids", "ids", "mask", "logps"):  # own storage, not a view keeping the batch alive
        assert entry[field].untyped_storage().nbytes() == entry[field].numel() * entry[field].element_size()
    assert entry["reward"] == 1.0 and entry["advantage"] > 0
    _batch_step(s, [1.0, 1.0, 1.0, 0.0], 1, scheduled)  # 4 held; p50 of means [0.25, 0.75] = 0.5; 4 > 3
    assert scheduled == [] and plugin.buffers.total() == 4
    ctx = _batch_step(s, [0.0, 1.0, 0.0, 0.0], 2, scheduled)
    p50_std = torch.tensor([torch.tensor([1.0, 0, 0, 0]).std(), torch.tensor([1.0, 1, 1, 0]).std()]).quantile(0.5)
    assert len(scheduled) == 2  # the largest power of two <= 4, capped at buffer_size 2
    assert all(r.advantage == pytest.approx((1.0 - 0.5) / (float(p50_std) + 1e-6)) for r in scheduled)
    assert ctx.metrics["plugins/replay/replay_batch_rows"] == [2]
    assert plugin.buffers.total() == 1 and plugin.buffers[0][0]["step"] == 2  # emptied, then step 2's row stored
    assert ctx.advantages.tolist() == make_advantage_context(
        torch.tensor([0.0, 1.0, 0.0, 0.0]), num_generations=G).advantages.tolist()  # the batch's own rows untouched


def test_spear_batch_decay_scales_the_stored_advantage_and_the_ramp_scales_every_row():
    s = stack(advantage="spear_decay", advantage_decay=0.5, replay_gate="always", replay_coef=2.0,
              replay_coef_warmup_steps=4)
    scheduled: list = []
    ctx0 = _batch_step(s, [1.0, 1.0, 0.0, 0.0], 0, scheduled)
    stored = ctx0.advantages[:2].tolist()
    _batch_step(s, [0.0, 0.0, 0.0, 0.0], 2, scheduled)  # 'always': every step, entries kept
    ramp = cosine_ramp(2, 4)
    assert sorted(r.advantage for r in scheduled) == pytest.approx(sorted(a * 0.5 * 2.0 * ramp for a in stored))
    assert plugin_of(s).buffers.total() == 2


def test_spear_batch_skips_replayed_offpolicy_swapped_rows_and_neutral_max_age_zero_never_replays():
    s = stack(advantage="spear_decay", replay_gate="always")
    scheduled: list = []
    _batch_step(s, [1.0, 1.0, 1.0, 0.0], 0, scheduled, offpolicy_fraction=[0.5, 0.0, 0.0, 0.0],
                prompt_swapped=[False, True, False, False])
    assert [e["ids"].tolist() for e in plugin_of(s).buffers[0]] == [stub_policy_stats(4, 4).completion_ids[2].tolist()]
    neutral = stack(advantage="spear_decay", replay_gate="always", max_age_steps=0)
    for step in range(3):
        _batch_step(neutral, [1.0, 0.0, 1.0, 0.0], step, scheduled)
    assert scheduled == []  # every entry expires before a later step could replay it
    nothing = stack(advantage="spear_decay")
    ctx = _batch_step(nothing, [0.0, 0.0, 0.0, 0.0], 0, scheduled)
    assert ctx.policy_stats_calls == []  # nothing to store: no forward


def test_spear_batch_keeps_tool_results_out_of_the_trained_tokens():
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]] * 4)
    s = stack(advantage="spear_decay", replay_gate="always", replay_coef_warmup_steps=0)
    scheduled: list = []
    ctx = make_advantage_context(torch.tensor([1.0, 1.0, 0.0, 0.0]), num_generations=G, step=0,
                                 policy_stats=stub_policy_stats(4, 4, mask=mask), replay_update=scheduled.extend)
    run_hook(s, ADVANTAGES, ctx)
    _batch_step(s, [0.0, 0.0, 0.0, 0.0], 1, scheduled)
    assert len(scheduled) == 2  # SPEAR replays a power of two: a single stored row would replay nothing
    for row in scheduled:
        assert row.loss_mask == [1, 0, 0, 1] and math.isnan(row.old_logprobs[1]) and row.old_logprobs[0] < 0


def test_spear_batch_bad_combinations_are_refused_at_construction():
    with pytest.raises(PluginConfigError, match="'batch' with advantage 'group'"):
        stack(placement="batch")
    with pytest.raises(PluginConfigError, match="replay_tokens' of plugin 'replay' got 'offpolicy' with placement"):
        stack(advantage="spear_decay", replay_tokens="offpolicy")


def test_spear_batch_trains_in_a_real_run_and_round_trips_its_buffer(tmp_path):
    """The tiny trainer with SPEAR's defaults but a small gate: the replay update runs (its framework metrics are
    logged) and the buffer, with its behaviour log-probs, survives a checkpoint."""
    trainer = make_tiny_trainer(
        plugins=["replay"], reward_funcs=[digit_fraction_reward],
        plugin_config={"replay": {"advantage": "spear_decay", "gate_capacity": 1, "replay_coef_warmup_steps": 0}},
        max_steps=4, output_dir=str(tmp_path), log_level="error")
    trainer.train()
    logs = trainer.state.log_history
    replayed = [h for h in logs if h.get("plugins/framework/replay_update_rows")]
    assert replayed and all(h["plugins/framework/replay_update_steps"] >= 1 for h in replayed)
    assert any(h.get("plugins/replay/replay_batch_rows", 0) > 0 for h in logs)
    plugin = trainer.plugin_stack.plugins[0]
    assert plugin.buffers.total() > 0
    for entry in plugin.buffers[0]:  # compact copies: no entry keeps a whole batch's storage alive
        assert all(entry[f].untyped_storage().nbytes() == entry[f].numel() * entry[f].element_size()
                   for f in ("prompt_ids", "ids", "mask", "logps"))
    buf = io.BytesIO()
    torch.save(plugin.trl_plugins_state_dict(), buf)
    buf.seek(0)
    resumed = build_plugins(["replay"], {"replay": {"advantage": "spear_decay"}}).plugins[0]
    resumed.trl_plugins_load_state_dict(torch.load(buf, weights_only=True))
    for a, b in zip(plugin.buffers[0], resumed.buffers[0], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("ids", "mask", "prompt_ids")) and a["step"] == b["step"]
        torch.testing.assert_close(a["logps"], b["logps"], equal_nan=True)


def test_spear_batch_replays_a_buffer_saved_with_lists_as_one_saved_with_tensors():
    """Checkpoints of replay <= 0.5.0 hold Python lists: resumed, they schedule the same rows as tensors do."""
    s = stack(advantage="spear_decay", replay_gate="always", replay_coef_warmup_steps=0)
    plugin = plugin_of(s)
    _batch_step(s, [1.0, 1.0, 0.0, 0.0], 0, [])
    state = plugin.trl_plugins_state_dict()
    as_lists = {**state, "buffers": {k: [{f: v.tolist() if isinstance(v, torch.Tensor) else v for f, v in e.items()}
                                         for e in entries] for k, entries in state["buffers"].items()}}
    rows = []
    for saved in (state, as_lists):
        resumed = stack(advantage="spear_decay", replay_gate="always", replay_coef_warmup_steps=0)
        plugin_of(resumed).trl_plugins_load_state_dict(saved)
        scheduled: list = []
        _batch_step(resumed, [0.0, 0.0, 0.0, 0.0], 1, scheduled)
        rows.append([r.state() for r in scheduled])
    assert len(rows[0]) == 2
    for a, b in zip(*rows, strict=True):
        assert {k: v for k, v in a.items() if k != "old_logprobs"} == {k: v for k, v in b.items() if k != "old_logprobs"}
        torch.testing.assert_close(torch.tensor(a["old_logprobs"]), torch.tensor(b["old_logprobs"]), equal_nan=True)
