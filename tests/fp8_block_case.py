"""The FP8-block case both frameworks' grouped GEMM tests share (numpy only): weights whose every 128 x 128 block
has its own magnitude, so a tile that reads a neighbouring block's scale is off by >= 4x, and the blockwise
formula (CONTRACT.md section 4: each 128-wide K block's partial sum scaled before it is accumulated) in float64."""

from __future__ import annotations

import numpy as np

E, N, K, ROWS = 2, 320, 256, (5, 3)  # 3 column blocks (the last partial) x 2 K blocks, 2 experts


def column_block_case(seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x [8, K], w [E, N, K], offsets [E + 1])`` float32 / int32: block magnitudes 2^-12 .. 2^12 (even powers,
    each block its own)."""
    rng = np.random.default_rng(seed)
    mags = np.exp2(rng.permutation(np.arange(-12, 13, 2))[:E * 3 * 2].reshape(E, 3, 2)).astype(np.float32)
    w = rng.standard_normal((E, N, K)).astype(np.float32) * np.repeat(np.repeat(mags, 128, 1)[:, :N], 128, 2)
    x = rng.standard_normal((sum(ROWS), K)).astype(np.float32)
    return x, w, np.concatenate([[0], np.cumsum(ROWS)]).astype(np.int32)


def blockwise_expected(qx, qw, sx, sw, offsets) -> np.ndarray:
    """``y [M, N]`` float64 from the codes ``qx [M, K]``, ``qw [E, N, K]`` and the scales ``sx [M, K // 128]``,
    ``sw [E, ceil(N / 128), K // 128]`` (numpy arrays of any float dtype)."""
    qx, qw, sx, sw = (np.asarray(a, np.float64) for a in (qx, qw, sx, sw))
    n = qw.shape[1]
    y = np.zeros((qx.shape[0], n))
    for e in range(qw.shape[0]):
        r = slice(offsets[e], offsets[e + 1])
        for b in range(qx.shape[1] // 128):
            k = slice(b * 128, (b + 1) * 128)
            y[r] += (qx[r, k] @ qw[e][:, k].T) * sx[r, b:b + 1] * np.repeat(sw[e, :, b], 128)[None, :n]
    return y
