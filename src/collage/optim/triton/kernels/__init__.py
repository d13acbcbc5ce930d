"""The Triton kernels: one multi-tensor step of AdamW, SGD or Lion under a precision
strategy, ``kernels.fast_step``'s float32 arithmetic operation for operation, and the
non-finite check over the step's tiles.

This package is loaded by ``launch.py`` (``launch.kernel_module``) once per mode, compiled
for a GPU or interpreted on CPU (``TRITON_INTERPRET=1``), each copy under a name of its own
with its own copies of these modules: ``@triton.jit`` reads the mode when it decorates. It
needs Triton; nothing else in collage imports it. It calls Triton's builtins only
(``tl.full``, not ``tl.zeros_like``): the ``@jit`` helpers of ``triton.language.standard``
were decorated in the mode of the process's import of Triton, and a compiled one cannot run
in the interpreted copy of this package.

Its modules, each importing only those listed before it:

* ``codes``: the constexpr numbers (``layout.py``'s columns, dtype, rule and landing codes);
* ``arithmetic``: exact float32 operations (fused multiply-add, lerp, rounding to bf16);
* ``columns``: a stored component's address, loads, values, stores, canonical pairs;
* ``draws``: the keyed uniforms and stochastic rounding;
* ``rules``: AdamW's, SGD's and Lion's update;
* ``landings``: the weight read and the new weight stored, per strategy;
* ``step``: a tile fetched and stepped, and the step kernel, :func:`multi_tensor_step`;
* ``check``: the non-finite check kernel, :func:`nonfinite_check`.

One launch steps many tensors. Tile ``i`` is ``blocks[i] = (row, block)``: elements
``block * BLOCK ...`` of the tensor of ``table[row]`` (``layout``: the addresses of its
components, its size, its draws' counter). Persistent programs walk the tiles, fetching the
next before computing the current (:func:`multi_tensor_step`). Every stored component is
read once and written once, in its own dtype, in one pass, in 16-byte vectors where the host
proved the alignment (``columns._pointer``); the gradient is read in its dtype and unscaled
and negated in registers. With ``SKIPPABLE`` the kernel reads the non-finite check's verdict
on the device and, when it is set, writes nothing.

Exact where the operations are the same (``docs/gpu.md``): each float32 operation is the
one the eager path rounds, in its order, correctly rounded:

* division and square root are ``tl.div_rn`` and ``tl.sqrt_rn`` (IEEE). Triton's ``/`` and
  ``tl.sqrt`` are approximate on NVIDIA GPUs (``div.full.f32``, ``sqrt.approx.f32``: up to
  2 ulp), which torch's kernels, on CPU and CUDA, are not. AdamW's division by a row's
  constant, the bias correction's root, is its reciprocal once a tile and one correction
  by fused multiply-adds (``arithmetic._div_by_row``: the IEEE quotient, as the C kernels
  compute it);
* a multiply and an add that torch rounds separately stay separate: the launch turns
  Triton's contraction into fused multiply-adds off (``enable_fp_fusion=False``), and the
  fused multiply-adds torch does compute (``lerp``, ``add(alpha=)``, ``addcmul``) are explicit
  (``arithmetic._fma``). The interpreter's ``tl.fma`` rounds twice (numpy ``x * y + z``), so
  there ``_fma`` computes the correctly rounded result in float64 (``EMULATE_FMA``);
* float32 -> bf16 rounds to nearest, ties to even: on a GPU by the hardware conversion
  (``HW``), in the interpreter, whose conversion does not, on the bit pattern
  (``rounding.h``'s ``bf_round``); NaN is stored as 0xFFFF either way
  (``arithmetic._bf16_bits``).
"""

from __future__ import annotations

from .arithmetic import div_by_row_probe, fma_probe
from .check import nonfinite_check
from .draws import stochastic_draw16_probe
from .step import multi_tensor_step

__all__ = ["multi_tensor_step", "nonfinite_check", "fma_probe", "div_by_row_probe",
           "stochastic_draw16_probe"]
