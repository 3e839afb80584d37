"""The cases of expert parallelism (CONTRACT.md sections 8 and 10, "EP") that every framework's EP layer passes:
its output equals the single-device layer's, its gradients are slices (the weights') and sums (``x``,
``router_logits``) of the single-device layer's, its router losses are the global ones, and the backward's edge
cases (ranks or devices without rows) really were exercised.

Subclassed by ``tests/test_ep_jax.py`` (``moe_pallas.ep`` on a mesh of forced host CPU devices, computed in one
child process) and ``tests/test_ep_torch.py`` (``moe_torch.ep`` over gloo processes, computed in one spawn). Both
compute every case once, in their module-scoped ``ep_results`` fixture, and record what the checks here judge; a
subclass names its cases (:attr:`EPCases.FORWARD_CASES`, :attr:`EPCases.BACKWARD_CASES`, :attr:`EPCases.ROWLESS`)
and implements the hooks that read its records: one record per rank (torch) or per mesh (JAX).

The limits are the contract's: the forward within F32_REL_FRO (float32), BF16_REL_FRO (bf16) or FP8_REL_FRO
(quantized) of the single-device layer, every gradient within GRAD_F32_REL_FRO / GRAD_BF16_REL_FRO, the experts
without rows exactly 0, the router losses within F32_REL_FRO, their gradient within GRAD_F32_REL_FRO and
``tokens_per_expert`` equal.
"""

from __future__ import annotations

import numpy as np

from op_cases import ClassParams
from tolerances import BF16_REL_FRO, F32_REL_FRO, FP8_REL_FRO, GRAD_BF16_REL_FRO, GRAD_F32_REL_FRO

#: The cotangents a backward record holds (rel. Frobenius errors against the single-device layer's matching part).
GRAD_NAMES = ("d_x", "d_router_logits", "d_w13", "d_w2")


def forward_limit(quant: str, dtype: str) -> float:
    """The contract's row for an EP layer's output against the single-device layer's."""
    if quant != "none":
        return FP8_REL_FRO
    return BF16_REL_FRO if dtype == "bfloat16" else F32_REL_FRO


def check_forward_errors(errors, quant: str, dtype: str, what: str) -> None:
    """Every rank's (device set's) rel. error of the output against the single-device layer's: finite, within
    :func:`forward_limit`."""
    limit = forward_limit(quant, dtype)
    assert all(np.isfinite(e) and e <= limit for e in errors), f"{what}: errors {errors} > {limit:.0e}"


def check_gradient_records(records, dtype: str, what: str, flags: tuple[str, ...] = ()) -> None:
    """Each record (a rank's or the mesh's): every cotangent of :data:`GRAD_NAMES` finite and within the dtype's
    gradient row; the experts without rows exactly 0 (``zero_rows_exact``: True, or None where there were none);
    each of ``flags`` true (e.g. every cotangent finite, in its input's dtype)."""
    limit = GRAD_BF16_REL_FRO if dtype == "bfloat16" else GRAD_F32_REL_FRO
    for i, r in enumerate(records):
        for flag in flags:
            assert r[flag], f"{what} record {i}: not {flag}: {r}"
        for name in GRAD_NAMES:
            assert np.isfinite(r[name]) and r[name] <= limit, f"{what} record {i} {name}: {r[name]:.3e} > {limit:.0e}"
        assert r["zero_rows_exact"] in (None, True), \
            f"{what} record {i}: an expert without rows got a nonzero weight gradient: {r}"


