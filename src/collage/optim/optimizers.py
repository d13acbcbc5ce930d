"""The public optimizers: one class per update rule, precision strategy as a parameter."""

from __future__ import annotations

from collections.abc import Iterable

from .autopilot import Autopilot
from .base import CollageOptimizer
from .rules import ADAMW, LION, SGD as SGD_RULE, refuse_mixed_betas
from .strategies import DEFAULT_STRATEGY

__all__ = ["AdamW", "SGD", "Lion"]

_SHARED_DOC = """
    strategy: how weights and states are stored and how updates land: one of ``fp32``,
        ``mixed``, ``bf16``, ``kahan``, ``stochastic``, ``light``, ``plus``, ``split``
        (``docs/strategies.md``), and for AdamW ``plus8`` (8-bit moments,
        ``docs/eight_bit.md``); or ``"auto"``: each tensor at the cheapest rung of a
        ladder its measured lost updates allow (``docs/autopilot.md``). Also a
        per-param-group key. Default ``"plus"``.
    autopilot: the policy of ``"auto"`` groups, a ``collage.Autopilot(ladder=None,
        threshold=0.5, every=50, sinks=())``; None: the default policy.
    foreach, fused, reference: the implementation (``docs/design.md``), with torch.optim's
        meaning: ``fused=True`` runs the float32 kernel compiled (on CPU, AdamW groups with
        bf16 weights, or fp32 for ``fp32``, run native C kernels built on first use; the
        rest torch.compile, falling back to foreach with one warning); ``foreach=True`` runs
        it eagerly with the group's small tensors batched; ``foreach=False`` runs the same
        arithmetic one tensor at a time (bit for bit ``foreach=True``'s). None chooses:
        native on CPU where it covers the group, the Triton kernels on CUDA (compiled
        where they do not cover the group), foreach elsewhere. ``fused="triton"`` asks for
        the Triton kernels (``docs/gpu.md``) anywhere: on CUDA, or on CPU tensors through
        Triton's interpreter (``TRITON_INTERPRET=1``, for tests).
        ``reference=True`` runs the research algorithm op by op in the weight dtype
        (slow; for studies of the arithmetic). ``COLLAGE_NATIVE=0`` turns the native
        kernels off.
    capturable: step without host synchronisation, CUDA-graph capturable (torch.optim's
        meaning): step counters on the device, coefficients computed there, the learning
        rate read from a device tensor when it is one. The Triton kernels only; needs
        ``nonfinite="ignore"`` and no ``track_updates``.
    track_updates: measure lost updates (EDQ, imprecision) every step (True) or every k-th
        step (int k); results in ``optimizer.update_stats``. Off (zero cost) by default.
    nonfinite: what a step does when a gradient holds inf/nan: ``"skip"`` (default: nothing
        changes, ``skipped_steps`` grows, a warning), ``"raise"``, or ``"ignore"``.
    seed: seed of the stochastic-rounding draws, which are keyed by (seed, parameter
        position, step) (saved in ``state_dict``).
    step_in_backward: step each parameter during ``backward()``, as soon as its gradient
        is complete, and free the gradient (``p.grad`` is None after backward): no
        gradient is held for the whole model. Call ``step()`` after backward as usual (it
        keeps the books). Per-parameter non-finite check; no ``clip_grad_norm_``, no
        GradScaler, no DDP/FSDP2 (``docs/memory.md``).
    grad_accumulation: ``"plain"`` (default: autograd adds each backward's gradient into
        ``p.grad`` in the weight dtype) or ``"pair"``: a float32 sum of the gradients of the
        backward passes since ``zero_grad``, its nearest bf16 in ``p.grad`` and its low
        half in the optimizer (2 more bytes per parameter), and ``step()`` reads the float32
        sum (``docs/memory.md``).
"""


