"""The tool-episode seam (RolloutContext.continue_tool_episodes / replace_episode): its pure helpers (turn checks, the
cut at the tool-round allowance, the NaN rule of the log-probs, the lockstep rounds against a simulated second
process), and on the tiny tool trainer (scripted backend, TRL's real tool loop): the kept prefix token-exact, the new
turns from the backend after the kept tool results, the environment brought to the boundary, the log-probs against a
teacher-forced forward, the budget count, the turns reaching the later stages, and the refusals."""

import math

import pytest
import torch

from trl_plugins import Plugin, hookimpl
from trl_plugins.api import PluginError
from trl_plugins.runtime.tool_episodes import (
    EpisodeRequest, Lockstep, check_turns, cut_to_rounds, nan_outside_new_turns,
)
from trl_plugins.testing import make_tool_trainer, temporary_plugin

# ------------------------------------------------------------------------------------------------ pure helpers
A1 = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "search",
                                                                                       "arguments": {"query": "x"}}}]}
T1 = {"role": "tool", "name": "search", "content": "doc"}
A2 = {"role": "assistant", "content": "Answer: 3"}


def _request(turn):
    # completion: turn 0 (3 tokens), tool result (2), turn 1 (2)
    return EpisodeRequest(row=0, global_row=4, turn=turn, prompt=[{"role": "user", "content": "q"}], prompt_ids=[9],
                          completion_ids=[1, 2, 3, 7, 7, 4, 5], tool_mask=[1, 1, 1, 0, 0, 1, 1],
                          messages=[A1, T1, A2], data={})


def test_a_request_keeps_the_turns_before_its_boundary():
    assert (_request(0).start, _request(0).kept_messages) == (0, [])
    assert (_request(1).start, _request(1).kept_messages) == (5, [A1, T1])


@pytest.mark.parametrize("turns, message", [
    ([2], "turn 2 for local row 3; allowed: an integer in [0, 2)"),
    ([-1], "turn -1 for local row 3"),
    ([True], "turn True for local row 3"),
    ([0, 1], "2 turns for 1 rows; allowed: one boundary turn per row"),
])
def test_bad_turns_are_refused_naming_the_value(turns, message):
    with pytest.raises(PluginError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_turns(turns, [2], [3])


def test_a_continuation_past_its_tool_rounds_is_cut_after_its_last_allowed_turn():
    ids, mask = [1, 1, 2, 2, 0, 0, 3, 3, 0, 4], [1, 1, 1, 1, 0, 0, 1, 1, 0, 1]
    # new part from index 2: turn (2, 4), result, turn (6, 8), result, turn (9, 10)
    new_messages = [A1, T1, A1, T1, A2]
    assert cut_to_rounds(ids, mask, new_messages, 2, 0) == ([1, 1, 2, 2], [1, 1, 1, 1], [A1])
    assert cut_to_rounds(ids, mask, new_messages, 2, 1) == (ids[:8], mask[:8], [A1, T1, A1])
    assert cut_to_rounds(ids, mask, new_messages, 2, 2) == (ids, mask, new_messages)


@pytest.mark.slow
def test_log_probs_are_nan_on_the_kept_prefix_and_tool_results():
    out = nan_outside_new_turns(torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0]), [1, 1, 1, 0, 1], 1)
    assert [None if math.isnan(x) else x for x in out] == [None, -2.0, -3.0, None, -5.0]


def test_lockstep_pads_every_round_and_drains_until_the_other_process_is_done():
    """A simulated second process still in its tool loop for two more rounds (3 rows, then 1 row)."""
    other = iter([[3, 0], [1, 0], [0, 1]])
    calls = []

    def gather(t):  # this process's (1, 2) row, then the other process's
        return torch.cat([t, torch.tensor([next(other)])])

    def backend(prompt_ids, images, fields, num_generations, has_tool_images=False):
        calls.append(len(prompt_ids))
        return [[5] for _ in prompt_ids], None

    lock = Lockstep(backend, gather, "cpu", dummy=[0])
    ids, logprobs = lock([[1], [2]])  # this process asks for 2 rows; the other for 3: padded to 3, 2 returned
    assert (ids, logprobs) == ([[5], [5]], None)
    lock.drain()  # the other process asks for 1 row more, then is done
    assert calls == [3, 1] and lock.rounds == [(2, 3), (0, 1)]


