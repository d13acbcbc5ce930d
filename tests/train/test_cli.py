"""The train and memory commands, and one-line errors (exit 2, no traceback) on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import collage
from collage.cli import build_parser, main
from collage.train.config import ModelConfig
from collage.train.data import VOCAB_SIZE
from collage.train.flags import config_from_args
from collage.train.models import build_model


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--strategies", "fp16"], "unknown strategy 'fp16'; valid: fp32, mixed"),
        (["train", "--strategy", "fp16"], "--strategy: unknown strategy 'fp16'"),
        (["compare", "--data", "/no/such.txt"], "--data: cannot read '/no/such.txt'"),
        (["compare", "--d-model", "30", "--n-heads", "4"], "heads do not divide"),
        (["compare", "--batch-size", "100000"], "too short for --batch-size 100000"),
        (["compare", "--lr", "1e-3x"], "--lr: expected a number, got '1e-3x'"),
        (["train", "--steps", "ten"], "--steps: expected an integer"),
        (["memory", "--params", "lots"], "--params: expected a number"),
        (["memory", "--strategy", "plus,nope"], "--strategy: unknown strategy 'nope'"),
        (["memory", "--grad-dtype", "fp8"], "--grad-dtype: expected one of bf16, fp32, none"),
        (["train", "--nproc", "3", "--batch-size", "4"],
         "--nproc 3: --batch-size 4 must be divisible by it"),
        (["train", "--nproc", "0"], "--nproc: must be positive, got 0"),
        (["train", "--nproc", "2", "--grad-accum", "2"],
         "--grad-accum 2 with --nproc 2: each rank runs its slice"),  # (was ignored)
        (["train", "--seed", "-1"], "--seed: must be in [0, 2**64)"),
        (["compare", "--seeds", "3", "--seed", str(2**64 - 2)],
         "--seed: must be in [0, 2**64) (and --seeds 3's last"),
        (["train", "--strategy", "auto", "--auto-every", "0"], "--auto-every: must be an "
         "integer >= 1"),
        (["train", "--strategy", "auto", "--auto-threshold", "-1"], "--auto-threshold: must "
         "be a fraction in [0, 1)"),
        (["compare", "--no-isolate", "--jobs", "2"], "--jobs: needs --isolate"),
        (["compare", "--strategies", "fp32", "bf16", "--lrs", "1e-3", "4e-3",
          "--lrs-strategies", "plus"], "--lrs: none of --lrs-strategies (plus) is compared"),
        (["train", "--data", "EMPTY"], "the training text (0 tokens from file"),
        (["compare", "--beta2s", "0.95", "0.95"], "--beta2s: a beta2 is listed twice"),
        # flags that would have no effect (they were accepted and ignored; audit 2026-12-07)
        (["train", "--dataset-config", "wikitext-2-raw-v1"],
         "--dataset-config: applies to --dataset, which is not given"),
        (["compare", "--data", "EMPTY", "--text-column", "body"],
         "--text-column: applies to --dataset, which is not given"),
        (["train", "--dataset-split", "test"], "--dataset-split: applies to --dataset"),
        (["train", "--dataset", "EMPTY", "--dataset-config", "raw"],
         "is a local file or directory; a configuration name applies to a Hugging Face hub"),
        (["train", "--vocab-size", "100"], "--vocab-size: applies to --tokenizer bpe"),
        (["compare", "--mlm-probability", "0.2"],
         "--mlm-probability: only the masked LM (--family bert) masks tokens; this run's "
         "family is gpt"),
        (["compare", "--checkpoint-every", "5"],
         "--checkpoint-every: compare keeps its runs' checkpoints only with --resume"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys, tmp_path):
    empty = tmp_path / "empty.txt"  # EMPTY: an empty data file (encoded, then too short)
    empty.write_bytes(b"")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    argv = argv + (["--out", str(tmp_path / "out")] if argv[0] != "memory" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith(f"collage {argv[0]}: error: ")
    if argv[0] == "train":  # refused before anything was written: no --out left behind
        assert not (tmp_path / "out").exists()


def test_beta2_on_the_command_line_overrides_the_presets_beta2_sweep():
    """A preset's ``beta2s`` sweep gives way to ``--beta2`` given on the command line (a
    flag overrides its preset's value); ``--beta2s`` given too overrides ``--beta2``."""
    parser = build_parser()
    config = config_from_args(parser.parse_args(
        ["compare", "--preset", "paper-small", "--beta2", "0.9"]), "compare")
    assert config.optim.beta2 == 0.9 and config.run.beta2s == ()
    config = config_from_args(parser.parse_args(
        ["compare", "--preset", "paper-small", "--beta2", "0.9", "--beta2s", "0.98"]),
        "compare")
    assert config.run.beta2s == (0.98,)
    assert config_from_args(parser.parse_args(["compare", "--preset", "paper-small"]),
                            "compare").run.beta2s == (0.95, 0.999)


