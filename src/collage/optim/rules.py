"""Update rules: AdamW, SGD (momentum, Nesterov) and Lion.

A rule turns a gradient and its states into the intended update. Each rule has two kernels
over one parameter:

* ``fast``: float32 registers. States arrive as float32 working tensors (the stored tensor
  itself when it is float32) and are updated in place; the caller stores them back. Returns
  ``(decay, update, scale)`` meaning ``w_new = w * decay + update * scale`` (``decay = 1 -
  lr * wd`` for decoupled weight decay; ``scale`` None means 1). Keeping ``scale`` apart lets
  the landing be one fused multiply-add, as torch's ``add_(x, alpha=-lr)`` is.
* ``reference``: the research algorithm as it runs (``reference=True``): PyTorch operations
  on the stored states (the states' dtype: each operation computes in float32 and rounds
  once), in the published code's order and AdamW form. Returns the raw update tensor; the
  strategy lands it (``Strategy.land_reference``).

Coefficients that depend only on the step (bias corrections) are computed on the host in
float64 by ``coefficients`` (``reference_coefficients`` for the reference path) and passed in
a dict. ``step_coefficients`` is the same formula over float64 tensors of step counters and
a tensor learning rate, computed on their device (the capturable Triton steps: no host
synchronisation).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .arith import axpy, axpy_

__all__ = ["Rule", "StateSpec", "ADAMW", "SGD", "LION", "RULES", "number", "plain_numbers",
           "check_betas", "refuse_mixed_betas", "WEIGHT_DECAY_STYLES"]

#: AdamW's weight-decay styles on the reference path (the research code's): ``compact``
#: folds ``- lr * wd * w`` into the update; ``torch`` decays the weight before the update,
#: ``HF`` after it. The fast paths decay once in float32, ``w * (1 - lr * wd) + u``: the
#: same value as ``compact`` and ``torch`` in exact arithmetic.
WEIGHT_DECAY_STYLES = ("compact", "torch", "HF")

#: ``slow_ema(states, name, beta, plain, increment)``: the strategy's update of a slowly
#: decaying EMA on the reference path: ``plain(tensor)`` updates a single tensor in place;
#: ``increment()`` makes the new contribution ``(1 - beta) * x`` for a pair.
SlowEMA = Callable[[dict, str, float, Callable, Callable], None]

Coeffs = Mapping[str, float]


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a rule. ``slow``: an EMA with beta near 1 (a pair under the
    strategies with ``mcf_slow_states``); ``label``: its short name in tables."""

    name: str
    slow: bool
    label: str


def number(value, name: str) -> float:
    """A hyperparameter as a Python float. Accepted, as torch.optim accepts them: any real
    number (``int``, ``float``, ``fractions.Fraction``, numpy's ``float32``...; what is a
    ``numbers.Real`` or converts with ``float()``), a one-element tensor (a tensor lr) or
    0-d array. Refused: ``bool`` (a flag passed in the wrong place) and complex numbers."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}")
        value = value.item()
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _is_real(value) -> bool:
    """A real number that is not a bool: a ``numbers.Real`` or what has ``__float__`` (a
    numpy scalar or 0-d array), not a numpy bool or complex."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) == "bool":
        return False
    if isinstance(value, numbers.Real):
        return True
    if isinstance(value, numbers.Complex) or getattr(value, "dtype", None) is not None \
            and getattr(value.dtype, "kind", "") == "c":
        return False
    return hasattr(type(value), "__float__") and getattr(value, "ndim", 0) == 0


def plain_numbers(group: Mapping) -> Mapping:
    """``group`` with its real numbers that are not Python's (numpy's ``float32``...) as
    Python floats, in tuples and lists too (betas): the coefficients are then computed in
    float64 on the host as for a float, never in a numpy scalar's precision. ``group``
    itself where there is none (the usual case: no copy)."""
    plain = {key: value if key in ("params", "param_names") else _plain(value)
             for key, value in group.items()}
    if all(plain[key] is value for key, value in group.items()):
        return group
    return plain


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, (tuple, list)):
        items = [_plain(item) for item in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items)
    return float(value) if _is_real(value) else value


