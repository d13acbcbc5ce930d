"""Start the ranks of ``_worker.py`` as subprocesses and collect what they report.

Rendezvous is a FileStore in a temporary folder (no ports). A rank that crashes (any exit
code but 0 and 3, "checks failed") fails the launch; the others get a short grace period and
are then killed, so a rank stuck in a collective never hangs the test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "_worker.py"
CHECKS_FAILED = 3  # _worker.py's exit code when checks failed (it ran to the end)


@dataclass
class Outcome:
    codes: list[int]
    outputs: list[str]
    failures: list[tuple[str, str, str, str]] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)

    def log(self) -> str:
        return "\n".join(f"--- rank {r} (exit {c}) ---\n{out[-6000:]}"
                         for r, (c, out) in enumerate(zip(self.codes, self.outputs)))

    def crashed(self) -> bool:
        """A rank died (exception, signal, timeout) rather than reporting failed checks."""
        return any(code not in (0, CHECKS_FAILED) for code in self.codes)

    def problems(self, task: str, strategy: str, check: str) -> list[str]:
        return [msg for t, s, c, msg in self.failures if (t, s, c) == (task, strategy, check)]

    def result(self, task: str, strategy: str) -> dict:
        found = [r for r in self.results if r["task"] == task and r["strategy"] == strategy]
        assert found, f"no RESULT for {task} {strategy}\n{self.log()}"
        return found[0]


def launch(cases: list[str], world: int, folder: Path, *, timeout: float = 600) -> Outcome:
    """Run ``_worker.py RANK WORLD STORE folder *cases`` for every rank; parse the output."""
    folder.mkdir(parents=True, exist_ok=True)
    store = folder / f"store_{world}_{time.monotonic_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    logs = [open(folder / f"rank{rank}_{store.name}.log", "w+") for rank in range(world)]
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), str(store),
                          str(folder), *cases], stdout=log, stderr=subprocess.STDOUT, env=env)
        for rank, log in enumerate(logs)
    ]
    deadline = time.monotonic() + timeout
    grace_end = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if grace_end is None and any(p.poll() not in (None, 0, CHECKS_FAILED)
                                         for p in procs):
                grace_end = now + 15  # one rank crashed: the others may wait on it forever
            if now > deadline or (grace_end is not None and now > grace_end):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    outcome = Outcome([p.returncode for p in procs], outputs)
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("FAIL "):
                head, _, msg = line[5:].partition(": ")
                task, strategy, check = head.split(" ")
                outcome.failures.append((task, strategy, check, msg))
            elif line.startswith("RESULT "):
                outcome.results.append(json.loads(line[7:]))
    return outcome