def test_flags_that_take_effect_are_accepted():
    """The flags refused above where they would do nothing are accepted where they act; a
    preset's own values are not requests (study's --checkpoint-every under --no-resume)."""
    parser = build_parser()
    for command, argv in [
        ("train", ["--family", "bert", "--mlm-probability", "0.2"]),
        ("train", ["--tokenizer", "bpe", "--vocab-size", "1024"]),
        ("compare", ["--resume", "--checkpoint-every", "5"]),
        ("compare", ["--preset", "study", "--no-resume"]),
        ("train", ["--dataset", "wikitext", "--dataset-config", "wikitext-2-raw-v1",
                   "--dataset-split", "test", "--text-column", "body"]),
    ]:
        config = config_from_args(parser.parse_args([command, *argv]), command)
        assert config.data.batch_size > 0, argv


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "collage", "compare", "--strategies", "nope", "--out",
         str(tmp_path)], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "unknown strategy 'nope'" in proc.stderr


def test_memory_command(capsys):
    assert main(["memory", "--params", "6.7e9"]) == 0
    out = capsys.readouterr().out
    for name in collage.STRATEGIES:
        assert name in out
    assert "107.20" in out and "53.60" in out
    assert main(["memory", "--params", "7B", "--strategy", "plus", "mixed", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == 7e9
    plus, mixed = data["strategies"]
    assert plus["total"] == 12 and mixed["total"] == 16
    assert plus["saving_vs_mixed_bytes"] == 4 * 7e9
    assert main(["memory", "--params", "1e9", "--grad-dtype", "fp32", "--json"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["strategies"]}
    assert rows["bf16"]["total"] == 10 and rows["fp32"]["total"] == 16


def test_train_command_stop_resume_and_export(tmp_path, capsys):
    out = str(tmp_path / "t")
    base = ["train", "--preset", "micro", "--strategy", "light", "--out", out, "--quiet"]
    assert main(base + ["--stop-after", "3"]) == 0
    assert not os.path.exists(os.path.join(out, "model_fp32.pt"))
    with open(os.path.join(out, "summary.json")) as handle:
        assert json.load(handle)["steps"] == 3
    assert main(base + ["--resume"]) == 0
    with open(os.path.join(out, "summary.json")) as handle:
        summary = json.load(handle)
    assert summary["steps"] == 6 and summary["completed"]
    with open(os.path.join(out, "history.json")) as handle:
        assert len(json.load(handle)["train_loss"]) == 6
    weights = torch.load(os.path.join(out, "model_fp32.pt"), weights_only=True)
    model = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, context=32), VOCAB_SIZE)
    model.load_state_dict(weights)
    assert all(v.dtype == torch.float32 for v in weights.values())


def test_train_a_torchao_baseline_checkpoints_resumes_and_exports(tmp_path):
    """``--strategy torchao-adamw8bit`` (an opt-in baseline): its 8-bit states are tensor
    subclasses, digested through their inner tensors (they have no bytes of their own to
    view), and its weights are the model's own, widened: before, its checkpoint and its
    export raised after training, and nothing was written."""
    pytest.importorskip("torchao")
    out = str(tmp_path / "t")
    base = ["train", "--preset", "micro", "--strategy", "torchao-adamw8bit", "--out", out,
            "--quiet"]
    assert main(base + ["--stop-after", "3"]) == 0
    assert main(base + ["--resume"]) == 0
    with open(os.path.join(out, "summary.json")) as handle:
        assert json.load(handle)["completed"]
    weights = torch.load(os.path.join(out, "model_fp32.pt"), weights_only=True)
    assert weights and all(v.dtype == torch.float32 for v in weights.values()
                           if v.is_floating_point())


def _rank_run(argv: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "collage", *argv], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_train_nproc_2_matches_one_process_and_resumes(tmp_path):
    """``--nproc 2``: torchrun + DDP (gloo), each rank on half of every batch; interrupted
    after step 3 and resumed, still with two ranks, from rank 0's checkpoint.

    Against one process on the whole batches: the global loss is the same function of the
    same weights, so the histories differ only by the order of the gradient sums and DDP's
    bfloat16 gradient average (one extra rounding, <= 2**-9 relative, per element). Measured
    difference: about 1e-5 relative over the 6 steps; the bound 1e-4 keeps a 10x margin while
    a rank training on its half-batch alone (no gradient average, or the wrong slice) moves
    the step-2 loss by about 3e-3 relative.
    """
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    base = ["train", "--preset", "micro", "--strategy", "plus", "--quiet"]
    _rank_run(base + ["--nproc", "2", "--out", two, "--stop-after", "3"])
    assert not os.path.exists(os.path.join(two, "model_fp32.pt"))
    _rank_run(base + ["--nproc", "2", "--out", two, "--resume"])
    assert main(base + ["--out", one, "--threads", "1"]) == 0

    def read(folder: str, name: str) -> dict:
        with open(os.path.join(folder, name)) as handle:
            return json.load(handle)

    summary_two, summary_one = read(two, "summary.json"), read(one, "summary.json")
    assert summary_two["world_size"] == 2 and summary_one["world_size"] == 1
    assert summary_two["completed"] and summary_two["steps"] == 6
    losses_two = read(two, "history.json")["train_loss"] + [summary_two["final_val_loss"]]
    losses_one = read(one, "history.json")["train_loss"] + [summary_one["final_val_loss"]]
    assert len(losses_two) == len(losses_one) == 7
    for a, b in zip(losses_two, losses_one):
        assert abs(a - b) <= 1e-4 * abs(b), (losses_two, losses_one)
    weights = torch.load(os.path.join(two, "model_fp32.pt"), weights_only=True)
    assert not any(name.startswith("module.") for name in weights)  # not DDP's wrapper names


def test_a_reader_that_leaves_ends_the_command_quietly():
    """``collage compare --dry-run | head -1``: the pipe closes under the plan's output;
    the command stops with 141 (128 + SIGPIPE) and no traceback (audit, 2026-12-07). Here
    the reader closes its end before the command writes (it is still importing), so every
    write fails, as the late ones do under ``head``."""
    command = subprocess.Popen([sys.executable, "-m", "collage", "compare", "--preset",
                                "micro", "--dry-run"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    command.stdout.close()
    err = command.stderr.read()
    assert command.wait(timeout=120) == 141 and err == "", err


def test_the_dry_run_names_a_dataset(capsys, tmp_path):
    """--dataset shows as such in the plan (it said "data: built-in"; audit, 2026-12-07)."""
    text = tmp_path / "local.txt"
    text.write_text("some text\n")
    assert main(["compare", "--preset", "micro", "--dataset", str(text), "--dry-run"]) == 0
    assert f"data: dataset {text}, tokenizer" in capsys.readouterr().out
