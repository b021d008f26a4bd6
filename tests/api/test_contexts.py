"""Stage context objects: group layout from global positions, row replacement / splicing with token provenance,
and the loss context's composition rules. Pure unit tests (no trainer)."""

import math

import pytest
import torch

from trl_plugins import LossContext, PluginError, RolloutContext
from trl_plugins.api.contexts import group_layout, masked_sampling_logprobs
from trl_plugins.api.services import StageServices, gather_padded

# ---------------------------------------------------------------------------------------------- group layout


def _simulated_processes(num_processes, local_rows, G):
    """group_layout of every process of a simulated run, concatenated in process order."""
    out = ([], [], [])
    for rank in range(num_processes):
        for acc, part in zip(out, group_layout(rank, local_rows, G)):
            acc.extend(part)
    return out


def test_group_layout_two_processes_group_straddles():
    # 2 processes x 3 rows, G = 2: group 1 = global rows 2 (process 0) and 3 (process 1)
    assert group_layout(0, 3, 2) == ([0, 1, 2], [0, 0, 1], [0, 1, 0])
    assert group_layout(1, 3, 2) == ([3, 4, 5], [1, 2, 2], [1, 0, 1])


def test_group_layout_index_in_group_is_global_not_local():
    # process 1 of 2, 6 local rows, G = 4: global rows 6..11; row 6 is the 3rd member of group 1
    global_index, group_ids, index_in_group = group_layout(1, 6, 4)
    assert global_index == list(range(6, 12))
    assert group_ids == [1, 1, 2, 2, 2, 2]
    assert index_in_group == [2, 3, 0, 1, 2, 3]
    # a local computation (j % G) would get it wrong for the first rows of this process
    assert index_in_group != [j % 4 for j in range(6)]


