"""The optimizer class: gathers tensors, validates input, dispatches to the kernels.

One class per update rule (``AdamW``, ``SGD``, ``Lion``) over this base; the precision
strategy is a parameter (and a per-group key), never a subclass.
"""

from __future__ import annotations

import itertools
import math
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer

from . import fused, kernels, native, tracked
from .rules import Rule
from .strategies import Strategy, check_weight, get_strategy

__all__ = ["CollageOptimizer", "NONFINITE_POLICIES"]

NONFINITE_POLICIES = ("skip", "raise", "ignore")
_PATHS = ("reference", "foreach", "fused")


def _local(tensor):
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _FiniteProof(NamedTuple):
    """A gradient norm taken by :meth:`CollageOptimizer.clip_grad_norm_` and the gradients
    it was taken over (weak references and their version counters after clipping)."""

    norm: torch.Tensor
    grads: list[tuple[weakref.ref, int]]

    def covers(self, grads: list[torch.Tensor]) -> bool:
        """Whether ``grads`` are exactly the tensors measured, unmodified since."""
        return len(grads) == len(self.grads) and all(
            ref() is grad and grad._version == version
            for (ref, version), grad in zip(self.grads, grads))


def _number(value: Any, name: str) -> float:
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


_MASK64 = (1 << 64) - 1
_MIX_START = 0x9E3779B97F4A7C15


def _mix_state(h: int, *values: int) -> int:
    """The 64-bit state of :func:`_mix` after mixing ``values`` into state ``h``: a state
    kept after some values continues with the rest (native plans mix the step in C,
    ``collage_stochastic_keys``)."""
    for value in values:
        h = ((h ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 31)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 rounds): the same in every process and run."""
    return _mix_state(_MIX_START, *values) & ((1 << 63) - 1)


def _flat_views(param, grad, state):
    """1-D views of a parameter, its gradient and its state (None if one is not contiguous),
    so that one dynamic-shape compilation serves tensors of every rank."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not all(t.is_contiguous() for t in (param, grad, *tensors.values())):
        return None
    flat_state = dict(state)
    flat_state.update({k: v.view(-1) for k, v in tensors.items()})
    return param.view(-1), grad.reshape(-1), flat_state


#: Elements per call of the chunked eager step: a multiple of plus8's block (128); its float32
#: temporaries (~50 B per element at most) stay around 3 MB, in cache.
EAGER_CHUNK = 1 << 16


