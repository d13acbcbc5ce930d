"""Update rules: AdamW, SGD (momentum, Nesterov) and Lion.

A rule turns a gradient and its states into the intended update, returned as
``(decay, update, scale)`` meaning ``w_new = w * decay + update * scale`` (``decay = 1 - lr *
wd`` for decoupled weight decay; ``scale`` None means 1). Keeping ``scale`` apart lets the
landing be one fused multiply-add, as torch's ``add_(x, alpha=-lr)`` is. Each rule has two kernels over one parameter:

* ``fast``: float32 registers. States arrive as float32 working tensors (the stored tensor
  itself when it is float32) and are updated in place; the caller stores them back.
* ``reference``: the paper's arithmetic op by op in the weight's low-precision dtype, every
  intermediate correctly rounded (``LowpArith``); returns the update already combined with the
  weight-decay term, ``d = fl(fl(-lr*wd * w) + u)``, in that dtype.

Coefficients that depend only on the step (bias corrections) are computed on the host in
float64 by ``coefficients`` and passed in a dict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .. import mcf
from .rounding import LowpArith

__all__ = ["Rule", "StateSpec", "ADAMW", "SGD", "LION", "RULES", "reference_decay_term",
           "number", "check_betas"]

Coeffs = Mapping[str, float]


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a rule. ``slow``: an EMA with beta near 1 (a pair under the
    strategies with ``mcf_slow_states``); ``label``: its short name in tables."""

    name: str
    slow: bool
    label: str


def number(value, name: str) -> float:
    """A hyperparameter as a Python float; 0-d tensors (e.g. a tensor lr) are accepted."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_betas(betas) -> None:
    """A ValueError unless ``betas`` is a pair of numbers in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        value = number(beta, f"betas[{index}]")
        if not 0.0 <= value < 1.0:
            raise ValueError(f"betas[{index}] must be in [0, 1), got {beta}")


class Rule:
    name: str
    title: str  # as users write it: AdamW, SGD, Lion
    states: tuple[StateSpec, ...]
    # Coefficients the kernels branch on: kept as Python values in the compiled path (a
    # change recompiles); every other coefficient becomes a 0-d tensor (no recompilation).
    static: frozenset[str] = frozenset()

    def validate(self, hyper: Mapping) -> None:
        """Check the hyperparameters; errors name the argument."""
        if number(hyper["lr"], "lr") < 0:
            raise ValueError(f"lr must be >= 0, got {hyper['lr']}")
        if number(hyper["weight_decay"], "weight_decay") < 0:
            raise ValueError(f"weight_decay must be >= 0, got {hyper['weight_decay']}")

    def coefficients(self, group: Mapping, step: int) -> dict[str, float]:
        raise NotImplementedError

    def fast(self, weight: torch.Tensor, grad: torch.Tensor, states: dict, c: Coeffs):
        raise NotImplementedError

    def reference(self, ar: LowpArith, weight, grad, states: dict, c: Coeffs, mcf_slow: bool):
        raise NotImplementedError


def reference_decay_term(ar: LowpArith, weight: torch.Tensor, u: torch.Tensor, c: Coeffs):
    """``fl(fl(-lr*wd) * w) + u`` rounded: the weight-decay step folded into the update."""
    if c["lr_wd"] == 0.0:
        return u
    return ar.add(ar.mul(ar.c(-c["lr_wd"], weight), weight), u)


def _reference_ema(ar: LowpArith, states: dict, name: str, beta: float, x, mcf_slow: bool):
    """``s = beta * s + (1 - beta) * x`` in the component dtype; an MCF when ``mcf_slow``.

    The MCF form is Collage-plus's: beta is split as ``bf16(beta) + residual`` (bf16(0.999)
    is 1.0, so the residual carries the whole decay) and the product is an exact-as-possible
    expansion product (``mcf.mul``), then the new contribution is added with ``mcf.grow``.
    """
    increment = ar.mul(ar.c(1.0 - beta, x), x)
    value = states[name]
    if not mcf_slow:
        states[name] = ar.add(ar.mul(ar.c(beta, x), value), increment)
        return
    beta_hi = ar.c(beta, x)
    beta_lo = ar.c(beta - float(beta_hi.double()), x)
    hi, lo = mcf.mul(value, states[name + "_lo"], beta_hi, beta_lo)
    states[name], states[name + "_lo"] = mcf.grow(hi, lo, increment)


