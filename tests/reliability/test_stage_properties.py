"""Property-based tests (hypothesis) of the stage contracts: random group sizes, rank splits, masks and NaN patterns.

* ``group_layout``: every rank split of a global batch gives each row its global index, group and index in group,
  with exactly G rows per group over the ranks;
* ``RolloutContext.replace_row`` / ``splice``: any sequence of edits keeps G rows per group, one provenance flag and
  one log-prob per token, NaN on off-policy tokens and on prompt-swapped rows, the spliced prefix token-exact, and a
  refused edit changes nothing;
* the generation service: for any request counts per rank, every rank issues the same backend calls and gets back
  exactly its own results; a budget refusal is taken by every rank together;
* loss aggregation: masked positions never matter; splitting rows over ranks (DDP averages the ranks' losses) gives
  the single-process loss for every loss type but bnpo; neutral contributions are no-ops;
* advantage transforms of built-in plugins keep the shape and stay finite for any NaN pattern of rewards ("every
  reward function returned None" rows).
"""

from __future__ import annotations

import copy
import math
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trl_plugins import GenerationBudgetExceeded, PluginError  # noqa: E402
from trl_plugins.api.contexts import group_layout  # noqa: E402
from trl_plugins.runtime.generation import GenerationService  # noqa: E402
from trl_plugins.api.loss_types import LOSS_TYPES  # noqa: E402
from trl_plugins.runtime.loss_rules import aggregate  # noqa: E402
from trl_plugins.testing import (  # noqa: E402
    SimulatedCollective,
    build_stack,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    make_rollout_context,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ============================================================================================ group layout


@FAST
@given(P=st.integers(1, 4), B=st.integers(1, 12), G=st.integers(1, 8))
def test_group_layout_over_any_rank_split(P, B, G):
    N = P * B
    layouts = [group_layout(p, B, G) for p in range(P)]
    global_index = [g for gi, _, _ in layouts for g in gi]
    assert global_index == list(range(N))
    for p, (gi, gids, ks) in enumerate(layouts):
        assert gi == list(range(p * B, (p + 1) * B))  # the rows of the trainer's process slice
        assert gids == [g // G for g in gi] and ks == [g % G for g in gi]
        assert all(0 <= k < G for k in ks)
    members: dict[int, list[tuple[int, int]]] = {}
    for p, (_, gids, ks) in enumerate(layouts):
        for gid, k in zip(gids, ks):
            members.setdefault(gid, []).append((p, k))
    for gid, rows in members.items():
        if (gid + 1) * G <= N:  # a whole group: exactly G rows, indices 0..G-1 in order, on consecutive ranks
            assert [k for _, k in rows] == list(range(G))
            ranks = [p for p, _ in rows]
            assert ranks == sorted(ranks) and set(ranks) == set(range(ranks[0], ranks[-1] + 1))


# ============================================================================================ rollout edits

token = st.integers(10, 60)
ids_strategy = st.lists(token, min_size=1, max_size=6)
logprob = st.one_of(st.floats(-5, 0), st.just(float("nan")), st.none())


@st.composite
def rollout_and_edits(draw):
    G = draw(st.integers(1, 4))
    groups = draw(st.integers(1, 3))
    texts = [[draw(st.text("abc123", min_size=1, max_size=5)) for _ in range(G)] for _ in range(groups)]
    with_logprobs = draw(st.booleans())
    edits = []
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, G * groups - 1))
        kind = draw(st.sampled_from(["replace", "splice", "bad_replace", "bad_splice", "empty"]))
        if kind == "replace":
            ids = draw(ids_strategy)
            off = draw(st.one_of(st.booleans(), st.lists(st.booleans(), min_size=len(ids), max_size=len(ids))))
            lps = draw(st.one_of(st.none(), st.lists(logprob, min_size=len(ids), max_size=len(ids))))
            edits.append(("replace", i, ids, off, lps, draw(st.sampled_from([None, True, False]))))
        elif kind == "splice":
            edits.append(("splice", i, draw(st.integers(0, 8)), draw(st.lists(token, max_size=4)),
                          draw(st.booleans())))
        elif kind == "bad_replace":
            ids = draw(ids_strategy)
            edits.append(("bad_replace", i, ids, [True] * (len(ids) + 1)))
        else:
            edits.append((kind, i))
    return texts, with_logprobs, edits


def _snapshot(ctx):
    lps = None if ctx.sampling_logprobs is None else [[repr(x) for x in row] for row in ctx.sampling_logprobs]
    return copy.deepcopy((ctx.completion_ids, ctx.offpolicy, lps, ctx.prompt_swapped, ctx.training_prompts,
                          ctx.prompt_ids, ctx.completions))


def _check_invariants(ctx, B):
    for name in ("rows", "prompts", "training_prompts", "prompt_ids", "completion_ids", "completions", "offpolicy",
                 "prompt_swapped", "global_index", "group_ids", "index_in_group"):
        assert len(getattr(ctx, name)) == B, name
    for i in range(B):
        n = len(ctx.completion_ids[i])
        assert n >= 1 and len(ctx.offpolicy[i]) == n
        if ctx.sampling_logprobs is not None:
            lps = ctx.sampling_logprobs[i]
            assert len(lps) == n and all(isinstance(x, float) for x in lps)
            assert all(math.isnan(x) for x, off in zip(lps, ctx.offpolicy[i]) if off), "off-policy token without NaN"
            if ctx.prompt_swapped[i]:
                assert all(math.isnan(x) for x in lps), "prompt-swapped row with a finite sampling log-prob"


