"""torch.distributed.checkpoint (DCP) with collage optimizers, resharding included.

Two FSDP2 ranks train 5 steps, save model and optimizer with ``get_state_dict`` +
``dcp.save``, and train 5 more (the uninterrupted run). A fresh model with other weights then
loads the checkpoint with ``dcp.load`` + ``set_state_dict`` -- once as a plain model in one
process (no process group), once sharded over two ranks -- and trains the same 5 steps.
Checked for every strategy:

* the checkpoint metadata keeps each state's dtype (fp32 masters/moments stay float32,
  ``weight_low_bits`` stays int16, bf16 states stay bf16) and the loaded states have them;
* the loaded optimizer's step counter is the saved one;
* ``collage.consolidate`` of the loaded model equals that of the saving FSDP2 model;
* the resumed run equals the uninterrupted one bitwise, metrics included.
"""

from __future__ import annotations

import pytest

from . import _common as C
from .conftest import QUICK_DCP as QUICK
from .conftest import assert_check as check_outcome
from .conftest import outcome_for

pytestmark = pytest.mark.distributed


def strategies():
    return [pytest.param(s, marks=() if s in QUICK else pytest.mark.slow) for s in
            C.ALL_STRATEGIES]


def assert_check(request, task, strategy, check):
    outcome = outcome_for(request, strategy in QUICK, task)
    check_outcome(outcome, task, strategy, check)
    return outcome


@pytest.mark.parametrize("strategy", strategies())
def test_checkpoint_keeps_state_dtypes(request, strategy):
    assert_check(request, "dcp_save", strategy, "dtypes")


LOADS = [pytest.param("dcp_load1", id="load_on_1_rank"),
         pytest.param("dcp_load2", id="load_on_2_ranks")]


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("strategy", strategies())
def test_loaded_states_have_layout_and_dtypes(request, strategy, load):
    assert_check(request, load, strategy, "layout")


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("strategy", strategies())
def test_loaded_consolidation_equals_saved(request, strategy, load):
    assert_check(request, load, strategy, "consolidate")


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("strategy", strategies())
def test_resumed_training_is_identical(request, strategy, load):
    outcome = assert_check(request, load, strategy, "resume")
    assert outcome.result(load, strategy)["resumed_bitwise"]
    assert not outcome.problems(load, strategy, "stats")


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("strategy", ["split"])
def test_step_counter_survives(request, strategy, load):
    """``state_dict()['collage']`` (steps taken, skipped steps, the stochastic-rounding
    generator) must survive ``get_state_dict``/``set_state_dict``."""
    assert_check(request, load, strategy, "counters")