class EPCases(ClassParams):
    """The EP layer's cases, for any framework: every test reads the module-scoped ``ep_results`` fixture (all cases
    computed at once, in other processes).

    Hooks: :meth:`forward_errors`, :meth:`check_forward_record`, :meth:`backward_records`,
    :meth:`router_loss_records`; :attr:`FORWARD_CASES`, :attr:`BACKWARD_CASES`, :attr:`ROWLESS`,
    :attr:`GRADIENT_FLAGS`.
    """

    #: id -> a forward case's key (the subclass's: a case and its mode / layout).
    FORWARD_CASES: dict = {}
    #: id -> a backward case's key.
    BACKWARD_CASES: dict = {}
    #: The backward cases that must leave experts without rows: key -> ``(fewest, most)`` experts without rows in
    #: each of its records (``most`` None: no bound), or a list of such bounds, one per record.
    ROWLESS: dict = {}
    #: Record keys every backward record must hold true.
    GRADIENT_FLAGS: tuple[str, ...] = ()
    #: The modes of :meth:`test_ep_router_losses_are_global`.
    LOSS_MODES: tuple[str, ...] = ("replicated", "all_to_all")
    CLASS_PARAMS = {"forward_case": "FORWARD_CASES", "backward_case": "BACKWARD_CASES", "mode": "LOSS_MODES"}

    def forward_errors(self, ep_results, key) -> tuple[list[float], str, str]:
        """``(errors, quant, dtype)``: each rank's (device set's) rel. Frobenius error of the EP layer's output against
        the single-device layer's, for the case ``key``."""
        raise NotImplementedError

    def check_forward_record(self, ep_results, key) -> None:
        """The framework's own checks of the case's forward (shapes, dtypes, devices...); none by default."""

    def backward_records(self, ep_results, key) -> tuple[list[dict], str]:
        """``(records, dtype)`` of the backward case ``key``: per rank (or per mesh) the rel. errors of
        :data:`GRAD_NAMES`, ``zero_rows_exact`` and ``empty_experts`` (how many experts got no rows)."""
        raise NotImplementedError

    def router_loss_records(self, ep_results, mode: str) -> list[dict]:
        """Per rank (or per mesh) in ``mode``: ``{loss name: rel. error, "d_router_logits": rel. error,
        "tokens_per_expert": equal}`` against the single-device ``router_losses`` of all tokens."""
        raise NotImplementedError

    def test_ep_equals_single_device(self, ep_results, forward_case):
        """The EP layer's output (every rank's / the mesh's) equals the single-device layer's on the same inputs
        within the contract's row for its dtype and quantization."""
        errors, quant, dtype = self.forward_errors(ep_results, forward_case)
        check_forward_errors(errors, quant, dtype, str(forward_case))
        self.check_forward_record(ep_results, forward_case)

    def test_ep_gradients_are_slices_and_sums_of_single_device(self, ep_results, backward_case):
        """CONTRACT.md section 8, EP: each rank's (device's) weight-gradient slice is the single-device gradient's,
        d_x and d_router_logits the single-device ones (their sums over ranks, which the backward's collectives form);
        float32 within GRAD_F32_REL_FRO, bf16 within GRAD_BF16_REL_FRO; experts without rows exactly 0."""
        records, dtype = self.backward_records(ep_results, backward_case)
        check_gradient_records(records, dtype, str(backward_case), self.GRADIENT_FLAGS)

    def test_ep_gradient_edges_were_exercised(self, ep_results):
        """The backward cases meant to leave ranks (devices) without rows really did (:attr:`ROWLESS`: the experts
        without rows each record counts), and where there were such experts their exact-zero check ran and
        passed."""
        assert self.ROWLESS, "no case of the edge"
        for key, bounds in self.ROWLESS.items():
            records, _ = self.backward_records(ep_results, key)
            assert records, key
            for i, r in enumerate(records):
                fewest, most = bounds[i] if isinstance(bounds, list) else bounds
                n = r["empty_experts"]
                assert fewest <= n and (most is None or n <= most), f"{key} record {i}: {n} experts without rows, want " \
                                                                     f"{fewest}..{most}"
                assert not n or r["zero_rows_exact"] is True, f"{key} record {i}: the exact-zero check did not run: {r}"

    def test_ep_router_losses_are_global(self, ep_results, mode):
        """CONTRACT.md section 10: in both modes the EP layer's router losses and ``tokens_per_expert`` (every rank's)
        are the single-device ones of all tokens, and their gradient in ``router_logits`` the single-device
        gradient's (rows)."""
        for i, errs in enumerate(self.router_loss_records(ep_results, mode)):
            errs = dict(errs)
            assert errs.pop("tokens_per_expert"), f"record {i} {mode}: tokens_per_expert differs from the single device's"
            assert errs.pop("d_router_logits") <= GRAD_F32_REL_FRO, f"record {i} {mode}: d_router_logits"
            assert all(e <= F32_REL_FRO for e in errs.values()), f"record {i} {mode}: {errs}"
