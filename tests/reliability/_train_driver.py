"""Run ``collage train`` (argv as on the command line), optionally freezing inside a save so
that the parent process can SIGKILL it there. Fault injection only pauses the real code: the
harness's own ``save_atomic`` runs unchanged up to the chosen point.

Environment:

* ``RELIABILITY_PAUSE``: ``write`` (in the middle of writing the checkpoint's temporary file:
  half of its bytes written and fsynced), ``rename`` (the temporary file complete, just before
  ``os.replace`` publishes it), ``final`` (half-way through writing ``model_fp32.pt``'s temporary file
  at the end of the run), or empty (no pause: the parent kills at a random time);
* ``RELIABILITY_PAUSE_AT``: pause at the n-th checkpoint save (``write``/``rename``);
* ``RELIABILITY_MARKER``: a file created when the process has paused;
* ``RELIABILITY_GATE``: a file to wait for, once everything ``collage train`` imports is
  imported, before training starts: the parent starts the next round's process while it
  resumes this one, and lets it train when it is ready to kill it (the imports, about
  three seconds a process, overlap the resume).
"""

from __future__ import annotations

import importlib
import io
import os
import sys
import time


def _pause(marker: str) -> None:
    with open(marker, "w") as handle:
        handle.write(str(os.getpid()))
    while True:  # until SIGKILL
        time.sleep(60)


def _install(mode: str, at: int, marker: str) -> None:
    import torch

    calls = {"save": 0, "replace": 0}
    real_save, real_replace = torch.save, os.replace

    def _half_then_pause(obj, handle, *args, **kwargs) -> None:
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        handle.write(data[: len(data) // 2])
        handle.flush()
        os.fsync(handle.fileno())
        _pause(marker)

    def save(obj, f, *args, **kwargs):
        if mode == "write" and hasattr(f, "write"):  # save_atomic writes to a handle
            calls["save"] += 1
            if calls["save"] == at:
                _half_then_pause(obj, f, *args, **kwargs)
        if mode == "final" and hasattr(f, "write") and "format" not in obj:
            _half_then_pause(obj, f, *args, **kwargs)  # the weights, not a checkpoint
        return real_save(obj, f, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        if mode == "rename" and str(dst).endswith("checkpoint.pt"):
            calls["replace"] += 1
            if calls["replace"] == at:
                _pause(marker)
        return real_replace(src, dst, *args, **kwargs)

    torch.save = save
    os.replace = replace


def main() -> int:
    mode = os.environ.get("RELIABILITY_PAUSE", "")
    if mode:
        _install(mode, int(os.environ.get("RELIABILITY_PAUSE_AT", "0")),
                 os.environ["RELIABILITY_MARKER"])
    from collage.cli import main as cli_main

    gate = os.environ.get("RELIABILITY_GATE", "")
    if gate:
        importlib.import_module("torch._dynamo")  # what building the optimizer imports

        while not os.path.exists(gate):
            time.sleep(0.01)
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