# ------------------------------------------------------------------------------------------------ tiny tool trainer
def _script(prompt_text, row):
    """Searches once, then answers with a number that tells a continuation (2 tool responses seen) apart."""
    if "<tool_response>" not in prompt_text:
        return '<tool_call>{"name": "search", "arguments": {"query": "Brellin"}}</tool_call>'
    return "Answer: 7"


class Continue(Plugin):
    """Continues every row with two turns from turn 1 (and row 0 again from turn 0), replaces the rows."""

    name = "test_continue_episodes"
    multi_turn = True
    seen: dict = {}

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        svc = ctx.service
        rows = [i for i, t in enumerate(ctx.turns) if t.num_turns == 2]
        before = (svc.used_this_batch, svc.policy_rollouts, svc.policy_tokens)
        episodes = ctx.continue_tool_episodes(rows + rows[:1], [1] * len(rows) + [0])
        Continue.seen.update(before=before, after=(svc.used_this_batch, svc.policy_rollouts, svc.policy_tokens),
                             rows=rows,
                             episodes=episodes, original=[(list(ctx.completion_ids[i]), list(ctx.turns[i].tool_mask))
                                                          for i in rows],
                             prompt_ids=[list(ctx.prompt_ids[i]) for i in rows])
        Continue.seen["logps"] = ctx.policy_logprobs([ctx.prompt_ids[e.row] for e in episodes],
                                                     [e.completion_ids for e in episodes])
        for e in episodes[: len(rows)]:
            ctx.replace_episode(e.row, e)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx):
        Continue.seen["reward_turns"] = list(ctx.local_turns)
        Continue.seen["reward_ids"] = [list(c) for c in ctx.local_completion_ids]
        Continue.seen["completions"] = list(ctx.local_completions)


@pytest.fixture(scope="module")
def continued(tmp_path_factory):
    with temporary_plugin(Continue):
        Continue.seen = {}
        tr = make_tool_trainer(plugins=["test_continue_episodes"], max_steps=1, script=_script,
                               output_dir=str(tmp_path_factory.mktemp("episodes")))
        tr.train()
    return tr, Continue.seen


@pytest.mark.slow
def test_continued_episodes_keep_the_prefix_and_run_trls_tool_loop_after_it(continued):
    tr, seen = continued
    tok = tr.processing_class
    assert seen["rows"] and len(seen["episodes"]) == len(seen["rows"]) + 1
    for e, (ids, mask) in zip(seen["episodes"], seen["original"]):
        first_result = mask.index(0)
        assert e.turn == 1 and e.start == next(t for t in range(first_result, len(mask)) if mask[t] == 1)
        assert e.completion_ids[: e.start] == ids[: e.start] and e.tool_mask[: e.start] == mask[: e.start]
        assert tok.decode(e.new_ids, skip_special_tokens=True) == "Answer: 7" and all(m == 1 for m in e.tool_mask[e.start:])
        assert [m["role"] for m in e.messages] == ["assistant", "tool", "assistant"]
        # the fresh environment replayed the kept search: its per-call reward lands on turn 0
        assert [c["name"] for c in e.environment.calls] == ["search"] and e.turns.num_turns == 2
        assert e.turns.turn_rewards[0] == e.environment.turn_rewards[0]
    # from turn 0: the whole episode again, through TRL's tool loop (a search, its result, the answer)
    whole = seen["episodes"][-1]
    assert whole.start == 0 and whole.turns.num_turns == 2 and 0 in whole.tool_mask
    assert "<tool_response>" in tok.decode(whole.completion_ids) and len(whole.environment.calls) == 1