@FAST
@given(rollout_and_edits())
def test_any_sequence_of_rollout_edits_keeps_the_contracts(case):
    texts, with_logprobs, edits = case
    ctx = make_rollout_context(texts, sampling_logprob=-1.0 if with_logprobs else None)
    B = len(ctx)
    for edit in edits:
        kind, i = edit[0], edit[1]
        before = _snapshot(ctx)
        if kind == "replace":
            _, _, ids, off, lps, swapped = edit
            ctx.replace_row(i, ids, offpolicy=off, logprobs=lps, prompt_swapped=swapped)
            assert ctx.completion_ids[i] == ids
            flags = [off] * len(ids) if isinstance(off, bool) else off
            assert ctx.offpolicy[i] == flags
            if swapped is not None:
                assert ctx.prompt_swapped[i] == swapped
            if ctx.sampling_logprobs is not None and lps is not None and not ctx.prompt_swapped[i]:
                for got, given_, f in zip(ctx.sampling_logprobs[i], lps, flags):
                    if not f and given_ is not None and not math.isnan(given_):
                        assert got == given_
        elif kind == "splice":
            _, _, start, new, off = edit
            old_ids, old_flags = list(ctx.completion_ids[i]), list(ctx.offpolicy[i])
            old_lps = None if ctx.sampling_logprobs is None else list(ctx.sampling_logprobs[i])
            if start > len(old_ids) or (start == 0 and not new):
                with pytest.raises(PluginError):
                    ctx.splice(i, start, new, offpolicy=off)
                assert _snapshot(ctx) == before, "a refused splice changed the context"
            else:
                ctx.splice(i, start, new, offpolicy=off)
                assert ctx.completion_ids[i] == old_ids[:start] + list(new)
                assert ctx.offpolicy[i] == old_flags[:start] + [off] * len(new)
                if old_lps is not None and not ctx.prompt_swapped[i]:
                    assert [repr(x) for x in ctx.sampling_logprobs[i][:start]] == [repr(x) for x in old_lps[:start]]
                    assert all(math.isnan(x) for x in ctx.sampling_logprobs[i][start:])
        else:
            with pytest.raises(PluginError):
                if kind == "bad_replace":
                    ctx.replace_row(i, edit[2], offpolicy=edit[3])
                elif kind == "bad_splice":
                    ctx.splice(i, len(ctx.completion_ids[i]) + 1, [11])
                else:
                    ctx.replace_row(i, [])
            assert _snapshot(ctx) == before, f"a refused {kind} changed the context"
        _check_invariants(ctx, B)


# ============================================================================================ generation service


def _stub_trainer(rank, collective, budget, calls):
    tok = SimpleNamespace(batch_decode=lambda ids_list, skip_special_tokens=True: ["".join(map(chr, ids_list[0]))],
                          eos_token_id=2)

    def single_turn(prompt_ids, images, fields, num_generations=1):
        calls.append((rank, len(prompt_ids), num_generations))
        # the completion names the prompt it came from: 100 + first prompt token
        return [[100 + p[0], 101 + p[0]] for p in prompt_ids], [[-0.5, -0.5] for _ in prompt_ids]

    acc = SimpleNamespace(gather=lambda t: collective.gather(rank, t.view(1, -1)).view(-1), device=torch.device("cpu"),
                          process_index=rank)
    return SimpleNamespace(args=SimpleNamespace(plugin_generation_budget=budget), accelerator=acc,
                           sample_completions=lambda prompt_ids, num_generations=1: single_turn(
                               prompt_ids, None, {}, num_generations),
                           processing_class=tok, max_completion_length=8, text_tokenizer=tok,
                           model=SimpleNamespace(training=True))


@FAST
@given(counts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), min_size=1, max_size=3),
       budget=st.one_of(st.none(), st.integers(0, 6)))
