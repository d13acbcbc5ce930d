"""Issue #3, criterion 7: bad input is refused with a message that says what and how."""

from __future__ import annotations

import re

import pytest
import torch

import collage

from ._common import BF16, FP16, FP32, RULE_CASES, make_mlp

OPTIMIZERS = {"AdamW": collage.AdamW, "SGD": collage.SGD, "Lion": collage.Lion}


@pytest.mark.parametrize("cls", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
@pytest.mark.parametrize("strategy", ["plus", "mixed", "bf16", "kahan", "stochastic", "light",
                                      "split"])
def test_fp32_weights_with_a_low_precision_strategy(cls, strategy: str) -> None:
    model = make_mlp(FP32)
    with pytest.raises(TypeError) as excinfo:
        cls(model.named_parameters(), lr=1e-3, strategy=strategy)
    message = str(excinfo.value)
    assert "'fc1.weight'" in message  # the parameter, by name
    assert f"'{strategy}'" in message  # the strategy
    assert "model.to(torch.bfloat16)" in message  # the fix
    assert "float32" in message


def test_unnamed_parameters_are_named_by_position() -> None:
    with pytest.raises(TypeError, match=r"'group0\.param0'.*'plus'"):
        collage.AdamW(make_mlp(FP32).parameters(), strategy="plus")


def test_bf16_weights_with_fp32_strategy() -> None:
    with pytest.raises(TypeError, match=r"'fc1\.weight' is bfloat16 but strategy 'fp32'"):
        collage.AdamW(make_mlp(BF16).named_parameters(), strategy="fp32")


def test_split_refuses_fp16() -> None:
    with pytest.raises(TypeError, match=r"float16 but strategy 'split' needs bfloat16"):
        collage.AdamW(make_mlp(FP16).named_parameters(), strategy="split")


@pytest.mark.parametrize("bad", ["plus2", "PLUS", "", None, 3])
def test_unknown_strategy_lists_the_valid_names(bad) -> None:
    with pytest.raises(ValueError, match="unknown") as excinfo:
        collage.AdamW(make_mlp().parameters(), strategy=bad)
    for name in collage.STRATEGIES:
        assert name in str(excinfo.value)


def test_unknown_strategy_in_a_group() -> None:
    model = make_mlp()
    with pytest.raises(ValueError, match="valid strategies are"):
        collage.AdamW([{"params": model.parameters(), "strategy": "kahn"}])


HYPERPARAMETER_ERRORS = [
    (collage.AdamW, {"lr": -1e-3}, "lr must be >= 0"),
    (collage.SGD, {"lr": -0.1}, "lr must be >= 0"),
    (collage.Lion, {"lr": -1e-4}, "lr must be >= 0"),
    (collage.AdamW, {"lr": float("nan")}, "lr must be finite"),
    (collage.AdamW, {"lr": torch.tensor([1e-3, 1e-3])}, "lr must be a number or a one-element"),
    (collage.AdamW, {"eps": -1e-8}, "eps must be >= 0"),
    (collage.AdamW, {"weight_decay": -0.1}, "weight_decay must be >= 0"),
    (collage.AdamW, {"betas": (0.9, 1.0)}, re.escape("betas[1] must be in [0, 1)")),
    (collage.AdamW, {"betas": (-0.1, 0.999)}, re.escape("betas[0] must be in [0, 1)")),
    (collage.AdamW, {"betas": (0.9,)}, "betas must be a pair"),
    (collage.AdamW, {"betas": (0.9, torch.tensor(0.999))}, "both floats or both Tensors"),
    (collage.Lion, {"betas": (torch.tensor(0.9), 0.99)}, "both floats or both Tensors"),
    (collage.Lion, {"betas": (1.5, 0.99)}, re.escape("betas[0] must be in [0, 1)")),
    (collage.SGD, {"lr": 0.1, "momentum": -0.9}, "momentum must be >= 0"),
    (collage.SGD, {"lr": 0.1, "nesterov": True}, "nesterov=True needs momentum > 0"),
    (collage.AdamW, {"nonfinite": "drop"}, "nonfinite='drop' is unknown"),
    (collage.AdamW, {"track_updates": -1}, "track_updates must be"),
    (collage.AdamW, {"foreach": True, "fused": True}, "exclusive"),
]


@pytest.mark.parametrize(("cls", "kwargs", "message"), HYPERPARAMETER_ERRORS,
                         ids=[f"{c.__name__}-{'-'.join(k)}" for c, k, _ in HYPERPARAMETER_ERRORS])
def test_bad_hyperparameters(cls, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(make_mlp().parameters(), **kwargs)


def test_a_scheduler_may_write_a_tensor_beside_a_number_in_betas() -> None:
    """As torch.optim: two tensor betas, then OneCycleLR(cycle_momentum=True) writes
    (float, tensor) into the group; torch's step takes it, and so does ours, with torch's
    bits on the foreach path (every step refused it before). The constructor still refuses
    such a pair (test_bad_hyperparameters)."""
    weights = {}
    for name, cls, kwargs in (("torch", torch.optim.AdamW, {}),
                              ("collage", collage.AdamW, {"strategy": "fp32", "foreach": True})):
        param = torch.nn.Parameter(torch.linspace(-1, 1, 16))
        opt = cls([param], lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999)), **kwargs)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
        assert [type(b) for b in opt.param_groups[0]["betas"]] == [float, torch.Tensor]
        for step in range(4):
            param.grad = torch.linspace(1, -1, 16) * (step + 1)
            opt.step()
            schedule.step()
        weights[name] = param.detach()
    assert torch.equal(weights["collage"], weights["torch"])


def test_wrong_hyperparameter_type() -> None:
    with pytest.raises(TypeError, match="lr must be a number, got str"):
        collage.AdamW(make_mlp().parameters(), lr="1e-3")


def test_complex_parameters() -> None:
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"'z' is complex.*view_as_real"):
        collage.AdamW([("z", param)], strategy="fp32")


def test_sparse_gradients() -> None:
    embedding = torch.nn.Embedding(10, 4, sparse=True).to(BF16)
    opt = collage.AdamW(embedding.named_parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match=r"'weight' has a sparse gradient.*dense"):
        opt.step()


@pytest.mark.parametrize("rule", RULE_CASES, ids=str)
def test_gradient_dtype_must_match_the_weight(rule) -> None:
    param = torch.nn.Parameter(torch.ones(3, dtype=BF16))
    opt = rule.make([("w", param)], "plus")
    if hasattr(param, "grad_dtype"):  # torch >= 2.9 checks .grad assignments itself
        param.grad_dtype = None
    param.grad = torch.ones(3, dtype=FP32)
    with pytest.raises(TypeError, match=r"gradient of parameter 'w' is torch\.float32 but the "
                                        r"weight is torch\.bfloat16"):
        opt.step()
    assert torch.equal(param.detach(), torch.ones(3, dtype=BF16))  # nothing was updated


def test_repeated_groups_are_refused_by_state_dict_naming_the_parameter() -> None:
    """torch.optim saves ``param_groups.extend(param_groups)`` and would step each parameter
    twice; we refuse, naming the parameter and the fix (issue #42, item 15)."""
    param = torch.nn.Parameter(torch.ones(4, dtype=BF16))
    opt = collage.AdamW([("w", param)])
    opt.param_groups.extend(opt.param_groups)
    with pytest.raises(ValueError, match=r"'w' is in param group 0 and also in param group 1"
                                         r".*list each parameter in one group"):
        opt.state_dict()
