"""The precision each matmul of a traced JAX function asks for.

XLA's GPU default for float32 dots is TF32-like (10-bit mantissas; on the CPU the default is exact), so
on a GPU a float32 result equals torch's float32 one (TF32 off by default) only where the dot asks for
``Precision.HIGHEST``. The CPU cannot show the difference in values; the traced program shows it.
"""

from __future__ import annotations

import jax
import jax.extend

HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


def _walk(jaxpr, out: list) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval.dtype for v in eqn.invars)
            out.append((str(lhs), str(rhs), eqn.params.get("precision")))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if isinstance(inner, jax.extend.core.Jaxpr):
                    _walk(inner, out)


def dot_precisions(fn, *args) -> list[tuple[str, str, object]]:
    """``(lhs dtype, rhs dtype, precision)`` of every ``dot_general`` in ``fn(*args)``'s program (nested
    jaxprs included: jit, custom_vjp, loops, Pallas kernels), traced with no default matmul precision
    (``JAX_DEFAULT_MATMUL_PRECISION`` would otherwise stamp its value on every dot that asks for none)."""
    with jax.default_matmul_precision(None):
        closed = jax.make_jaxpr(fn)(*args)
    out: list = []
    _walk(closed.jaxpr, out)
    return out


def assert_float32_dots_highest(fn, *args, at_least: int = 1) -> list[tuple[str, str, object]]:
    """Every float32 x float32 dot of ``fn(*args)`` asks for ``Precision.HIGHEST`` (and there are at least
    ``at_least`` of them). Returns all the dots."""
    dots = dot_precisions(fn, *args)
    f32 = [d for d in dots if d[:2] == ("float32", "float32")]
    assert len(f32) >= at_least, f"expected >= {at_least} float32 dots; got {dots}"
    loose = [d for d in f32 if d[2] != HIGHEST]
    assert not loose, f"{len(loose)} of {len(f32)} float32 dots not at Precision.HIGHEST (TF32-like on a GPU): {loose[:3]}"
    return dots