def test_generation_service_is_collective_safe_for_any_request_counts(counts, budget):
    """``counts[rank][call]``: how many prompts each rank asks for in each of its calls (every rank calls the same
    number of times, as the contract requires; ranks with fewer calls listed ask for 0)."""
    P = len(counts)
    n_calls = max(len(c) for c in counts)
    counts = [c + [0] * (n_calls - len(c)) for c in counts]
    collective = SimulatedCollective(P, timeout=20)
    backend_calls: list = []
    results: list = [None] * P
    errors: list = [None] * P

    def work(rank):
        service = GenerationService(_stub_trainer(rank, collective, budget, backend_calls))
        service.begin_batch([1])
        got = []
        try:
            for call, n in enumerate(counts[rank]):
                prompts = [[rank * 10 + call, 7] for _ in range(n)]
                got.append([c.completion_ids for c in service.generate(prompt_ids=prompts)])
        except GenerationBudgetExceeded as exc:
            errors[rank] = (len(got), str(exc))
        results[rank] = got

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is stuck in a collective (deadlock)"
    used = [0] * P
    refused_at = None
    for call in range(n_calls):
        if budget is not None and any(used[r] + counts[r][call] > budget for r in range(P)):
            refused_at = call
            break
        for r in range(P):
            used[r] += counts[r][call]
    if refused_at is not None:  # every rank refused together, at the same call
        assert [e[0] if e else None for e in errors] == [refused_at] * P
    else:
        assert errors == [None] * P
    for rank in range(P):
        for call, got in enumerate(results[rank]):
            assert got == [[100 + rank * 10 + call, 101 + rank * 10 + call]] * counts[rank][call]
    # the backend saw the same number of calls with the same (padded) size on every rank
    per_rank = [[(n, g) for r, n, g in backend_calls if r == rank] for rank in range(P)]
    assert all(calls == per_rank[0] for calls in per_rank)
    assert all(g == 1 for _, _, g in backend_calls)


# ============================================================================================ loss aggregation

SPLIT_INVARIANT = tuple(lt for lt in LOSS_TYPES if lt != "bnpo")  # bnpo: each rank's own token count (TRL)


def _aggregate(loss_type, per_token, mask, num_items, num_processes=1):
    return aggregate(loss_type, per_token, mask, num_items_in_batch=num_items, max_completion_length=8,
                     num_processes=num_processes)[0]


@st.composite
def batch(draw):
    P = draw(st.integers(1, 3))
    rows_per_rank = draw(st.integers(1, 4))
    T = draw(st.integers(1, 8))
    B = P * rows_per_rank
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) < draw(st.floats(0.0, 1.0))).double()
    return P, loss, mask


@FAST
@given(batch(), st.sampled_from(LOSS_TYPES))
def test_masked_positions_never_change_the_loss(case, loss_type):
    _P, per_token, mask = case
    loss = _aggregate(loss_type, per_token, mask, mask.sum())
    noisy = torch.where(mask.bool(), per_token, per_token + 1e3 * torch.randn_like(per_token))
    loss2 = _aggregate(loss_type, noisy, mask, mask.sum())
    torch.testing.assert_close(loss, loss2)
    assert torch.isfinite(loss)


@FAST
@given(batch(), st.sampled_from(SPLIT_INVARIANT))
def test_rank_split_averages_to_the_single_process_loss(case, loss_type):
    P, per_token, mask = case
    num_items = mask.sum()
    full = _aggregate(loss_type, per_token, mask, num_items)
    ranks = [_aggregate(loss_type, lp, m, num_items, num_processes=P) for lp, m in zip(per_token.chunk(P), mask.chunk(P))]
    torch.testing.assert_close(torch.stack(ranks).mean(), full)  # DDP averages the ranks' gradients


@FAST
@given(batch(), st.sampled_from(LOSS_TYPES))
def test_neutral_loss_contributions_are_no_ops(case, loss_type):
    _P, per_token, mask = case
    B, T = per_token.shape
    ctx = make_loss_context(shape=(B, T), mask=mask.float(), loss_type=loss_type)
    ctx.per_token_loss = per_token.float()
    base = loss_from_context(ctx)
    ctx.scale_tokens(torch.ones(B, T))
    ctx.add_token_loss(torch.zeros(B, T))
    ctx.add_loss(torch.tensor(0.0))
    ctx.replace_tokens(torch.zeros(B, T, dtype=torch.bool), torch.full((B, T), 123.0))
    torch.testing.assert_close(loss_from_context(ctx), base)


# ============================================================================================ advantage transforms

# Built-in advantage transforms that run on a hand-made context without a trainer (the others need their reward
# stage or trainer attributes; their own tests in tests/plugins cover them).
ADVANTAGE_PLUGINS = ("canon", "clip_cov", "empo", "gtpo", "kl_cov", "r3l", "riskpo", "rlp", "rlpr")


@st.composite
def rewards_with_nans(draw):
    G = draw(st.integers(2, 6))
    groups = draw(st.integers(1, 4))
    N = G * groups
    values = draw(st.lists(st.one_of(st.floats(-2, 2), st.just(float("nan"))), min_size=N, max_size=N))
    assume(not all(math.isnan(v) for v in values))
    return G, torch.tensor(values, dtype=torch.float32)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rewards_with_nans(), st.sampled_from(ADVANTAGE_PLUGINS))
def test_advantage_transforms_keep_shape_and_stay_finite(case, plugin):
    G, rewards = case
    N = rewards.numel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stack = build_stack(plugin)
        ctx = make_advantage_context(rewards, num_generations=G)
        stack.call("trl_plugins_transform_advantages", ctx)
    assert ctx.advantages.dim() in (1, 2) and ctx.advantages.size(0) == N
    assert torch.isfinite(ctx.advantages).all(), f"{plugin}: non-finite advantages for rewards {rewards.tolist()}"
    for name, extra in ctx.extras.items():
        assert extra.size(0) == N, f"{plugin}: extra {name!r} has {extra.size(0)} rows for {N}"
