"""``benchmarks/gpu_model.py`` on CPU: the Triton kernels compiled for sm_90 without a GPU,
their SASS read. Every aligned whole-block variant must move every component with 16-byte
global loads and stores, no variant may spill registers or need more than 128 (the launcher
puts ``PROGRAMS_PER_SM`` programs of ``GPU_WARPS`` warps on each multiprocessor), and the
model must reproduce the one H200 measurement of the kernels before #29 from that
run's instruction counts (docs/gpu.md "The model"). Skipped where Triton's NVIDIA backend is
absent."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from collage.optim import get_strategy
from collage.optim.rules import RULES
from collage.optim.triton import launch as launches

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("gpu_model", ROOT / "benchmarks" / "gpu_model.py")
gpu_model = importlib.util.module_from_spec(_SPEC)
sys.modules["gpu_model"] = gpu_model
_SPEC.loader.exec_module(gpu_model)

pytestmark = pytest.mark.skipif(not gpu_model.tools_available(),
                                reason="Triton's NVIDIA backend (nvdisasm) is not installed")


@pytest.fixture(scope="module")
def default_rows() -> list:
    """The default configuration's variants of every rule and strategy, sm_90."""
    return gpu_model.model_rows([90], None, None, default_only=True, calibration=False)


def _vectors(rule: str, strategy: str) -> tuple[int, int]:
    """16-byte loads and stores a thread's tile needs: every column it reads (the gradient,
    the components a step reads) and writes, 8 elements each (BLOCK / threads)."""
    elements = launches.GPU_BLOCK // (32 * launches.GPU_WARPS)
    chosen = get_strategy(strategy)
    dtype = chosen.weight_dtypes[0]
    components = chosen.components(RULES[rule], dtype)
    read = dtype.itemsize + sum(c.bytes for c in components if c.read)
    write = sum(c.bytes for c in components)
    return read * elements // 16, write * elements // 16


def test_every_aligned_whole_block_moves_every_component_in_16_byte_vectors(default_rows):
    wholes = [r for r in default_rows if r.variant == "whole" and r.rule != "-"]
    assert len(wholes) == 3 * 8  # AdamW, SGD, Lion x the eight strategies the kernels land
    for row in wholes:
        loads, stores = _vectors(row.rule, row.strategy)
        ops = row.sass_memory_ops
        assert ops.get("LDG.E.128") == loads, (row.rule, row.strategy, ops)
        assert ops.get("STG.E.128") == stores, (row.rule, row.strategy, ops)
        # nothing narrower moves data: the rest are the table's addresses (64-bit) and
        # 32-bit scalars (the tile's row and block, the verdict, the coefficients)
        assert set(ops) <= {"LDG.E.128", "STG.E.128", "LDG.E.64", "LDG.E"}, ops


def test_the_check_kernel_reads_whole_blocks_in_16_byte_vectors_and_writes_no_data(
        default_rows):
    """The default check of a planned step (``kernels.nonfinite_check``): a thread's 8
    gradient elements of a whole block in one 16-byte load (bf16) or two (float32), no
    store but the verdict's atomic (not a ``STG``), memory-bound on the model."""
    checks = {(r.strategy, r.variant): r for r in default_rows if r.rule == "-"}
    assert set(checks) == {(f"check of {d} gradients", v) for d in ("bf16", "fp32")
                           for v in ("whole", "tail")}
    for dtype, vectors in (("bf16", 1), ("fp32", 2)):
        ops = checks[f"check of {dtype} gradients", "whole"].sass_memory_ops
        assert ops.get("LDG.E.128") == vectors, ops
        assert set(ops) <= {"LDG.E.128", "LDG.E.64", "LDG.E"}, ops
    # several blocks an iteration: the whole blocks' loop keeps what Little's law asks in
    # flight (issue #44: one block at a time, a third of it)
    assert all(r.bytes_in_flight_per_sm >= r.little_bytes_per_sm
               for r in checks.values() if r.variant == "whole")


def test_no_variant_spills_or_exceeds_the_launch_s_register_budget(default_rows):
    budget = 65536 // (launches.PROGRAMS_PER_SM * 32 * launches.GPU_WARPS)
    for row in default_rows:  # the persistent programs must all be resident
        assert row.spills == 0, (row.rule, row.strategy, row.variant)
        assert row.registers <= budget, (row.rule, row.strategy, row.variant, row.registers)


def test_the_persistent_kernels_loop_and_the_model_says_so(default_rows):
    assert all(r.overlapped for r in default_rows if r.variant == "whole")


#: the H200 run of the kernels before #29 (AdamW, 1B parameters, no check): fast-path SASS
#: instructions per element read off those kernels (issue #29's table) and the fraction of
#: the achievable bandwidth measured (docs/gpu.md); bytes per element from the strategies
H200_BEFORE = {"fp32": (58, 28, 0.80), "bf16": (79, 14, 0.57), "light": (117, 18, 0.54),
               "plus": (156, 22, 0.52)}


@pytest.mark.parametrize("strategy", sorted(H200_BEFORE))
def test_the_model_reproduces_the_h200_run_within_two_points(strategy):
    instructions, nbytes, measured = H200_BEFORE[strategy]
    predicted = gpu_model.predict(gpu_model.GPUS[90], 1.01e9, nbytes, instructions,
                                  overlapped=False)
    assert abs(predicted - measured) <= 0.02