class AdamWRule(Rule):
    name = "adamw"
    title = "AdamW"
    states = (StateSpec("exp_avg", False, "m"), StateSpec("exp_avg_sq", True, "v"))

    def validate(self, hyper: Mapping) -> None:
        super().validate(hyper)
        if number(hyper["eps"], "eps") < 0:
            raise ValueError(f"eps must be >= 0, got {hyper['eps']}")
        check_betas(hyper["betas"])

    def coefficients(self, group: Mapping, step: int) -> dict[str, float]:
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        return {
            "lr_wd": lr * group["weight_decay"],
            "decay": 1 - lr * group["weight_decay"],
            "beta1": beta1,
            "beta2": beta2,
            "one_minus_beta1": 1 - beta1,
            "one_minus_beta2": 1 - beta2,
            "step_size": lr / bias_correction1,
            "bias_correction2_sqrt": math.sqrt(bias_correction2),
            "eps": group["eps"],
        }

    def fast(self, weight, grad, states, c):
        # The same operations, in the same order, as torch.optim.AdamW's single-tensor path,
        # so the fp32 strategy reproduces it bit for bit.
        exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
        # Written without Number-only arguments (addcmul's value=) so that coefficients may be
        # 0-d tensors in the compiled path; each expression rounds like torch's kernels do:
        # addcmul(self, t1, t2, value) is fma(value * t1, t2, self), addcdiv is
        # self + (value * t1) / t2.
        exp_avg.lerp_(grad, c["one_minus_beta1"])
        exp_avg_sq.mul_(c["beta2"]).addcmul_(grad * c["one_minus_beta2"], grad)
        denom = (exp_avg_sq.sqrt() / c["bias_correction2_sqrt"]).add_(c["eps"])
        update = (exp_avg * -c["step_size"]) / denom
        return c["decay"], update, None

    def reference(self, ar, weight, grad, states, c, mcf_slow):
        states["exp_avg"] = ar.add(
            ar.mul(ar.c(c["beta1"], grad), states["exp_avg"]),
            ar.mul(ar.c(c["one_minus_beta1"], grad), grad),
        )
        _reference_ema(ar, states, "exp_avg_sq", c["beta2"], ar.mul(grad, grad), mcf_slow)
        root = ar.div(ar.sqrt(states["exp_avg_sq"]), ar.c(c["bias_correction2_sqrt"], grad))
        denom = ar.add(root, ar.c(c["eps"], grad))
        update = ar.div(ar.mul(ar.c(-c["step_size"], grad), states["exp_avg"]), denom)
        return reference_decay_term(ar, weight, update, c)


class SGDRule(Rule):
    """torch.optim.SGD semantics: coupled weight decay, dampening, Nesterov."""

    name = "sgd"
    title = "SGD"
    states = (StateSpec("momentum_buffer", False, "momentum"),)
    static = frozenset({"weight_decay", "momentum", "nesterov", "first_step"})

    def validate(self, hyper: Mapping) -> None:
        super().validate(hyper)
        momentum = number(hyper["momentum"], "momentum")
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        number(hyper["dampening"], "dampening")
        if hyper["nesterov"] and (momentum <= 0 or hyper["dampening"] != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening == 0")

    def coefficients(self, group: Mapping, step: int) -> dict[str, float]:
        return {
            "lr": float(group["lr"]),
            "lr_wd": 0.0,
            "decay": 1.0,
            "weight_decay": group["weight_decay"],
            "momentum": group["momentum"],
            "one_minus_dampening": 1 - group["dampening"],
            "nesterov": float(group["nesterov"]),
            "first_step": float(step == 1),
        }

    def fast(self, weight, grad, states, c):
        # torch.optim.SGD's operations with the same (static) alphas: each add_(x, alpha=a)
        # is one fused multiply-add on CPU, so the fp32 strategy matches it bit for bit.
        if c["weight_decay"] != 0:
            grad = grad.add(weight, alpha=c["weight_decay"])
        if c["momentum"] != 0:
            buf = states["momentum_buffer"]
            if c["first_step"]:
                buf.copy_(grad)
            else:
                buf.mul_(c["momentum"]).add_(grad, alpha=c["one_minus_dampening"])
            grad = grad.add(buf, alpha=c["momentum"]) if c["nesterov"] else buf
        return 1.0, grad, -c["lr"]

    def reference(self, ar, weight, grad, states, c, mcf_slow):
        if c["weight_decay"] != 0:
            grad = ar.add(grad, ar.mul(ar.c(c["weight_decay"], grad), weight))
        if c["momentum"] != 0:
            if c["first_step"]:
                buf = grad
            else:
                buf = ar.add(
                    ar.mul(ar.c(c["momentum"], grad), states["momentum_buffer"]),
                    ar.mul(ar.c(c["one_minus_dampening"], grad), grad),
                )
            states["momentum_buffer"] = buf
            grad = ar.add(grad, ar.mul(ar.c(c["momentum"], grad), buf)) if c["nesterov"] else buf
        return ar.mul(ar.c(-c["lr"], grad), grad)


class LionRule(Rule):
    """Lion (Chen et al. 2023): ``w -= lr * (sign(b1 m + (1-b1) g) + wd w)``,
    ``m = b2 m + (1-b2) g``; m is the slow EMA (MCF under 'plus')."""

    name = "lion"
    title = "Lion"
    states = (StateSpec("exp_avg", True, "m"),)

    def validate(self, hyper: Mapping) -> None:
        super().validate(hyper)
        check_betas(hyper["betas"])

    def coefficients(self, group: Mapping, step: int) -> dict[str, float]:
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        return {
            "lr": lr,
            "lr_wd": lr * group["weight_decay"],
            "decay": 1 - lr * group["weight_decay"],
            "beta1": beta1,
            "beta2": beta2,
            "one_minus_beta1": 1 - beta1,
            "one_minus_beta2": 1 - beta2,
        }

    def fast(self, weight, grad, states, c):
        exp_avg = states["exp_avg"]
        direction = exp_avg.lerp(grad, c["one_minus_beta1"]).sign_()
        exp_avg.lerp_(grad, c["one_minus_beta2"])
        return c["decay"], direction, -c["lr"]

    def reference(self, ar, weight, grad, states, c, mcf_slow):
        mixed = ar.add(
            ar.mul(ar.c(c["beta1"], grad), states["exp_avg"]),
            ar.mul(ar.c(c["one_minus_beta1"], grad), grad),
        )
        update = ar.mul(ar.c(-c["lr"], grad), mixed.sign())
        _reference_ema(ar, states, "exp_avg", c["beta2"], grad, mcf_slow)
        return reference_decay_term(ar, weight, update, c)


ADAMW = AdamWRule()
SGD = SGDRule()
LION = LionRule()
RULES = {rule.name: rule for rule in (ADAMW, SGD, LION)}