def _sqrt(x):
    """The correctly rounded square root of a Python float or a tensor."""
    return torch.sqrt(x) if isinstance(x, torch.Tensor) else math.sqrt(x)


def _quotient(a, b):
    """``a / b`` correctly rounded, for Python floats or tensors. A number over a tensor is
    ``torch.div`` (one division per element), not ``a / b``: torch's ``__rtruediv__`` is
    ``b.reciprocal() * a``, two roundings, which differs from the host's float64 quotient
    in about 1 in 1,200 of the Triton path's device step sizes."""
    if isinstance(b, torch.Tensor) and not isinstance(a, torch.Tensor):
        return torch.div(a, b)
    return a / b


def check_betas(betas) -> None:
    """A ValueError unless ``betas`` is a pair of numbers in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    # (a tensor beside a number is refused at construction only: refuse_mixed_betas)
    for index, beta in enumerate(betas):
        value = number(beta, f"betas[{index}]")
        if not 0.0 <= value < 1.0:
            raise ValueError(f"betas[{index}] must be in [0, 1), got {beta}")


def refuse_mixed_betas(betas) -> None:
    """As torch.optim's AdamW and Lion constructors: a tensor beside a number is a mistake
    more often than a wish. At construction only, as there: a step takes such a pair, and
    OneCycleLR(cycle_momentum=True) writes one, (float, tensor), into a group made with
    two tensors (refused at every step before 2026-12-07)."""
    if (isinstance(betas, (tuple, list)) and len(betas) == 2
            and isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor)):
        raise ValueError(f"betas must be either both floats or both Tensors, got "
                         f"({type(betas[0]).__name__}, {type(betas[1]).__name__}): write "
                         f"both as floats, or both as 0-d tensors")


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
        """The per-step coefficients of the fast kernels, Python floats (float64)."""
        return self.step_coefficients(group, float(group["lr"]), step)

    def step_coefficients(self, group: Mapping, lr, step, next_step: bool = True) -> dict:
        """:meth:`coefficients` from ``lr`` and ``step``: Python numbers, or float64 tensors
        (``step`` one counter per parameter; the values are then tensors of its shape,
        or numbers where they do not depend on it). ``next_step=False`` leaves out the
        next step's coefficients (``*_next``: only the ``feedback`` landing reads them),
        where each costs device operations a step waits for (the Triton path's device
        coefficients)."""
        raise NotImplementedError

    def tensor_lr_coefficients(self, group: Mapping, lr: torch.Tensor, step) -> dict:
        """The coefficients a tensor learning rate gives otherwise than its float64 value
        (``step``: a number, or one float64 value per counter), as tensors on ``lr``'s
        device; none for most rules (they read ``float(lr)``)."""
        return {}

    def fast(self, weight: torch.Tensor, grad: torch.Tensor, states: dict, c: Coeffs):
        raise NotImplementedError

    def reference_coefficients(self, group: Mapping, step: int) -> dict:
        """The coefficients of the reference path (``coefficients`` unless the research
        form differs)."""
        return self.coefficients(group, step)

    def reference(self, weight: torch.Tensor, grad: torch.Tensor, states: dict, c: Coeffs,
                  slow_ema: SlowEMA) -> torch.Tensor:
        """The raw update of one reference step, states updated in place. ``weight``: the
        weight a decay term multiplies; ``grad`` in the states' dtype."""
        raise NotImplementedError

    #: the rules that can take a weight's rounding error back into their momentum
    #: (:meth:`feed_back`; the ``feedback`` strategy)
    feeds_back = False

    def feed_back(self, states: dict, error: torch.Tensor, c: Coeffs) -> None:
        """Fold ``error`` (what the stored weight lacks of the intended one) into the
        momentum so that the next step adds it back: the inverse of the next update's
        dependence on the momentum (ECO's error feedback, arXiv 2601.22101)."""
        raise NotImplementedError(f"{self.title} keeps no momentum to feed an error into")