def test_overlap_never_predicts_less_and_is_bounded_by_the_slower_side():
    gpu = gpu_model.GPUS[90]
    for instructions in (10, 60, 120, 400):
        apart = gpu_model.predict(gpu, 1e9, 18, instructions, overlapped=False)
        together = gpu_model.predict(gpu, 1e9, 18, instructions, overlapped=True)
        memory = 18 / gpu.achievable
        compute = instructions / gpu.thread_instructions_per_s
        assert together >= apart
        assert together == pytest.approx(memory / max(memory, compute))


def test_a_hidden_host_sets_the_pace_only_when_it_is_the_slower_side():
    """Serial host time lowers the fraction by ``device / (device + host)``; hidden, the
    slower of the two sets the pace: no effect while the device is slower, and
    ``device / host`` once the host is."""
    gpu = gpu_model.GPUS[90]
    n, nbytes = 1e8, 22
    device = n * nbytes / gpu.achievable  # 0.51 ms; 20 instructions: memory-bound
    for host in (0.5 * device, 2 * device):
        serial = gpu_model.predict(gpu, n, nbytes, 20, True, host_s=host)
        hidden = gpu_model.predict(gpu, n, nbytes, 20, True, host_s=host, host_hidden=True)
        assert serial == pytest.approx(device / (device + host))
        assert hidden == pytest.approx(min(1.0, device / host))


def test_json_output_has_the_documented_keys(capsys):
    assert gpu_model.main(["--arch", "90", "--json", "--no-host", "--rules", "adamw",
                           "--strategies", "light", "--default-only"]) == 0
    rows = json.loads(capsys.readouterr().out)
    keys = {"strategy", "variant", "registers", "spills", "instructions_per_element",
            "sass_memory_ops", "bytes_per_element", "predicted_1b", "predicted_100m",
            "bytes_in_flight_per_sm", "overlap_window", "launched_variant",
            "predicted_1b_host_added", "predicted_100m_host_added",
            "predicted_100m_host_hidden"}
    assert rows and all(keys <= set(row) for row in rows)
    assert {row["variant"] for row in rows} >= {"whole", "tail", "copy"}
    assert all(0 < row["predicted_1b"] <= 1 and 0 < row["predicted_100m"] <= 1
               for row in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without a GPU")
def test_the_host_on_a_missing_gpu_falls_back_to_this_cpu_with_a_warning(capsys):
    """``--host-device cuda`` where there is no GPU: one warning and this CPU's host time
    (launches stubbed), so that the model's table still comes back from a run."""
    host = gpu_model._host_on_gpu_or_cpu("cuda")
    assert "could not be measured" in capsys.readouterr().err
    assert host["skip_launches"] > 0 and host["skip"] > host["skip_python"] > 0


def _sass(program: list[tuple[str, str, tuple[int, int, int, int]]]) -> "gpu_model.Sass":
    """A straight-line kernel: (opcode, operands, (stall, write, read, wait mask))."""
    return gpu_model.Sass([(op, False, operands) for op, operands, _ in program], {}, 32, 0,
                          [control for _, _, control in program])


def test_control_codes_are_read_from_the_encoding_s_high_word():
    """sm_90 SASS as nvdisasm -hex prints it: ``LDG.E R15, [R4.64]`` (0x000ea8000c1e1900:
    4 stall cycles, writes scoreboard 2) and ``IMAD.WIDE R6, R15, 0x50`` after it
    (0x044fe200078e02ff: waits on scoreboard 2)."""
    assert gpu_model.control(0x000EA8000C1E1900) == (4, 2, 7, 0)
    assert gpu_model.control(0x044FE200078E02FF) == (1, 7, 7, 0b000100)


def test_a_warp_s_window_is_the_work_issued_while_its_data_is_in_flight():
    """A data load (its address from the thread's index) on scoreboard 0, 10 independent
    instructions, then a wait on it: the window is those instructions and the wait stalls
    for the DRAM latency; a uniform load (the table's) is ``cached``, not data."""
    nop = ("FADD", " R20, R21, R22", (1, 7, 7, 0))
    program = [("S2R", " R0, SR_TID.X", (1, 1, 7, 0)),
               ("LDG.E.64", " R8, desc[UR4][R10.64]", (1, 2, 7, 0b10)),
               ("IADD3", " R2, R0, R8, RZ", (1, 7, 7, 0b100)),
               ("LDG.E.128", " R4, desc[UR4][R2.64]", (1, 0, 7, 0)),
               *[nop] * 10,
               ("FADD", " R12, R4, R5", (1, 7, 7, 0b1))]
    timing = gpu_model.loop_timing(_sass(program), {"dram": 1000, "cached": 100, "short": 20})
    assert timing.window == 10 and timing.bytes_in_flight == 16 and timing.data_bytes == 16
    assert timing.data_waits == 1 and timing.cached_waits == 1
    assert timing.cycles >= 20 + 100 + 1000


def test_the_latency_model_reproduces_the_h200_run_within_three_points():
    """From the SASS of the kernels the H200 ran (``H200_REVISION``), with the fitted issue
    efficiency (``ISSUE_EFFICIENCY``): issue #44's condition for its predictions to count."""
    fit = gpu_model.calibrate(dram_latencies=(gpu_model.LATENCY["dram"],),
                              efficiencies=(gpu_model.ISSUE_EFFICIENCY,))
    assert fit["fits"][0]["largest_miss"] <= 0.03, fit
