"""Every on/off environment switch of the kernels (``moe_contract/env.py``'s reader): its default when unset or
empty, the accepted spellings, and a ValueError naming the variable for anything else; and the three-state reading of
``EPMOE_TRITON_GLUON_BF16`` (unset: the tuned table chooses the 16-bit forward's kernel)."""

from __future__ import annotations

import pytest

from moe_pallas.ops import common as pallas_common
from moe_torch.ops import triton_common

#: (variable, reader, default)
SWITCHES = [
    (pallas_common.FP8_WGMMA_ENV, pallas_common.fp8_wgmma_enabled, True),
    (pallas_common.DIV_RN_ENV, pallas_common.div_rn_enabled, True),
    (pallas_common.ALIGNED_TILES_ENV, pallas_common.aligned_tiles_enabled, True),
    (triton_common.ALIGNED_TILES_ENV, triton_common.aligned_tiles_enabled, True),
    (triton_common.GLUON_FP8_BLOCK_ENV, triton_common.gluon_fp8_block_enabled, True),
    (triton_common.GLUON_FP8_ROWWISE_ENV, triton_common.gluon_fp8_rowwise_enabled, True),
    (triton_common.GLUON_WGRAD_ENV, triton_common.gluon_wgrad_enabled, True),
    (triton_common.TMA_DGRAD_ENV, triton_common.tma_dgrad_enabled, True),
    (triton_common.GLUON_BF16_ENV, triton_common.gluon_bf16_enabled, False),
    (triton_common.GLUON_DGRAD_ENV, triton_common.gluon_dgrad_enabled, False),
]


@pytest.mark.parametrize("name, read, default", SWITCHES, ids=[s[0] for s in SWITCHES])
@pytest.mark.parametrize("raw", [None, "", "   ", "0", "false", " Off ", "NO", "1", "true", " ON ", "yes"])
def test_switch_values(monkeypatch, name, read, default, raw):
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    expected = default if raw is None or not raw.strip() else raw.strip().lower() in ("1", "true", "on", "yes")
    assert read() is expected


@pytest.mark.parametrize("name, read, default", SWITCHES, ids=[s[0] for s in SWITCHES])
@pytest.mark.parametrize("raw", ["2", "maybe", "enable"])
def test_switch_refuses_other_values(monkeypatch, name, read, default, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"{name}.*got {name}='{raw}'"):
        read()


@pytest.mark.parametrize("raw, expected", [(None, None), ("", None), ("  ", None), ("0", False), (" Off ", False),
                                           ("no", False), ("1", True), ("TRUE", True), (" on ", True)])
def test_gluon_bf16_switch_three_states(monkeypatch, raw, expected):
    """``EPMOE_TRITON_GLUON_BF16`` (``triton_common.gluon_bf16_switch``): unset / empty -> None (the tuned forward entry
    chooses: ``config.tuned_forward_kernel``), 0/false/off/no -> False (the Triton kernel), 1/true/on/yes -> True (the
    Gluon kernel where it serves); ``gluon_bf16_enabled`` keeps its two-state reading (True only when forced on)."""
    name = triton_common.GLUON_BF16_ENV
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    assert triton_common.gluon_bf16_switch() is expected
    assert triton_common.gluon_bf16_enabled() is (expected is True)


@pytest.mark.parametrize("raw", ["2", "auto", "tuned"])
def test_gluon_bf16_switch_refuses_other_values(monkeypatch, raw):
    name = triton_common.GLUON_BF16_ENV
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"{name}.*got {name}='{raw}'"):
        triton_common.gluon_bf16_switch()