class AdamWRule(Rule):
    name = "adamw"
    title = "AdamW"
    states = (StateSpec("exp_avg", False, "m"), StateSpec("exp_avg_sq", True, "v"))

    def validate(self, hyper: Mapping) -> None:
        super().validate(hyper)
        if number(hyper["eps"], "eps") < 0:
            raise ValueError(f"eps must be >= 0, got {hyper['eps']}")
        check_betas(hyper["betas"])
        style = hyper.get("weight_decay_style", "compact")
        if style not in WEIGHT_DECAY_STYLES:
            raise ValueError(f"weight_decay_style must be one of {', '.join(WEIGHT_DECAY_STYLES)}"
                             f", got {style!r}")
        if style == "HF" and not hyper.get("reference", False):
            raise ValueError("weight_decay_style='HF' (decay after the update) is the research "
                             "code's and runs on the reference path only: pass "
                             "reference=True, or use 'compact' or 'torch'")

    def step_coefficients(self, group: Mapping, lr, step, next_step: bool = True) -> dict:
        beta1, beta2 = group["betas"]
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        out = {
            "lr_wd": lr * group["weight_decay"],
            "decay": 1 - lr * group["weight_decay"],
            "beta1": beta1,
            "beta2": beta2,
            "one_minus_beta1": 1 - beta1,
            "one_minus_beta2": 1 - beta2,
            "step_size": _quotient(lr, bias_correction1),
            "bias_correction2_sqrt": _sqrt(bias_correction2),
            "eps": group["eps"],
        }
        if next_step:  # the next step's (error feedback): the same learning rate assumed
            out["step_size_next"] = _quotient(lr, 1 - beta1**(step + 1))
            out["bias_correction2_sqrt_next"] = _sqrt(1 - beta2**(step + 1))
        return out

    def coefficients(self, group: Mapping, step: int) -> dict[str, float]:
        c = super().coefficients(group, step)
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):  # its terms on the host, as Python floats
            terms = self.tensor_lr_coefficients(group, lr.detach().to("cpu").reshape(()), step)
            c.update({key: float(value) for key, value in terms.items()})
        return c

    def tensor_lr_coefficients(self, group: Mapping, lr: torch.Tensor, step) -> dict:
        return tensor_lr_terms(lr, group["weight_decay"], 1 - group["betas"][0]**step)

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

    def reference_coefficients(self, group: Mapping, step: int) -> dict:
        """The research code's AdamW form: ``step_size = lr * sqrt(1 - beta2**t) / (1 -
        beta1**t)`` (computed in that order, in float64), ``denom = sqrt(v) + eps``."""
        c = self.coefficients(group, step)
        beta1, beta2 = group["betas"]
        c["research_step_size"] = (float(group["lr"]) * math.sqrt(1.0 - beta2**step)
                                   / (1.0 - beta1**step))
        c["research_step_size_next"] = (float(group["lr"]) * math.sqrt(1.0 - beta2**(step + 1))
                                        / (1.0 - beta1**(step + 1)))
        c["weight_decay"] = group["weight_decay"]
        c["weight_decay_style"] = group.get("weight_decay_style", "compact")
        return c

    def reference(self, weight, grad, states, c, slow_ema):
        # adamw_collage.py's operations, in its order, on the stored (bf16) states
        exp_avg = states["exp_avg"]
        exp_avg.mul_(c["beta1"]).add_(grad, alpha=c["one_minus_beta1"])
        slow_ema(states, "exp_avg_sq", c["beta2"],
                 lambda v: v.mul_(c["beta2"]).addcmul_(grad, grad, value=c["one_minus_beta2"]),
                 lambda: torch.addcmul(torch.zeros_like(grad), grad, grad,
                                       value=c["one_minus_beta2"]))
        denom = states["exp_avg_sq"].sqrt().add_(c["eps"])
        raw = -c["research_step_size"] * exp_avg / denom
        if c["weight_decay"] > 0.0 and c["weight_decay_style"] == "compact":
            raw = raw - c["lr_wd"] * weight
        return raw

    feeds_back = True

    def feed_back(self, states, error, c):
        # A change dm of m persists with decay beta1: the steps that follow add
        # -step_size * (beta1 + beta1**2 + ...) * dm / D = -step_size * beta1 / (1 - beta1)
        # * dm / D (step size and denominator D taken as the next step's, at the current
        # v), so dm = -error * (1 - beta1) * D / (step_size * beta1) adds the error back
        # over the next ~1 / (1 - beta1) steps, and needs no memory of earlier errors.
        if "research_step_size_next" in c:  # the reference path's form: sqrt(v) + eps
            denom = states["exp_avg_sq"].float().sqrt() + c["eps"]
            gain = _feedback_gain(c["research_step_size_next"], c["beta1"])
        else:
            denom = states["exp_avg_sq"].sqrt() / c["bias_correction2_sqrt_next"] + c["eps"]
            gain = _feedback_gain(c["step_size_next"], c["beta1"])
        _adamw_feed_back(states, error, denom * c["one_minus_beta1"], gain)