@pytest.mark.parametrize("num_processes,local_rows,G", [(2, 3, 2), (2, 6, 4), (3, 4, 6), (4, 2, 8), (1, 8, 4)])
def test_group_layout_covers_global_batch(num_processes, local_rows, G):
    if (num_processes * local_rows) % G:
        pytest.skip("global batch must be a multiple of G")
    global_index, group_ids, index_in_group = _simulated_processes(num_processes, local_rows, G)
    N = num_processes * local_rows
    assert global_index == list(range(N))
    assert group_ids == [g // G for g in range(N)]
    assert index_in_group == [g % G for g in range(N)]
    # exactly G rows per group, indices 0..G-1 each once
    for group in range(N // G):
        members = [i for i, gid in zip(index_in_group, group_ids) if gid == group]
        assert sorted(members) == list(range(G))


# ---------------------------------------------------------------------------------------------- rollout context


def _tokenize(prompts):
    # a stand-in tokenizer: one id per character
    return [[ord(c) for c in p] for p in prompts]


def _rollout(logprobs=True):
    completion_ids = [[10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33]]
    lps = [[-0.1 * (j + 1) - i for j in range(len(c))] for i, c in enumerate(completion_ids)] if logprobs else None
    ctx = RolloutContext(
        rows=[{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}],
        prompts=["a", "b", "c"],
        training_prompts=["a", "b", "c"],
        prompt_ids=_tokenize(["a", "b", "c"]),
        completion_ids=[list(c) for c in completion_ids],
        completions=["x", "y", "z"],
        sampling_logprobs=lps,
        offpolicy=[[False] * len(c) for c in completion_ids],
        prompt_swapped=[False, False, False],
        global_index=[0, 1, 2],
        group_ids=[0, 0, 1],
        index_in_group=[0, 1, 0],
        num_generations=2,
        step=0,
        annotations=[{}, {}, {}],
        services=StageServices(tokenize_prompts=_tokenize, decode=lambda ids, prompt: "|".join(map(str, ids))),
    )
    return ctx


def _same(a, b):
    """List equality where NaN == NaN."""
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


def test_splice_keeps_prefix_token_exact_and_flags_new_tokens():
    ctx = _rollout()
    old_ids = list(ctx.completion_ids[0])
    old_lps = list(ctx.sampling_logprobs[0])
    ctx.splice(0, 2, [90, 91, 92, 93])
    assert ctx.completion_ids[0] == old_ids[:2] + [90, 91, 92, 93]
    assert ctx.offpolicy[0] == [False, False, True, True, True, True]
    assert ctx.sampling_logprobs[0][:2] == old_lps[:2]
    assert all(math.isnan(x) for x in ctx.sampling_logprobs[0][2:])
    assert ctx.completions[0] == "10|11|90|91|92|93"  # re-decoded
    assert ctx.changed == {0}
    # other rows untouched
    assert ctx.completion_ids[1] == [20, 21, 22] and ctx.offpolicy[1] == [False] * 3
    assert ctx.prompt_ids[0] == _tokenize(["a"])[0] and ctx.training_prompts[0] == "a"


def test_splice_twice_keeps_provenance_of_earlier_splice():
    ctx = _rollout()
    ctx.splice(2, 1, [70, 71, 72])  # [30, 70*, 71*, 72*]
    ctx.splice(2, 3, [80], offpolicy=False)  # keep [30, 70*, 71*], append on-policy-flagged 80
    assert ctx.completion_ids[2] == [30, 70, 71, 80]
    assert ctx.offpolicy[2] == [False, True, True, False]
    lps = ctx.sampling_logprobs[2]
    assert lps[0] == pytest.approx(-2.1)
    assert all(math.isnan(x) for x in lps[1:])  # spliced tokens were never sampled by the policy


def test_splice_at_zero_and_at_end():
    ctx = _rollout()
    ctx.splice(1, 0, [5, 6])
    assert ctx.completion_ids[1] == [5, 6] and ctx.offpolicy[1] == [True, True]
    ctx = _rollout()
    ctx.splice(1, 3, [])  # nothing new: the row is unchanged
    assert ctx.completion_ids[1] == [20, 21, 22] and ctx.offpolicy[1] == [False] * 3
    assert ctx.sampling_logprobs[1] == pytest.approx([-1.1, -1.2, -1.3])


def test_splice_without_sampling_logprobs():
    ctx = _rollout(logprobs=False)
    ctx.splice(0, 3, [1, 2])
    assert ctx.sampling_logprobs is None
    assert ctx.completion_ids[0] == [10, 11, 12, 1, 2]
    assert ctx.offpolicy[0] == [False, False, False, True, True]


def test_replace_row_flags_and_logprobs():
    ctx = _rollout()
    ctx.replace_row(1, [40, 41], offpolicy=[False, True], logprobs=[-0.5, -0.6])
    assert ctx.completion_ids[1] == [40, 41]
    assert ctx.offpolicy[1] == [False, True]
    assert ctx.sampling_logprobs[1][0] == -0.5
    assert math.isnan(ctx.sampling_logprobs[1][1])  # NaN forced on the off-policy token
    assert ctx.changed == {1}
    # unknown log-probs: NaN everywhere
    ctx.replace_row(0, [1, 2, 3])
    assert ctx.offpolicy[0] == [False] * 3
    assert all(math.isnan(x) for x in ctx.sampling_logprobs[0])
    # a bool applies to all tokens
    ctx.replace_row(2, [7, 8], offpolicy=True, logprobs=[-1.0, -2.0])
    assert ctx.offpolicy[2] == [True, True]
    assert all(math.isnan(x) for x in ctx.sampling_logprobs[2])


def test_replace_row_with_training_prompt_retokenizes():
    ctx = _rollout()
    ctx.replace_row(0, [1, 2], training_prompt="hinted a", prompt_swapped=False)
    assert ctx.training_prompts[0] == "hinted a"
    assert ctx.prompt_ids[0] == _tokenize(["hinted a"])[0]
    assert ctx.prompt_swapped[0] is False
    assert ctx.prompts[0] == "a"  # the original prompt is not touched
    ctx.replace_row(1, [3], prompt_swapped=True)
    assert ctx.prompt_swapped[1] is True and ctx.training_prompts[1] == "b"
    assert ctx.prompt_ids[1] == _tokenize(["b"])[0]


def test_replace_row_length_mismatch_errors():
    ctx = _rollout()
    with pytest.raises(PluginError, match="3 provenance flags for 2 tokens"):
        ctx.replace_row(0, [1, 2], offpolicy=[True, False, True])
    with pytest.raises(PluginError, match="1 log-probs for 2 tokens"):
        ctx.replace_row(0, [1, 2], logprobs=[-0.1])
    # a failed call leaves the row untouched
    assert ctx.completion_ids[0] == [10, 11, 12, 13, 14]
    assert ctx.offpolicy[0] == [False] * 5
    assert _same(ctx.sampling_logprobs[0], _rollout().sampling_logprobs[0])
    assert ctx.changed == set()


def test_splice_out_of_range_errors():
    ctx = _rollout()
    with pytest.raises(PluginError):
        ctx.splice(1, 5, [1])  # row 1 has 3 tokens: start 5 is past its end


# ---------------------------------------------------------------------------------------------- loss context


def _loss_ctx(B=2, T=3, services=None):
    z = torch.zeros(B, T)
    return LossContext(
        inputs={"completion_ids": torch.zeros(B, T, dtype=torch.long)},
        per_token_logps=z,
        old_per_token_logps=z,
        ref_per_token_logps=None,
        sampling_per_token_logps=None,
        entropies=z,
        advantages=z,
        mask=torch.ones(B, T),
        offpolicy_mask=torch.zeros(B, T, dtype=torch.bool),
        extras={},
        loss_type="grpo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        beta=0.0,
        num_items_in_batch=torch.tensor(6.0),
        iteration=0,
        mode="train",
        services=services or StageServices(),
    )


def test_replace_tokens_refuses_second_replacer():
    ctx = _loss_ctx()
    ctx.set_active_plugin("first")
    mask = torch.ones(2, 3, dtype=torch.bool)
    ctx.replace_tokens(mask, torch.ones(2, 3))
    ctx.replace_tokens(mask, 2 * torch.ones(2, 3))  # the same plugin may call it again (last call wins)
    assert torch.equal(ctx.replacement[1], 2 * torch.ones(2, 3))
    ctx.set_active_plugin("second")
    with pytest.raises(PluginError, match="'first' and 'second' both replace the surrogate"):
        ctx.replace_tokens(mask, torch.zeros(2, 3))
    assert torch.equal(ctx.replacement[1], 2 * torch.ones(2, 3))


def test_loss_context_collects_contributions_and_metrics():
    logged = {}
    ctx = _loss_ctx(services=StageServices(metric_sink=lambda k, v: logged.setdefault(k, []).append(v)))
    ctx.set_active_plugin("probe")
    ctx.scale_tokens(torch.full((2, 3), 0.5))
    ctx.add_token_loss(torch.ones(2, 3))
    ctx.add_loss(torch.tensor(3.0))
    ctx.log_metric("seen", 1)
    assert len(ctx.token_weights) == len(ctx.token_terms) == len(ctx.scalar_terms) == 1
    assert logged == {"plugins/probe/seen": [1.0]}
    ctx.replace_tokens(torch.tensor([[1, 0, 0], [0, 0, 1]]), torch.ones(2, 3))
    assert ctx.replacement[0].dtype == torch.bool


def test_head_stats_without_declaration_errors():
    ctx = _loss_ctx()
    ctx.set_active_plugin("greedy")
    with pytest.raises(PluginError, match="'greedy'.*needs_head_stats"):
        ctx.head_stats()


# ---------------------------------------------------------------------------------------------- services


def test_missing_service_names_member_and_context():
    ctx = _rollout()  # its services provide tokenize_prompts and decode only
    with pytest.raises(PluginError, match=r"RolloutContext: 'score' is not available"):
        ctx.score([0])
    with pytest.raises(PluginError, match=r"RolloutContext: 'tokenizer' is not available"):
        ctx.tokenizer
    with pytest.raises(PluginError, match=r"LossContext: 'masked_mean' is not available"):
        _loss_ctx().global_masked_mean(torch.ones(2, 3))


def test_masked_sampling_logprobs_rule():
    nan = float("nan")
    assert _same(masked_sampling_logprobs([-1.0, -2.0, -3.0], [False, True, False], False), [-1.0, nan, -3.0])
    assert _same(masked_sampling_logprobs([-1.0, -2.0], [False, False], True), [nan, nan])


def test_gather_padded_pads_to_the_longest_process():
    # two simulated processes: the gather concatenates this process's tensor with a longer one of process 1
    def gather(t):  # sizes (1,) first, then the padded (1, T_max) rows
        return torch.cat([t, torch.tensor([3]) if t.dim() == 1 else torch.tensor([[7, 7, 7]])])

    out = gather_padded(gather, torch.tensor([[1, 2]]), dim=1, pad_value=-1)
    assert out.tolist() == [[1, 2, -1], [7, 7, 7]]


def test_defer_slots_defers_the_rows_whose_index_in_group_matches_on_this_process():
    from trl_plugins.api.contexts import PromptContext

    # process 1 of 2, 6 local rows, G = 4: indices in group [2, 3, 0, 1, 2, 3]
    global_index, group_ids, index_in_group = group_layout(1, 6, 4)
    ctx = PromptContext(rows=[{}] * 6, prompts=["p"] * 6, generation_prompts=["p"] * 6, training_prompts=["p"] * 6,
                        global_index=global_index, group_ids=group_ids, index_in_group=index_in_group,
                        num_generations=4, step=0, annotations=[{} for _ in range(6)])
    assert ctx.defer_slots(lambda k: k % 2 != 0) == [1, 3, 5]
    assert ctx.deferred == [False, True, False, True, False, True]
    assert ctx.defer_slots(lambda k: k == 0) == [2] and ctx.deferred[2]
    assert ctx.defer_slots(lambda k: k > 9) == [] and sum(ctx.deferred) == 4
