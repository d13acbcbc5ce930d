"""Independent brute-force reference for the update metrics: python floats and loops.

Nothing here uses torch arithmetic: tensors are turned into python lists of float64 values
first, and sums use ``math.fsum`` (correctly rounded), so agreement with
``collage.metrics`` checks the implementation, not a shared code path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def as_floats(t: torch.Tensor) -> list[float]:
    """The elements of ``t`` as python floats (exact: every dtype used embeds in float64)."""
    return [float(x) for x in t.detach().to(torch.float64).reshape(-1).tolist()]


@dataclass
class Update:
    """One update as the optimizer would report it."""

    intended: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor
    visible_before: torch.Tensor | None = None
    visible_after: torch.Tensor | None = None
    compensation: torch.Tensor | None = None

    def kwargs(self) -> dict[str, torch.Tensor | None]:
        return {
            "visible_before": self.visible_before,
            "visible_after": self.visible_after,
            "compensation": self.compensation,
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b != 0 else math.nan


def reference_metrics(updates: list[Update]) -> dict[str, float]:
    """Metrics of all ``updates`` pooled together, computed element by element."""
    ed, dd, ee, evd, evev, cc = [], [], [], [], [], []
    n_nonzero = n_stuck = n_stuck_v = n_comp = 0
    for u in updates:
        d = as_floats(u.intended)
        b, a = as_floats(u.before), as_floats(u.after)
        if u.visible_before is None:
            vb, va = b, a
        else:
            vb, va = as_floats(u.visible_before), as_floats(u.visible_after)
        for i in range(len(d)):
            e_i = a[i] - b[i]
            ev_i = va[i] - vb[i]
            ed.append(e_i * d[i])
            dd.append(d[i] * d[i])
            ee.append(e_i * e_i)
            evd.append(ev_i * d[i])
            evev.append(ev_i * ev_i)
            if d[i] != 0:
                n_nonzero += 1
                n_stuck += e_i == 0
                n_stuck_v += ev_i == 0
        if u.compensation is not None:
            c = as_floats(u.compensation)
            cc.extend(x * x for x in c)
            n_comp += len(c)
    out = {
        "edq": _ratio(math.fsum(ed), math.fsum(dd)),
        "imprecision": _ratio(n_stuck, n_nonzero),
        "update_norm": math.sqrt(math.fsum(dd)),
        "effective_norm": math.sqrt(math.fsum(ee)),
        "edq_visible": _ratio(math.fsum(evd), math.fsum(dd)),
        "imprecision_visible": _ratio(n_stuck_v, n_nonzero),
        "effective_norm_visible": math.sqrt(math.fsum(evev)),
    }
    if n_comp:
        out["compensation_norm"] = math.sqrt(math.fsum(cc))
    return out


def reference_dict(by_key: dict[str, list[Update]]) -> dict[str, float]:
    """The flat dict ``UpdateStats.to_dict`` should return for these per-key updates."""
    out: dict[str, float] = {}
    for key, updates in by_key.items():
        for name, value in reference_metrics(updates).items():
            out[name if key == "" else f"{name}/{key}"] = value
    return out


def assert_metrics_close(got: dict[str, float], want: dict[str, float]) -> None:
    """Same keys; values equal up to float64 summation order (nan matches nan).

    The implementation sums with ``torch.dot`` (some order), the reference with ``fsum``
    (correctly rounded); both sum n <= 10^4 float64 products, so they differ by at most
    about n * 2**-53 relative to the sum of |terms| -- far below 1e-10.
    """
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for name, w in want.items():
        g = got[name]
        if math.isnan(w):
            assert math.isnan(g), (name, g, w)
        else:
            assert math.isclose(g, w, rel_tol=1e-10, abs_tol=1e-12), (name, g, w)


def random_update(
    n: int,
    seed: int,
    *,
    scale: float = 1e-2,
    visible: bool = False,
    compensation: bool = False,
) -> Update:
    """A plain-bf16 update of ``n`` elements with some zero and some lost entries.

    ``d`` has ~20% exact zeros and a spread of magnitudes so that some elements round away
    (e == 0) and some do not. With ``visible`` the represented value is ``hi + lo`` kept in
    float64 and the visible one is ``hi``.
    """
    g = torch.Generator().manual_seed(seed)
    hi = torch.randn(n, generator=g).to(torch.bfloat16)
    mag = scale * torch.exp2(-8 * torch.rand(n, generator=g))
    d = (torch.randn(n, generator=g).sign() * mag).to(torch.float32)
    d[torch.rand(n, generator=g) < 0.2] = 0.0
    new_hi = (hi.double() + d.double()).to(torch.bfloat16)
    if not visible:
        comp = torch.randn(n, generator=g).to(torch.bfloat16) if compensation else None
        return Update(d, hi, new_hi, compensation=comp)
    lo = torch.zeros(n, dtype=torch.bfloat16)
    new_lo = ((hi.double() + d.double()) - new_hi.double()).to(torch.bfloat16)
    return Update(
        d,
        hi.double() + lo.double(),
        new_hi.double() + new_lo.double(),
        visible_before=hi,
        visible_after=new_hi,
        compensation=new_lo if compensation else None,
    )
