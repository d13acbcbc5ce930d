"""A busy machine told from a slow step (#40 item 4): the benches record the load average
before they start and around every row or round, and warn once when the load before the
start and the bench's threads together exceed the cores (``common.load_check``).
``os.getloadavg`` and ``os.cpu_count`` are replaced: the machine's own load is whatever
else runs beside the tests."""

from __future__ import annotations

import json
import os

import pytest

from collage.bench import common, optimizer, train
from collage.cli import main
from collage.optim import compiled

needs_compiler = pytest.mark.skipif(not compiled.available(), reason="no C++ compiler")

QUIET, BUSY = (0.2, 0.3, 0.4), (3.1, 2.2, 1.3)


@pytest.fixture
def machine(monkeypatch):
    """A 2-core machine whose load ``set(load)`` decides."""
    state = {"load": QUIET}
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: state["load"])
    return state


@pytest.mark.parametrize("load, threads, busy", [
    (QUIET, 2, False),     # 0.2 + 2 threads on 2 cores: within the margin
    ((0.9, 0, 0), 2, False),  # 0.9 + 2 <= 2 + 1: an earlier job's last minute
    ((1.1, 0, 0), 2, True),  # 1.1 + 2 > 2 + 1: another busy thread on average
    ((1.9, 0, 0), 1, False),  # 1.9 + 1: the idle core takes the other work
    ((2.1, 0, 0), 1, True),
    (BUSY, 2, True),
])
def test_the_load_before_the_start_and_the_threads_against_the_cores(machine, load, threads,
                                                                     busy):
    machine["load"] = load
    check = common.load_check(threads)
    assert check["before"] == list(load) and check["cores"] == 2
    assert check["busy"] is busy
    assert (check["warning"] is not None) is busy
    if busy:
        assert f"{load[0]:.2f} before the bench started" in check["warning"]


def test_no_load_average_is_no_warning(monkeypatch):
    def unavailable():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    check = common.load_check(64, cores=1)
    assert check["before"] is None and not check["busy"]


def _bench_optimizer(capsys) -> tuple[dict, str]:
    code = main(["bench", "optimizer", "--size", "small", "--strategies", "bf16",
                 "--paths", "fused", "--baselines", "", "--nonfinite", "", "--repeats", "1",
                 "--warmup", "1", "--min-time", "0", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


@needs_compiler
def test_bench_optimizer_records_the_load_and_warns_only_when_busy(machine, capsys):
    machine["load"] = BUSY
    result, err = _bench_optimizer(capsys)
    assert result["load"]["before"] == list(BUSY) and result["load"]["busy"]
    assert err.count("warning: busy machine") == 1  # once, though quiet (--json)
    (block,) = result["sizes"]
    assert len(block["rows"]) == 2  # torch's fused row and bf16's
    for row in block["rows"]:  # beside every row: before and after its rounds
        assert row["load_average"] == {"before": list(BUSY), "after": list(BUSY)}
    table = optimizer.table(result)
    assert table.startswith("**Warning: busy machine:")
    assert "| load before | load after |" in table and "| 3.10 | 3.10 |" in table

    machine["load"] = QUIET
    result, err = _bench_optimizer(capsys)
    assert not result["load"]["busy"] and result["load"]["warning"] is None
    assert "busy" not in err and "Warning" not in optimizer.table(result)
    assert all(r["load_average"]["after"] == list(QUIET) for r in result["sizes"][0]["rows"])


def test_bench_train_records_each_round_s_load_and_warns_only_when_busy(machine, capsys,
                                                                        monkeypatch):
    """The workers replaced (they run in fresh processes): the load before the start, and
    before and after each speed round, in the JSON and under the table."""
    def fake_process(function, spec):
        if function == "worker":
            return {"mode": spec["mode"], "n_params": 10, "tokens_per_step": 8,
                    "peak_bytes": 100, "peak_rss_delta_bytes": 0, "persistent_bytes": 50}
        return {"times": {mode: [0.1, 0.1] for mode in spec["modes"]}}

    monkeypatch.setattr(train, "_run_process", fake_process)
    for load, busy in ((BUSY, True), (QUIET, False)):
        machine["load"] = load
        result = train.run(modes=("autocast", "plus"), preset="micro", steps=2, warmup=0,
                           rounds=2, threads=1)
        err = capsys.readouterr().err
        assert result["load"]["busy"] is busy and result["load"]["threads"] == 1
        assert err.count("warning: busy machine") == (1 if busy else 0)
        assert [r["load_average"] for r in result["speed_rounds"]] == \
            [{"before": list(load), "after": list(load)}] * 2
        table = train.table(result)
        assert f"{load[0]:.2f} -> {load[0]:.2f}, {load[0]:.2f} -> {load[0]:.2f}" in table
        assert table.startswith("**Warning: busy machine:") is busy