def _state_range(key: str, value, start: int, stop: int):
    """The slice of a flat state entry that holds elements ``start:stop``: per-element
    tensors by element, plus8's per-block scales by block, the 0-d step as is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if key.endswith("_scale"):
        from .eight_bit import BLOCK

        return value[start // BLOCK:-(-stop // BLOCK)]
    return value[start:stop]


class CollageOptimizer(Optimizer):
    """Base of the precision-aware optimizers (see ``collage.AdamW`` for the arguments)."""

    rule: Rule
    # GradScaler sets ``grad_scale`` and ``found_inf`` on us and calls step(): we unscale in
    # float32 registers (fp16 gradients never need an fp16 unscale) and skip on overflow.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        strategy: str,
        foreach: bool | None,
        fused: bool | None,
        track_updates: bool | int,
        nonfinite: str,
        seed: int,
    ) -> None:
        get_strategy(strategy)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r} is unknown; use one of: "
                             f"{', '.join(NONFINITE_POLICIES)}")
        if isinstance(track_updates, bool) or track_updates is None:
            track_updates = 1 if track_updates else 0
        if not isinstance(track_updates, int) or track_updates < 0:
            raise ValueError(f"track_updates must be a bool or an int k >= 0 (measure every "
                             f"k-th step), got {track_updates!r}")
        if not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.nonfinite = nonfinite
        self.track_updates = track_updates
        self.seed = seed
        self.skipped_steps = 0
        self.update_stats: dict[str, float] = {}
        self._steps_taken = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self._positions: dict[int, int] | None = None
        self._warned_fused = False
        self._finite_proof: _FiniteProof | None = None
        # what the fused path ran last: "native" (CPU C kernels) or "inductor" (benchmarks)
        self._fused_backend: str | None = None
        defaults = dict(defaults, strategy=strategy, foreach=foreach, fused=fused)
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------- validation

    def _validate_hyperparameters(self, group: dict) -> None:
        """Subclasses check their own hyperparameters; errors name the argument."""
        if _number(group["lr"], "lr") < 0:
            raise ValueError(f"lr must be >= 0, got {group['lr']}")
        if _number(group["weight_decay"], "weight_decay") < 0:
            raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")

    @staticmethod
    def _check_betas(betas: Any) -> None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for index, beta in enumerate(betas):
            value = _number(beta, f"betas[{index}]")
            if not 0.0 <= value < 1.0:
                raise ValueError(f"betas[{index}] must be in [0, 1), got {beta}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._positions = None
        group = self.param_groups[-1]
        try:
            self._validate_group(group, len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise

    def _validate_group(self, group: dict, index: int) -> None:
        strategy = get_strategy(group["strategy"])
        if strategy.eight_bit and self.rule.name != "adamw":
            raise ValueError(f"strategy {strategy.name!r} stores Adam's two moments in 8 bits "
                             f"and supports AdamW only, not {self.rule.name}; use 'plus'")
        self._validate_hyperparameters(group)
        for flag in ("foreach", "fused"):
            if group[flag] not in (None, True, False):
                raise TypeError(f"{flag} must be None, True or False, got {group[flag]!r}")
        if group["foreach"] and group["fused"]:
            raise ValueError("foreach=True and fused=True are exclusive; set at most one")
        names = group.get("param_names") or [
            f"group{index}.param{i}" for i in range(len(group["params"]))
        ]
        for name, param in zip(names, group["params"]):
            if param.is_complex():
                raise TypeError(f"parameter {name!r} is complex; collage optimizers support "
                                "real floating-point parameters only (use torch.view_as_real)")
            check_weight(strategy, param, name)

    # ----------------------------------------------------------------------- step

    def _param_names(self, group: dict, index: int) -> list[str]:
        return group.get("param_names") or [
            f"group{index}.param{i}" for i in range(len(group["params"]))
        ]

    def _gather(self) -> list[tuple[int, dict, list[tuple[str, torch.Tensor, torch.Tensor]]]]:
        """(group index, group, [(name, param, grad)]) for the parameters that have grads."""
        batches = []
        for index, group in enumerate(self.param_groups):
            items = []
            for name, param in zip(self._param_names(group, index), group["params"]):
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(f"parameter {name!r} has a sparse gradient; collage "
                                       "optimizers need dense gradients")
                if grad.dtype != param.dtype:
                    raise TypeError(
                        f"the gradient of parameter {name!r} is {grad.dtype} but the weight "
                        f"is {param.dtype}; gradients must have the weight's dtype (do not "
                        "cast .grad by hand; let autograd produce it)"
                    )
                items.append((name, param, grad))
            batches.append((index, group, items))
        return batches

    def _gradients_usable(self, batches, shard_group) -> bool:
        """Apply the GradScaler verdict and the non-finite policy with one host sync."""
        proof, self._finite_proof = self._finite_proof, None  # good for one step at most
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            # GradScaler already checked every gradient; it skips (and we count) on overflow.
            if bool(found_inf.item() > 0):
                self.skipped_steps += 1
                return False
            return True
        if self.nonfinite == "ignore":
            return True
        grads = [grad for _, _, items in batches for _, _, grad in items]
        if not grads:
            return True
        if proof is not None and shard_group is None and proof.covers(grads):
            # A finite norm of these very gradients (clip_grad_norm_) proves every element
            # finite: the check's read of every gradient is skipped. A non-finite norm
            # proves nothing (finite gradients can overflow it): the check runs.
            norm = proof.norm.full_tensor() if hasattr(proof.norm, "full_tensor") \
                else proof.norm
            if bool(torch.isfinite(norm)):
                return True
        bad = self._nonfinite_flag([_local(grad) for grad in grads])
        bad = self._all_ranks_max(bad, shard_group)
        if not bool(bad.item()):
            return True
        names = [name for _, _, items in batches for name, _, grad in items
                 if not bool(torch.isfinite(_local(grad)).all())]
        where = ", ".join(repr(n) for n in names[:5]) or "(another rank)"
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradient in parameter {where}; nothing was updated. Use "
                "nonfinite='skip' to skip such steps, or find the overflow (fp16 needs loss "
                "scaling: torch.amp.GradScaler)"
            )
        self.skipped_steps += 1
        warnings.warn(f"collage: skipped step: non-finite gradient in {where} "
                      f"({self.skipped_steps} skipped so far); weights and states unchanged",
                      RuntimeWarning, stacklevel=3)
        return False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters (those with a
        gradient); returns the total norm. The same arguments, the same clipping, the same
        result bit for bit.

        One thing more: a finite total norm (``norm_type > 0``) proves every gradient
        element finite, since an inf or nan element makes the norm inf or nan. So the next
        :meth:`step` skips its own non-finite check (``nonfinite='skip'`` or ``'raise'``),
        one read of every gradient (clip + step in 0.88-0.94x the time on 2 CPU cores,
        ``benchmarks/clip_then_step.py``). The proof holds for the
        gradients just clipped: the next step checks that it sees the same tensors, not
        modified since (their version counters), and otherwise checks as usual; it is used
        by one step at most. Parameters sharded over ranks (FSDP2) are checked as usual.
        """
        params = [p for group in self.param_groups for p in group["params"]
                  if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite,
                                              foreach=foreach)
        self._finite_proof = None
        if float(norm_type) > 0:  # the 0-"norm" counts non-zeros: inf counts as 1
            self._finite_proof = _FiniteProof(
                norm, [(weakref.ref(p.grad), p.grad._version) for p in params])
        return norm

    @staticmethod
    def _nonfinite_flag(grads: list[torch.Tensor]) -> torch.Tensor:
        """1.0 if any gradient element is inf or nan, else 0.0 (a float32 scalar on the
        gradients' device, for the ranks' all-reduce)."""
        device = grads[0].device
        # CPU: the native library, once loaded, reads each gradient once on torch's threads
        # with no per-tensor dispatch (17M bf16 gradients, 2 threads: 0.09 -> 0.06
        # ns/param); it never builds the library itself
        verdict = native.any_nonfinite(grads) if device.type == "cpu" else None
        if verdict is not None:
            return torch.tensor(float(verdict), dtype=torch.float32)
        # aminmax reads each gradient once and propagates nan (inf shows as min or max):
        # an order of magnitude faster than isfinite(grad).all() on CPU, no temporaries.
        extremes = [x.to(device) for grad in grads if grad.numel()
                    for x in torch.aminmax(grad)]
        if not extremes:
            return torch.zeros((), dtype=torch.float32, device=device)
        return (~torch.isfinite(torch.stack(extremes)).all()).to(torch.float32)

    @staticmethod
    def _all_ranks_max(flag: torch.Tensor, shard_group) -> torch.Tensor:
        """Sharded (FSDP2) ranks see different gradients: agree on skipping."""
        if shard_group is not None:
            dist = torch.distributed
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard_group)
        return flag

    @staticmethod
    def _shard_group(batches):
        """The process group the parameters are sharded over (FSDP2 DTensors), or None.

        Only sharded ranks hold different parts of a tensor and see different gradients;
        replicated parameters (DDP, plain tensors) need no collective. Reducing over the
        default group instead double-counts the metrics under DDP and deadlocks an optimizer
        that only some ranks step. HSDP's (Replicate, Shard) mesh reduces over the shard dim.
        """
        for _, _, items in batches:
            for _, param, _ in items:
                mesh = getattr(param, "device_mesh", None)
                if mesh is None:
                    continue
                dims = [i for i, p in enumerate(param.placements) if p.is_shard()]
                if len(dims) > 1:
                    raise NotImplementedError(
                        "collage optimizers support parameters sharded over one mesh "
                        f"dimension, got placements {param.placements}")
                if dims and mesh.size(dims[0]) > 1:
                    return mesh.get_group(dims[0])
        return None

    def _path(self, group: dict, device: torch.device, native: bool = False) -> str:
        """The group's path. ``native``: the native CPU kernels cover the group (only
        ``fused.step_group`` says so): then the default (``fused=None``) is fused on CPU too.
        Measured steps run the native kernels too where they cover the group; otherwise
        measured and per-parameter steps ask without it, so an unset ``fused`` never
        compiles inductor kernels on CPU."""
        fused, foreach = group["fused"], group["foreach"]
        if fused:
            return "fused"
        if foreach is False and not fused:
            return "reference"
        if foreach:
            return "foreach"
        if fused is None and (device.type == "cuda" or native):
            return "fused"
        return "foreach"

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return self._generators[device]

    def _parameter_positions(self) -> dict[int, int]:
        """``id(param)``: the parameter's position in the optimizer over all groups (a key
        of its stochastic draws); rebuilt after ``add_param_group``."""
        if self._positions is None:
            params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
            self._positions = {id(p): i for i, p in enumerate(params)}
        return self._positions

    def _randomness(self, param, local_param, step: int) -> torch.Tensor:
        """Uniform draws for stochastically rounding ``param`` at ``step``: counter-based.

        Seeded by (seed, the parameter's position in the optimizer, step) and drawn for the
        whole tensor, then sliced to this rank's shard: the numbers depend neither on the
        sharding nor on generator state, so DDP ranks agree, FSDP2 equals one process at any
        world size, and a checkpoint's per-parameter ``step`` is all a resume needs.
        """
        generator = torch.Generator(device=local_param.device)
        generator.manual_seed(_mix(self.seed, self._parameter_positions()[id(param)], step))
        draws = torch.rand(param.shape, generator=generator, device=local_param.device)
        if hasattr(param, "device_mesh"):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements)
            draws = draws[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        return draws.contiguous()

    def _measuring(self) -> bool:
        return self.track_updates > 0 and self._steps_taken % self.track_updates == 0

    # Never traced by dynamo: inside a torch.compile'd training step, inductor would drop the
    # bf16 round trips the compensation terms are made of (weight_lo and the Kahan
    # compensation become 0). The step runs eagerly there; fused=True compiles its own
    # kernels with the casts kept.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns the closure's loss (or None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batches = self._gather()
        shard_group = self._shard_group(batches)
        if not self._gradients_usable(batches, shard_group):
            return loss
        measuring = self._measuring()
        stats = self._new_stats() if measuring else None
        grad_scale = getattr(self, "grad_scale", None)
        for index, group, items in batches:
            strategy = get_strategy(group["strategy"])
            if fused.step_group(self, index, group, strategy, items, grad_scale, stats):
                continue  # the fused path steps the whole group at once (measured: native)
            if stats is not None and tracked.step_group_tracked(self, index, group, strategy,
                                                                items, grad_scale, stats):
                continue  # ... measured by inductor kernels in the same pass
            for name, param, grad in items:
                self._step_param(index, group, strategy, name, param, grad, grad_scale, stats)
        self._steps_taken += 1
        if stats is not None:
            self.update_stats = self._finish_stats(stats, shard_group)
        return loss

    def _step_param(self, index, group, strategy: Strategy, name, param, grad, grad_scale,
                    stats) -> None:
        state = self.state[param]
        if not state:
            kernels.init_state(self.rule, strategy, param, state)
        state["step"] += 1
        coeffs = self.rule.coefficients(group, int(state["step"].item()))
        local_param, local_grad = _local(param), _local(grad)
        local_state = {k: _local(v) for k, v in state.items()}
        path = self._path(group, local_param.device)
        generator = (self._randomness(param, local_param, int(state["step"].item()))
                     if strategy.name == "stochastic" else None)
        if strategy.eight_bit:  # plus8 hashes its draws from the key (as the fused path)
            generator = fused.stochastic_seeds(self, param, int(state["step"].item()),
                                               fused._flat_offset(param, local_param) or 0,
                                               local_param.device)
        before = visible_before = None
        if stats is not None:
            before = kernels.represented_value(strategy, local_param, local_state)
            visible_before = local_param.detach().clone()
        if path == "reference":
            # unscale straight into the dtype the rule computes in (bf16 for fp16 weights):
            # rounding to fp16 first would flush small unscaled gradients to zero
            grad_lp = self._prepare_grad(local_grad, group, grad_scale,
                                         kernels.state_dtype(strategy, local_param.dtype))
            intended = kernels.reference_step(self.rule, strategy, local_param, grad_lp,
                                              local_state, coeffs, generator, stats is not None)
        elif path == "foreach" and stats is None and local_param.numel() > EAGER_CHUNK and (
                flat := _flat_views(local_param, local_grad, local_state)) is not None:
            self._fast_step_in_chunks(strategy, group, *flat, coeffs, generator, grad_scale)
            intended = None
        else:
            grad32 = self._prepare_grad(local_grad, group, grad_scale, torch.float32)
            if path == "fused":
                coeffs = self._as_tensors(coeffs, local_param.device)
            intended = self._run_fast(path, strategy, local_param, grad32, local_state, coeffs,
                                      generator, stats is not None)
        if stats is not None:
            after = kernels.represented_value(strategy, local_param, local_state)
            stats.add(self._stat_keys(index, group, name), intended, before, after,
                      visible_before=visible_before, visible_after=local_param,
                      compensation=kernels.compensation_of(strategy, local_state))

    def _fast_step_in_chunks(self, strategy, group, flat_param, flat_grad, flat_state, coeffs,
                             generator, grad_scale) -> None:
        """The eager float32 step of flat views (``_flat_views``) over ranges of at most
        ``EAGER_CHUNK`` elements.

        Each range's float32 temporaries (the loaded weight and moments, the update, the
        unscaled gradient) live only while it is stepped, so a step holds at most a few MB
        beyond the persistent tensors however large the parameter: the memory that
        ``collage memory`` predicts is the memory a step needs. Elementwise arithmetic, so
        the result is the same as one whole-tensor call; plus8's ranges start on its block
        boundaries (a multiple of ``eight_bit.BLOCK``) and its keyed draws are indexed by
        the element's position in the whole tensor.
        """
        n = flat_param.numel()
        for start in range(0, n, EAGER_CHUNK):
            stop = min(start + EAGER_CHUNK, n)
            part = {k: _state_range(k, v, start, stop) for k, v in flat_state.items()}
            grad32 = self._prepare_grad(flat_grad[start:stop], group, grad_scale,
                                        torch.float32)
            draws = generator
            if strategy.eight_bit:  # seeds: (key, key, first index) -> this range's first
                draws = generator.clone()
                draws[2] += start
            elif generator is not None:  # stochastic: one uniform per element
                draws = generator.reshape(-1)[start:stop]
            kernels.fast_step(self.rule, strategy, flat_param[start:stop], grad32, part,
                              coeffs, draws, False)

    @staticmethod
    def _prepare_grad(grad, group, grad_scale, dtype) -> torch.Tensor:
        """The gradient to use: negated for ``maximize``, unscaled for GradScaler."""
        if dtype == torch.float32:
            grad = grad.float()
            if grad_scale is not None:
                grad = grad / grad_scale.to(grad.device)
            return -grad if group.get("maximize", False) else grad
        if grad_scale is not None or group.get("maximize", False):
            from ..mcf import round_to

            wide = grad.double()
            if grad_scale is not None:
                wide = wide / grad_scale.double().to(grad.device)
            if group.get("maximize", False):
                wide = -wide
            return round_to(wide, dtype)
        return grad

    def _as_tensors(self, coeffs: dict, device: torch.device) -> dict:
        """Non-static coefficients as 0-d tensors, so new values never recompile."""
        return {
            key: value if key in self.rule.static
            else torch.tensor(value, dtype=torch.float64)
            for key, value in coeffs.items()
        }

    def _run_fast(self, path, strategy, param, grad32, state, coeffs, generator, want):
        """Run the float32 kernel, compiled when ``path == 'fused'`` and possible."""
        from . import fused

        kernel = fused.compiled_step(self.rule, strategy) if path == "fused" else None
        flat = _flat_views(param, grad32, state) if kernel is not None else None
        if kernel is not None and flat is not None:
            if generator is not None:  # draws made outside the graph, flat like the tensors
                generator = generator.reshape(-1)
            try:
                intended = kernel(*flat, coeffs, generator, want)
                return None if intended is None else intended.view(param.shape)
            except Exception as error:
                if not fused.is_compile_error(error):
                    raise
                fused.mark_unavailable()
                self._warn_fallback(f"torch.compile failed ({type(error).__name__})")
        elif path == "fused" and kernel is None:
            self._warn_fallback("torch.compile has no C++ compiler or Triton here")
        return kernels.fast_step(self.rule, strategy, param, grad32, state, coeffs,
                                 generator, want)

    def _warn_fallback(self, reason: str) -> None:
        if not self._warned_fused:
            warnings.warn(f"collage: fused path unavailable: {reason}; using the foreach "
                          "path (same float32 arithmetic, not compiled)", RuntimeWarning,
                          stacklevel=5)
            self._warned_fused = True

    # ----------------------------------------------------------------------- metrics

    def _new_stats(self):
        from ..metrics import UpdateStats

        return UpdateStats()

    def _stat_keys(self, index: int, group: dict, name: str) -> list[str]:
        keys = ["", f"group{index}"]
        if "param_names" in group:
            keys.append(name)
        return keys

    def _finish_stats(self, stats, shard_group) -> dict[str, float]:
        if shard_group is not None:
            stats.reduce_(shard_group)
        return stats.to_dict()

    # ----------------------------------------------------------------------- state dict

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["collage"] = {
            "skipped_steps": self.skipped_steps,
            "steps_taken": self._steps_taken,
            "seed": self.seed,  # keys the counter-based stochastic-rounding draws
            "generators": {str(d): g.get_state() for d, g in self._generators.items()},
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like torch.optim, but keep every state tensor's saved dtype.

        torch.optim casts floating-point state to the parameter's dtype on load, which would
        turn fp32 masters and moments into bf16 silently; we restore the saved tensors.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("collage", None)
        saved_state = state_dict["state"]
        # the native plans hold the old state dicts: drop them before loading, or the old
        # tensors would live beside the new ones until each group's next step
        self.__dict__.pop("_native_plans", None)
        self._check_same_strategies(state_dict["param_groups"])
        super().load_state_dict(state_dict)
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, param in zip(saved_ids, params):
            if saved_id not in saved_state:
                continue
            restored = {}
            for key, value in saved_state[saved_id].items():
                if isinstance(value, torch.Tensor) and key != "step":
                    value = value.to(device=param.device, copy=True)
                restored[key] = value
            self.state[param] = restored
        for index, group in enumerate(self.param_groups):
            self._validate_group(group, index)
            self._check_loaded_layout(group, index)
        if extra is not None:
            self.skipped_steps = extra.get("skipped_steps", 0)
            self._steps_taken = extra.get("steps_taken", 0)
            self.seed = extra.get("seed", self.seed)
            for device, rng_state in extra.get("generators", {}).items():
                self._generator(torch.device(device)).set_state(rng_state)
        else:
            # torch.distributed.checkpoint's get/set_state_dict keep only "state" and
            # "param_groups" (and step once with lr=0 to create the states before loading):
            # the per-parameter step counts tell how many steps were taken.
            steps = [int(s["step"]) for s in self.state.values() if "step" in s]
            self._steps_taken = max(steps, default=0)

    def _check_same_strategies(self, saved_groups: list[dict]) -> None:
        """A checkpoint's groups must use this optimizer's strategies (torch.optim would copy
        the saved strategy over ours and mislabel the states)."""
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if saved.get("strategy", group["strategy"]) != group["strategy"]:
                raise ValueError(
                    f"param group {index} was saved with strategy {saved['strategy']!r} but "
                    f"this optimizer uses {group['strategy']!r}; load it into an optimizer "
                    "with the same strategy, or move between strategies with "
                    "collage.consolidate and collage.load_full_precision"
                )

    def _check_loaded_layout(self, group: dict, index: int) -> None:
        """A loaded state must be the one this group's strategy makes, dtypes included."""
        strategy = get_strategy(group["strategy"])
        for name, param in zip(self._param_names(group, index), group["params"]):
            state = self.state.get(param)
            if not state:
                continue
            expected: dict = {}
            kernels.init_state(self.rule, strategy, torch.empty(0, dtype=param.dtype), expected)
            for key, template in expected.items():
                if key == "step":
                    continue
                have = state.get(key)
                if have is None or have.dtype != template.dtype:
                    got = "missing" if have is None else str(have.dtype)
                    raise ValueError(
                        f"optimizer state of parameter {name!r} does not match strategy "
                        f"{strategy.name!r}: {key!r} should be {template.dtype}, found {got}. "
                        "Load a checkpoint saved with the same strategy, or convert it with "
                        "collage.consolidate / collage.load_full_precision"
                    )