def tensor_lr_terms(lr: torch.Tensor, weight_decay: float, bias_correction1
                    ) -> dict[str, torch.Tensor]:
    """``decay`` and ``step_size`` as torch.optim.AdamW computes them from a tensor learning
    rate: with tensor operations in the tensor's dtype (``1 - lr * wd`` and ``lr / (1 -
    beta1**t)`` each rounded to float32 for a float32 ``lr``), where a Python float ``lr``
    gives float64 values rounded once. The same operations on the same values: the fp32
    strategy stays torch's bit for bit with a tensor ``lr`` too. ``lr_wd`` stays float64
    (``Strategy.land``: the digits of a small decay that ``1 - decay`` would lose).

    Tensors on ``lr``'s device: ``bias_correction1`` a number (the host) or one float64
    value per counter (the Triton path's device coefficients). Either way it is first
    rounded to ``lr``'s dtype, as torch rounds a Python number in an operation with a
    float32 tensor: the same bits on both paths."""
    bias = torch.as_tensor(bias_correction1, device=lr.device).to(lr.dtype)
    out = {"step_size": lr / bias}
    if weight_decay != 0:  # torch decays only then (and 1 - lr * 0 is 1 in any dtype)
        out["decay"] = 1 - lr * weight_decay
    return out


def _adamw_feed_back(states: dict, error, denom, gain) -> None:
    momentum = states["exp_avg"]
    correction = error * denom * gain
    if momentum.dtype == torch.float32:  # a working state: updated in place
        momentum.sub_(correction)
    else:  # a stored one (the reference path): one rounding
        momentum.copy_(momentum.float() - correction)


def _feedback_gain(step_size_next, beta):
    """``1 / (step_size_next * beta)``, and 0 where it is infinite (a zero learning rate or
    beta: the next step cannot carry anything back, and there is nothing to carry at lr 0)."""
    if isinstance(step_size_next, torch.Tensor) or isinstance(beta, torch.Tensor):
        product = torch.as_tensor(step_size_next) * beta
        return torch.where(product > 0, 1.0 / torch.where(product > 0, product, 1.0), 0.0)
    product = step_size_next * beta
    return 1.0 / product if product > 0 else 0.0