def test_log_probs_are_the_policys_on_new_model_tokens_only(continued):
    _, seen = continued
    for e, logps in zip(seen["episodes"], seen["logps"]):
        new = [t for t in range(len(e.completion_ids)) if t >= e.start and e.tool_mask[t] == 1]
        assert all(math.isnan(e.logprobs[t]) for t in range(len(e.completion_ids)) if t not in new)
        torch.testing.assert_close(torch.tensor([e.logprobs[t] for t in new]), logps[new].float(), atol=1e-4,
                                   rtol=1e-4)


@pytest.mark.slow
def test_each_request_counts_once_in_the_budget(continued):
    _, seen = continued
    n = len(seen["episodes"])
    assert seen["after"][0] - seen["before"][0] == n
    assert seen["after"][1] - seen["before"][1] == n  # one process: no padding rows
    # generated tokens: the policy's new turns after each cut (tool mask 1 from the cut on), not the kept prefix
    new_turn_tokens = sum(sum(e.tool_mask[e.start:]) for e in seen["episodes"])
    assert seen["after"][2] - seen["before"][2] == new_turn_tokens > 0


@pytest.mark.slow
def test_replaced_rows_keep_the_episode_turns_in_the_later_stages(continued):
    _, seen = continued
    for e in seen["episodes"][: len(seen["rows"])]:
        assert seen["reward_ids"][e.row] == e.completion_ids
        assert seen["reward_turns"][e.row] == e.turns and seen["reward_turns"][e.row].num_turns == 2
        assert seen["completions"][e.row] == e.messages


@pytest.mark.slow
def test_refused_under_vllm_and_without_tools_with_the_reason(continued, monkeypatch):
    tr, _ = continued
    monkeypatch.setattr(tr, "use_vllm", True, raising=False)
    with pytest.raises(PluginError, match="tool-episode seam .* so it runs there only: set use_vllm=False"):
        tr.generation_service.continue_tool_episodes([])
    monkeypatch.setattr(tr, "use_vllm", False, raising=False)
    monkeypatch.setattr(tr, "tools", [], raising=False)
    with pytest.raises(PluginError, match="the run has no tools"):
        tr.generation_service.continue_tool_episodes([])


class ContinueWithTheModel(Plugin):
    """Switches the scripted backend off before continuing: the seam then samples with TRL's HF generate."""

    name = "test_continue_with_the_model"
    multi_turn = True
    trainer = None
    seen: dict = {}

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        vars(ContinueWithTheModel.trainer).pop("_generate_single_turn", None)  # back to TRL's own backend
        rows = [i for i, t in enumerate(ctx.turns) if t.num_turns == 2][:2]
        ContinueWithTheModel.seen.update(rows=rows, original=[list(ctx.completion_ids[i]) for i in rows],
                                         episodes=ctx.continue_tool_episodes(rows, [1] * len(rows)))


@pytest.mark.slow
def test_the_seam_samples_with_trls_hf_generate(tmp_path):
    with temporary_plugin(ContinueWithTheModel):
        ContinueWithTheModel.seen = {}
        tr = make_tool_trainer(plugins=["test_continue_with_the_model"], max_steps=1, script=_script,
                               max_completion_length=200, output_dir=str(tmp_path))
        ContinueWithTheModel.trainer = tr
        tr.train()
    seen = ContinueWithTheModel.seen
    assert seen["rows"] and len(seen["episodes"]) == len(seen["rows"])
    for e, ids in zip(seen["episodes"], seen["original"]):
        assert e.completion_ids[: e.start] == ids[: e.start] and 1 <= len(e.new_ids)
        assert len(e.completion_ids) <= 200
        new = [e.logprobs[t] for t in range(e.start, len(e.completion_ids)) if e.tool_mask[t] == 1]
        assert new and all(math.isfinite(x) and x <= 0 for x in new)