class AdamW(CollageOptimizer):
    __doc__ = (
        """AdamW (decoupled weight decay, Loshchilov & Hutter) under a precision strategy.

    Same arguments, positional order and semantics as ``torch.optim.AdamW`` (``params`` may
    be ``model.named_parameters()`` or param groups); ``amsgrad=True`` and
    ``differentiable=True`` are not implemented and raise ``NotImplementedError``;
    ``capturable=True`` runs the Triton kernels (``docs/gpu.md``). Plus:

    weight_decay_style: how the reference path (``reference=True``, the research code's
        algorithm) applies weight decay: ``"compact"`` (default: ``- lr * wd * w`` folded
        into the update), ``"torch"`` (before the update) or ``"HF"`` (after it; reference
        path only). The other paths decay as ``torch.optim.AdamW`` does, which is
        ``"compact"`` and ``"torch"`` in exact arithmetic.
    """
        + _SHARED_DOC
    )

    rule = ADAMW

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | str | None = None,
        weight_decay_style: str = "compact",
        strategy: str = DEFAULT_STRATEGY,
        reference: bool = False,
        track_updates: bool | int = False,
        nonfinite: str = "skip",
        seed: int = 0,
        step_in_backward: bool = False,
        grad_accumulation: str = "plain",
        autopilot: Autopilot | None = None,
    ) -> None:
        refuse_mixed_betas(betas)
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas,
                        eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        weight_decay_style=weight_decay_style, maximize=maximize,
                        capturable=capturable, differentiable=differentiable)
        super().__init__(params, defaults, strategy=strategy, foreach=foreach, fused=fused,
                         reference=reference, track_updates=track_updates,
                         nonfinite=nonfinite, seed=seed, step_in_backward=step_in_backward,
                         grad_accumulation=grad_accumulation, autopilot=autopilot)


class SGD(CollageOptimizer):
    __doc__ = (
        """SGD with momentum, dampening and Nesterov, as ``torch.optim.SGD`` (the same
    arguments and positional order; ``differentiable=True`` raises ``NotImplementedError``),
    under a precision strategy (weight decay is coupled, as in torch.optim.SGD). Extra
    arguments:
    """
        + _SHARED_DOC
    )

    rule = SGD_RULE

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | str | None = None,
        capturable: bool = False,
        strategy: str = DEFAULT_STRATEGY,
        reference: bool = False,
        track_updates: bool | int = False,
        nonfinite: str = "skip",
        seed: int = 0,
        step_in_backward: bool = False,
        grad_accumulation: str = "plain",
        autopilot: Autopilot | None = None,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        differentiable=differentiable, capturable=capturable)
        super().__init__(params, defaults, strategy=strategy, foreach=foreach, fused=fused,
                         reference=reference, track_updates=track_updates,
                         nonfinite=nonfinite, seed=seed, step_in_backward=step_in_backward,
                         grad_accumulation=grad_accumulation, autopilot=autopilot)


class Lion(CollageOptimizer):
    __doc__ = (
        """Lion (Chen et al., 2023): sign of an interpolated momentum, decoupled weight
    decay, under a precision strategy. ``betas=(0.9, 0.99)``; use a 3-10x smaller lr and
    larger weight decay than AdamW. Extra arguments:
    """
        + _SHARED_DOC
    )

    rule = LION

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        strategy: str = DEFAULT_STRATEGY,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | str | None = None,
        capturable: bool = False,
        reference: bool = False,
        track_updates: bool | int = False,
        nonfinite: str = "skip",
        seed: int = 0,
        step_in_backward: bool = False,
        grad_accumulation: str = "plain",
        autopilot: Autopilot | None = None,
    ) -> None:
        refuse_mixed_betas(betas)
        # differentiable=False as torch.optim's every optimizer has it (its __setstate__
        # adds it otherwise, so a copy's defaults would differ from the original's)
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas,
                        weight_decay=weight_decay, maximize=maximize, capturable=capturable,
                        differentiable=False)
        super().__init__(params, defaults, strategy=strategy, foreach=foreach, fused=fused,
                         reference=reference, track_updates=track_updates,
                         nonfinite=nonfinite, seed=seed, step_in_backward=step_in_backward,
                         grad_accumulation=grad_accumulation, autopilot=autopilot)