class SGDRule(Rule):
    """torch.optim.SGD semantics: coupled weight decay, dampening, Nesterov."""

    name = "sgd"
    title = "SGD"
    states = (StateSpec("momentum_buffer", False, "momentum"),)
    # the kernels branch on these (structure, never a scheduler's value): a momentum that
    # OneCycleLR cycles or a new weight decay is data, never a recompilation
    static = frozenset({"has_weight_decay", "has_momentum", "nesterov"})

    def validate(self, hyper: Mapping) -> None:
        super().validate(hyper)
        momentum = number(hyper["momentum"], "momentum")
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        number(hyper["dampening"], "dampening")
        if hyper["nesterov"] and (momentum <= 0 or hyper["dampening"] != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening == 0")

    def step_coefficients(self, group: Mapping, lr, step, next_step: bool = True) -> dict:
        return {
            "lr": lr,
            "lr_wd": 0.0,
            "decay": 1.0,
            "weight_decay": group["weight_decay"],
            "momentum": group["momentum"],
            "one_minus_dampening": 1 - group["dampening"],
            "first_step": step == 1 if isinstance(step, torch.Tensor) else float(step == 1),
            "has_weight_decay": group["weight_decay"] != 0,
            "has_momentum": group["momentum"] != 0,
            "nesterov": bool(group["nesterov"]),
        }

    def fast(self, weight, grad, states, c):
        # torch.optim.SGD's operations: each add_(x, alpha=a) is one fused multiply-add on
        # CPU (axpy: also with a tensor alpha), so the fp32 strategy matches it bit for bit
        if c["has_weight_decay"]:
            grad = axpy(grad, weight, c["weight_decay"])
        if c["has_momentum"]:
            buf = states["momentum_buffer"]
            first = c["first_step"]
            if isinstance(first, torch.Tensor):  # compiled: a select, not a branch on data
                later = axpy_(buf.mul(c["momentum"]), grad, c["one_minus_dampening"])
                buf.copy_(torch.where(first > 0, grad, later))
            elif first:
                buf.copy_(grad)
            else:
                axpy_(buf.mul_(c["momentum"]), grad, c["one_minus_dampening"])
            grad = axpy(grad, buf, c["momentum"]) if c["nesterov"] else buf
        return 1.0, grad, -c["lr"]

    def reference(self, weight, grad, states, c, slow_ema):
        # torch.optim.SGD's single-tensor operations on the stored states
        if c["has_weight_decay"]:
            grad = grad.add(weight, alpha=c["weight_decay"])
        if c["has_momentum"]:
            buf = states["momentum_buffer"]
            if c["first_step"]:
                buf.copy_(grad)
            else:
                buf.mul_(c["momentum"]).add_(grad, alpha=c["one_minus_dampening"])
            grad = grad.add(buf, alpha=c["momentum"]) if c["nesterov"] else buf
        return grad * -c["lr"]

    feeds_back = True

    def feed_back(self, states, error, c):
        # A change d of the buffer persists with decay mu: the steps that follow add
        # -lr * (mu + mu**2 + ...) * d = -lr * mu / (1 - mu) * d (Nesterov: mu**2 / (1 -
        # mu)), so d = -error * (1 - mu) / (lr * mu [* mu]) adds the error back
        momentum = c["momentum"] * c["momentum"] if c["nesterov"] else c["momentum"]
        buffer = states["momentum_buffer"]
        correction = error * (1 - c["momentum"]) * _feedback_gain(c["lr"], momentum)
        if buffer.dtype == torch.float32:
            buffer.sub_(correction)
        else:
            buffer.copy_(buffer.float() - correction)


class LionRule(Rule):
    """Lion (Chen et al. 2023): ``w -= lr * (sign(b1 m + (1-b1) g) + wd w)``,
    ``m = b2 m + (1-b2) g``; m is the slow EMA (MCF under 'plus')."""

    name = "lion"
    title = "Lion"
    states = (StateSpec("exp_avg", True, "m"),)

    def validate(self, hyper: Mapping) -> None:
        super().validate(hyper)
        check_betas(hyper["betas"])

    def step_coefficients(self, group: Mapping, lr, step, next_step: bool = True) -> dict:
        beta1, beta2 = group["betas"]
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

    def reference(self, weight, grad, states, c, slow_ema):
        exp_avg = states["exp_avg"]
        raw = exp_avg.mul(c["beta1"]).add_(grad, alpha=c["one_minus_beta1"]).sign_()
        raw.mul_(-c["lr"])
        if c["lr_wd"] > 0.0:  # decoupled decay, folded in as AdamW's compact style
            raw = raw - c["lr_wd"] * weight
        slow_ema(states, "exp_avg", c["beta2"],
                 lambda m: m.mul_(c["beta2"]).add_(grad, alpha=c["one_minus_beta2"]),
                 lambda: grad * c["one_minus_beta2"])
        return raw


ADAMW = AdamWRule()
SGD = SGDRule()
LION = LionRule()
RULES = {rule.name: rule for rule in (ADAMW, SGD, LION)}
