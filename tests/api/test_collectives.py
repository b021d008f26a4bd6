"""trl_plugins.api.collectives: gathers that fail together, on simulated processes (threads with a working all-gather,
``trl_plugins.testing.run_on_processes``)."""

from types import SimpleNamespace

import pytest
import torch

from trl_plugins.api.collectives import (
    HeldRewardErrors,
    fail_together,
    gather_floats,
    gather_id_lists,
    gather_ints_together,
    gather_objects_together,
    raise_together,
    run_together,
)
from trl_plugins.api.errors import PluginConfigError, PluginError
from trl_plugins.testing import run_on_processes


def _ctx(gather):
    # no trainer: collectives run on CPU; two local rows per process for the reward-stage helper
    return SimpleNamespace(gather=gather, gather_object=gather.objects, local_rows=[{}, {}])


def _outcome(fn):
    """Run ``fn(ctx, rank)`` on 2 processes; per rank, its result or the exception it raised."""

    def work(rank, gather):
        try:
            return fn(_ctx(gather), rank)
        except Exception as exc:  # returned, so every rank's outcome can be checked
            return exc

    return run_on_processes(2, work, timeout=10)


def test_run_together_returns_each_process_result_when_none_fails():
    assert _outcome(lambda ctx, rank: run_together(ctx, "probe", lambda: rank * 10)) == [0, 10]


def test_a_failure_on_one_process_stops_both_without_a_hang():
    def fn(ctx, rank):
        def step():
            if rank == 1:
                raise PluginConfigError("row 3 has no reference solution")
            return "ok"

        result = run_together(ctx, "probe", step)
        ctx.gather(torch.zeros(1))  # the next collective: must never be reached by one rank alone
        return result

    first, second = _outcome(fn)
    assert isinstance(second, PluginConfigError) and "row 3" in str(second)
    assert isinstance(first, PluginError) and "probe: process 1 failed" in str(first)


def test_fail_together_with_errors_on_both_processes_raises_each_its_own():
    errors = [ValueError("a"), KeyError("b")]
    outcome = _outcome(lambda ctx, rank: fail_together(ctx, "probe", errors[rank]))
    assert outcome == errors


@pytest.mark.parametrize("fill", [float("nan"), -1.0])
def test_gather_helpers_concatenate_in_rank_order(fill):
    lists = [[[1, 2], []], [[3], [4, 5, 6]]]
    out = _outcome(lambda ctx, rank: gather_id_lists(ctx, lists[rank]))
    assert out[0] == out[1] == [[1, 2], [], [3], [4, 5, 6]]
    floats = _outcome(lambda ctx, rank: gather_floats(ctx, [None, 0.5 + rank], fill=fill))
    for got in floats:  # None becomes ``fill``
        torch.testing.assert_close(got, torch.tensor([fill, 0.5, fill, 1.5]), equal_nan=True)


def test_raise_together_on_a_bare_gather_names_the_failing_process():
    outcome = _outcome(lambda ctx, rank: raise_together(ctx.gather, torch.device("cpu"), "reward functions",
                                                        KeyError("x") if rank == 0 else None))
    assert isinstance(outcome[0], KeyError)
    assert isinstance(outcome[1], PluginError) and "reward functions: process 0 failed" in str(outcome[1])


def test_gather_objects_together_gathers_rows_in_rank_order_in_one_collective():
    calls = []

    def fn(ctx, rank):
        values = gather_objects_together(ctx, "probe", lambda: [f"r{rank}a", f"r{rank}b"])
        calls.append(rank)
        return values

    assert _outcome(fn) == [["r0a", "r0b", "r1a", "r1b"]] * 2 and sorted(calls) == [0, 1]


def test_gather_objects_together_stops_every_process_when_one_fails():
    def fn(ctx, rank):
        def local():
            if rank == 1:
                raise TimeoutError("judge timed out")
            return [1.0, 2.0]

        values = gather_objects_together(ctx, "probe", local)
        ctx.gather(torch.zeros(1))  # the next collective: must never be reached by one rank alone
        return values

    first, second = _outcome(fn)
    assert isinstance(second, TimeoutError)
    assert isinstance(first, PluginError) and "probe: process 1 failed" in str(first)


def test_gather_ints_together_returns_every_process_values_or_raises_on_all():
    ok = _outcome(lambda ctx, rank: gather_ints_together(ctx.gather, [rank, 10 + rank], torch.device("cpu"), "c", None))
    for got in ok:
        assert got.tolist() == [[0, 10], [1, 11]]
    errors = [None, ValueError("row 2: nan")]
    failed = _outcome(lambda ctx, rank: gather_ints_together(ctx.gather, [rank], torch.device("cpu"), "counts",
                                                             errors[rank]))
    assert isinstance(failed[0], PluginError) and "counts: process 1 failed" in str(failed[0])
    assert failed[1] is errors[1]


def test_held_reward_errors_ride_in_the_gather_and_are_forgotten_once_raised():
    def fn(ctx, rank):
        held = HeldRewardErrors()
        with held.holding_while(True):
            if rank == 0:
                assert held.hold(KeyError("judge down"))
            assert held.failed == (rank == 0)
        try:
            held.gather_with_flag(ctx.gather, [3], torch.device("cpu"), "reward functions")
        except Exception as exc:
            first = exc
        return first, held.gather_with_flag(ctx.gather, [rank], torch.device("cpu"), "reward functions").tolist()

    (error0, after0), (error1, after1) = _outcome(fn)
    assert isinstance(error0, KeyError)
    assert isinstance(error1, PluginError) and "reward functions: process 0 failed" in str(error1)
    assert after0 == after1 == [[0], [1]]  # taken: the next gather raises nothing
