"""Launches shared by this folder's tests: each runs many cases in one set of processes.

Starting a rank costs seconds (importing torch), so the quick cases of every test module run
in one 2-rank launch (plus one 1-rank launch that loads the 2-rank checkpoints), and the
slow cases (``-m slow``) in another pair. Tests read their checks from the parsed output.
"""

from __future__ import annotations

import pytest

from . import _common as C
from ._launch import launch

#: (task, strategy) pairs of the default run; everything else is marked slow.
QUICK_DP = {("ddp", "plus"), ("fsdp", "mixed"), ("fsdp", "plus"), ("fsdp", "split"),
            ("fsdp", "stochastic"), ("ddp", C.AUTO), ("fsdp", C.AUTO),
            ("fsdp_inner", "mixed"), ("fsdp_inner", "stochastic")}
QUICK_DCP = ("split", "stochastic")
DP_TASKS = ("ddp", "fsdp", "fsdp_inner")  # fsdp_inner: matrices sharded on dimension 1
ALL_DP = [(task, s) for task in DP_TASKS for s in (*C.ALL_STRATEGIES, C.AUTO)]


def _world2_cases(dp, dcp) -> list[str]:
    cases = []
    for task in DP_TASKS:
        names = [s for t, s in dp if t == task]
        if names:
            cases.append(f"{task}:{','.join(names)}")
    if dcp:
        cases += [f"dcp_save:{','.join(dcp)}", f"dcp_load:{','.join(dcp)}"]
    return cases


def _runs(folder, dp, dcp) -> dict:
    world2 = launch(_world2_cases(dp, dcp), 2, folder)
    runs = {"world2": world2}
    if dcp and not world2.crashed():
        runs["world1"] = launch([f"dcp_load:{','.join(dcp)}"], 1, folder)
    return runs


@pytest.fixture(scope="session")
def quick_runs(tmp_path_factory):
    return _runs(tmp_path_factory.mktemp("dist_quick"), sorted(QUICK_DP), QUICK_DCP)


@pytest.fixture(scope="session")
def slow_runs(tmp_path_factory):
    dp = [case for case in ALL_DP if case not in QUICK_DP]
    dcp = [s for s in C.ALL_STRATEGIES if s not in QUICK_DCP]
    return _runs(tmp_path_factory.mktemp("dist_slow"), dp, dcp)


def outcome_for(request, quick: bool, task: str):
    """The parsed launch that ran ``task`` (``dcp_load1`` ran in the 1-rank launch)."""
    runs = request.getfixturevalue("quick_runs" if quick else "slow_runs")
    key = "world1" if task == "dcp_load1" else "world2"
    assert key in runs, "the 2-rank launch crashed:\n" + runs["world2"].log()
    outcome = runs[key]
    assert not outcome.crashed(), outcome.log()
    return outcome


def assert_check(outcome, task: str, strategy: str, check: str) -> None:
    problems = outcome.problems(task, strategy, check)
    assert not problems, f"{task} {strategy} {check}:\n" + "\n".join(problems[:20])
