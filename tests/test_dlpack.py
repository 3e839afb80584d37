"""interop.dlpack: torch <-> JAX, bit-exact, zero-copy where promised, stream-ordered on the GPU.

The matrix (dtype x shape x direction) runs on the CPU here and on CUDA with
EPMOE_TEST_DEVICE=gpu; the stream-ordering tests run on the GPU only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from common import DEVICE, TORCH_DEVICE

import moe_pallas
import moe_torch
from interop.dlpack import call_jax, call_torch, to_jax, to_torch

ON_GPU = torch.cuda.is_available() and jax.default_backend() == "gpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA for torch and a GPU backend for JAX")

TORCH = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32,
    "bool": torch.bool, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8, "int8": torch.int8,
}
JNP = {
    "float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "int32": jnp.int32, "bool": jnp.bool_,
    "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2, "uint8": jnp.uint8, "int8": jnp.int8,
}
T, H = 5, 7
SHAPES = ["scalar", "empty", "empty_2d", "dense", "transposed", "row_sliced"]


def random_bytes_tensor(shape, dtype: str, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN and inf codes included) of ``dtype``; bools are 0 or 1."""
    rng = np.random.default_rng(seed)
    itemsize = torch.empty((), dtype=TORCH[dtype]).element_size()
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return torch.empty(shape, dtype=TORCH[dtype], device=TORCH_DEVICE)
    raw = rng.integers(0, 2 if dtype == "bool" else 256, size=n * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(TORCH[dtype]).reshape(shape).to(TORCH_DEVICE).clone()  # torch-allocated: aligned


def make_tensor(shape_case: str, dtype: str) -> torch.Tensor:
    if shape_case == "scalar":        # 0-dim
        return random_bytes_tensor((), dtype)
    if shape_case == "empty":         # 0-size, 1-D
        return random_bytes_tensor((0,), dtype)
    if shape_case == "empty_2d":      # 0-size with a non-zero dim: strides (0, 1)
        return random_bytes_tensor((3, 0), dtype)
    if shape_case == "dense":         # [T, H], odd sizes
        return random_bytes_tensor((T, H), dtype)
    if shape_case == "transposed":    # strides (1, T): a transposition of a dense buffer
        return random_bytes_tensor((H, T), dtype).T
    if shape_case == "row_sliced":    # rows 2..6 of [T+2, 64]: a storage offset of 128 elements (aligned)
        return random_bytes_tensor((T + 2, 64), dtype)[2:]
    raise AssertionError(shape_case)


def torch_bytes(t: torch.Tensor) -> bytes:
    """The logical (C-order) bytes of a tensor, whatever its strides."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def jax_bytes(a: jax.Array) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def jax_ptr(a: jax.Array) -> int:
    return a.unsafe_buffer_pointer()


# ---------------------------------------------------------------- the matrix


@pytest.mark.parametrize("shape_case", SHAPES)
@pytest.mark.parametrize("dtype", list(TORCH))
def test_torch_to_jax_and_back(dtype, shape_case):
    t = make_tensor(shape_case, dtype)
    a = to_jax(t)
    assert a.shape == tuple(t.shape) and a.dtype == JNP[dtype]
    assert jax_bytes(a) == torch_bytes(t)
    back = to_torch(a)
    assert back.shape == t.shape and back.dtype == t.dtype and back.device == t.device
    assert torch_bytes(back) == torch_bytes(t)
    if t.numel():  # zero-copy both ways (a 0-size array has no bytes to share)
        assert jax_ptr(a) == t.data_ptr()
        assert back.data_ptr() == t.data_ptr()
        assert back.stride() == t.stride()  # the permuted layout comes back as strides


@pytest.mark.parametrize("shape_case", SHAPES)
@pytest.mark.parametrize("dtype", list(TORCH))
def test_jax_to_torch_and_back(dtype, shape_case):
    # A JAX-made array (its own XLA buffer) with the bytes of make_tensor's case.
    src = make_tensor(shape_case, dtype)
    if shape_case == "transposed":      # computed by XLA: jnp.transpose of an [H, T] array
        a = jnp.transpose(jnp.asarray(np.frombuffer(torch_bytes(src.T), JNP[dtype]).reshape(H, T)))
    elif shape_case == "row_sliced":    # computed by XLA: a row slice
        a = jnp.asarray(np.frombuffer(torch_bytes(src._base), JNP[dtype]).reshape(T + 2, 64))[2:]
    else:
        a = jnp.asarray(np.frombuffer(torch_bytes(src), JNP[dtype]).reshape(src.shape))
        assert jax_bytes(a) == torch_bytes(src)
    # (XLA:CPU's slice and transpose may canonicalize float8_e5m2 NaN payloads: 0xFE -> 0x7F, seen
    # with jax 0.11.2; so the computed cases are compared with `a` itself, not with `src`.)
    t = to_torch(a)
    assert t.shape == a.shape and t.dtype == TORCH[dtype] and t.device.type == TORCH_DEVICE
    assert torch_bytes(t) == jax_bytes(a)
    again = to_jax(t)
    assert jax_bytes(again) == jax_bytes(a)
    if a.size:  # zero-copy both ways
        assert t.data_ptr() == jax_ptr(a)
        assert jax_ptr(again) == jax_ptr(a)


def test_zero_and_zero_dim_keep_shape():
    for shape in [(), (0,), (3, 0)]:
        t = torch.zeros(shape, dtype=torch.bfloat16, device=TORCH_DEVICE)
        assert to_jax(t).shape == shape
        assert to_torch(jnp.zeros(shape, jnp.bfloat16)).shape == shape


# ---------------------------------------------------------------- the two bug reports


def test_bug_fp8_e4m3fn_bytes_cross_unchanged():
    t = torch.tensor([[0.5, -1.0, 448.0, 2.0**-9]]).to(torch.float8_e4m3fn).to(TORCH_DEVICE)
    expected = [0x30, 0xB8, 0x7E, 0x01]
    assert t.view(torch.uint8).cpu().flatten().tolist() == expected
    a = to_jax(t)
    assert a.dtype == jnp.float8_e4m3fn and a.shape == (1, 4)
    assert np.asarray(a).view(np.uint8).flatten().tolist() == expected
    assert np.asarray(a.astype(jnp.float32)).tolist() == [[0.5, -1.0, 448.0, 2.0**-9]]
    back = to_torch(a)
    assert back.dtype == torch.float8_e4m3fn
    assert back.view(torch.uint8).cpu().flatten().tolist() == expected
    assert jax_ptr(a) == t.data_ptr() == back.data_ptr()


def test_bug_transposed_bf16_keeps_its_layout():
    t = torch.arange(6).reshape(2, 3).to(torch.bfloat16).to(TORCH_DEVICE).T  # [[0, 3], [1, 4], [2, 5]]
    b = to_jax(t)
    assert b.shape == (3, 2)
    assert float(b[1, 0]) == 1.0
    assert np.asarray(b.astype(jnp.float32)).tolist() == [[0, 3], [1, 4], [2, 5]]
    assert jax_ptr(b) == t.data_ptr()  # zero-copy: JAX holds the transposed layout
    back = to_torch(b)
    assert back.stride() == (1, 3) and torch.equal(back, t)


# ---------------------------------------------------------------- int64


def test_int64_becomes_checked_int32_with_x64_off():
    ids = torch.tensor([[3, 0], [2**31 - 1, -(2**31)]], dtype=torch.int64, device=TORCH_DEVICE)
    a = to_jax(ids)
    assert a.dtype == jnp.int32
    assert np.asarray(a).tolist() == ids.tolist()
    assert jax_ptr(a) != ids.data_ptr()  # a copy, as documented
    assert to_torch(a).dtype == torch.int32  # the way back stays int32
    assert to_jax(torch.zeros((0, 8), dtype=torch.int64, device=TORCH_DEVICE)).dtype == jnp.int32
    assert to_jax(ids[:, 0]).tolist() == [3, 2**31 - 1]  # non-compact int64 too


def test_int64_out_of_int32_range_raises():
    ids = torch.tensor([5, 2**40 + 5, -1], dtype=torch.int64, device=TORCH_DEVICE)  # jax alone: silently 5
    with pytest.raises(ValueError) as e:
        to_jax(ids)
    assert str(e.value) == (
        "to_jax: tensor (int64, converted to int32 because JAX's x64 is off) must hold values in "
        "[-2147483648, 2147483647]; got values in [-1, 1099511627781]"
    )
    with pytest.raises(ValueError, match=r"to_jax: tensor must have a dtype JAX holds without a copy for copy=False; "
                                         r"got tensor.dtype=int64"):
        to_jax(ids[:1], copy=False)


def test_int64_zero_copy_with_x64_on():
    with jax.enable_x64(True):
        ids = torch.tensor([2**40 + 5, -7], dtype=torch.int64, device=TORCH_DEVICE)
        a = to_jax(ids)
        assert a.dtype == jnp.int64 and np.asarray(a).tolist() == [2**40 + 5, -7]
        assert jax_ptr(a) == ids.data_ptr()
        back = to_torch(a)
        assert back.dtype == torch.int64 and back.data_ptr() == ids.data_ptr()
        f = torch.tensor([0.1], dtype=torch.float64, device=TORCH_DEVICE)
        assert to_jax(f).dtype == jnp.float64 and jax_ptr(to_jax(f)) == f.data_ptr()


# ---------------------------------------------------------------- strides, alignment, copies, aliasing

NON_COMPACT = {
    "column_slice": lambda b: b[:, 1:],            # strides (7, 1) for shape (5, 6)
    "step": lambda b: b.reshape(-1)[::2],          # stride 2
    "expand": lambda b: b[:1].expand(4, H),        # stride 0
    "column": lambda b: b[:, 3],                   # a single column: stride 7
}


@pytest.mark.parametrize("case", list(NON_COMPACT))
def test_non_compact_strides_are_copied(case):
    base = random_bytes_tensor((T, H), "bfloat16", seed=3)
    t = NON_COMPACT[case](base)
    a = to_jax(t)
    assert a.shape == tuple(t.shape) and jax_bytes(a) == torch_bytes(t)
    assert jax_ptr(a) != t.data_ptr()  # documented: .contiguous(), not zero-copy
    with pytest.raises(ValueError) as e:
        to_jax(t, copy=False)
    assert str(e.value) == (
        f"to_jax: tensor must have compact strides (a dense layout, possibly transposed) for copy=False; "
        f"got shape={tuple(t.shape)}, stride={tuple(t.stride())} (a column slice, step or expand: "
        "pass copy=None to copy it with .contiguous())"
    )


def test_compact_layouts_cross_zero_copy():
    base = random_bytes_tensor((2, 3, 64), "float32", seed=4)
    cases = {
        "permuted_3d": base.permute(2, 0, 1),
        "unsqueezed": base.unsqueeze(1),
        "size1_odd_stride": torch.empty_strided((1, 64), (999, 1), device=TORCH_DEVICE).fill_(2.0),
        "one_row_of_many": base[1:2, 1:2],  # shape (1, 1, 64), every leading dim size 1
    }
    for name, t in cases.items():
        a = to_jax(t, copy=False)
        assert jax_bytes(a) == torch_bytes(t), name
        assert jax_ptr(a) == t.data_ptr(), name


def test_unaligned_row_slice_is_copied():
    t = torch.arange(12, dtype=torch.float32, device=TORCH_DEVICE).reshape(4, 3)[1:]  # starts 12 bytes in
    a = to_jax(t)
    assert np.asarray(a).tolist() == t.tolist()
    assert jax_ptr(a) != t.data_ptr()
    align = 64 if DEVICE == "cpu" else 16
    with pytest.raises(ValueError, match=rf"to_jax: tensor must have its data {align}-byte aligned on "
                                         rf"{t.device.type} for copy=False.*got data_ptr\(\) % {align} = 12"):
        to_jax(t, copy=False)


def test_copy_true_gives_an_independent_buffer_and_default_aliases():
    t = torch.zeros(4, 64, device=TORCH_DEVICE)
    shared, own = to_jax(t), to_jax(t, copy=True)
    assert jax_ptr(own) != t.data_ptr()
    t[0, 0] = 5.0  # writing a tensor JAX shares: documented hazard, visible in the zero-copy view
    if DEVICE == "gpu":
        torch.cuda.synchronize()
    assert float(shared[0, 0]) == 5.0 and float(own[0, 0]) == 0.0
    a = jnp.ones(3)
    c = to_torch(a, copy=True)
    assert c.data_ptr() != jax_ptr(a)
    c[0] = 7.0
    assert float(a[0]) == 1.0


def test_requires_grad_is_detached():
    w = torch.nn.Parameter(torch.randn(4, 64, device=TORCH_DEVICE))  # requires_grad=True
    a = to_jax(w)
    assert jax_ptr(a) == w.data_ptr()
    assert jax_bytes(a) == torch_bytes(w)
    assert w.requires_grad  # the caller's tensor is untouched


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_exact_messages():
    cases = [
        (lambda: to_jax(np.zeros(3)), TypeError, "to_jax: tensor must be a torch.Tensor; got numpy.ndarray"),
        (lambda: to_jax([1, 2]), TypeError, "to_jax: tensor must be a torch.Tensor; got list"),
        (lambda: to_jax(torch.zeros(2, dtype=torch.complex64)), TypeError,
         "to_jax: tensor must have dtype float32 or bfloat16 or float16 or float8_e4m3fn or float8_e5m2 or int32 "
         "or int8 or uint8 or bool or int64; got tensor.dtype=complex64"),
        (lambda: to_jax(torch.zeros(2, dtype=torch.float64)), TypeError,
         "to_jax: tensor must have dtype float32 or bfloat16 or float16 or float8_e4m3fn or float8_e5m2 or int32 "
         "or int8 or uint8 or bool or int64 (float64 only with JAX's x64 on: JAX would round it to float32); "
         "got tensor.dtype=float64"),
        (lambda: to_jax(torch.zeros(2, dtype=torch.int16)), TypeError,
         "to_jax: tensor must have dtype float32 or bfloat16 or float16 or float8_e4m3fn or float8_e5m2 or int32 "
         "or int8 or uint8 or bool or int64; got tensor.dtype=int16"),
        (lambda: to_jax(torch.zeros(2, 2).to_sparse()), TypeError,
         "to_jax: tensor must be a dense torch.strided tensor; got tensor.layout=torch.sparse_coo"),
        (lambda: to_jax(torch.zeros(2, device="meta")), ValueError,
         "to_jax: tensor must be on the CPU or a CUDA device; got tensor.device=meta"),
        (lambda: to_jax(torch.zeros(2), copy="no"), TypeError,
         "to_jax: copy must be None, True or False; got copy='no'"),
        (lambda: to_torch(torch.zeros(2)), TypeError, "to_torch: array must be a jax.Array; got torch.Tensor"),
        (lambda: to_torch(np.zeros(2)), TypeError, "to_torch: array must be a jax.Array; got numpy.ndarray"),
        (lambda: to_torch(jnp.zeros(2, jnp.uint32)), TypeError,
         "to_torch: array must have dtype float32 or bfloat16 or float16 or float8_e4m3fn or float8_e5m2 or int32 "
         "or int8 or uint8 or bool; got array.dtype=uint32"),
        (lambda: to_torch(jnp.zeros(2), copy=1), TypeError, "to_torch: copy must be None, True or False; got copy=1"),
    ]
    for fn, exc, message in cases:
        with pytest.raises(exc) as e:
            fn()
        assert str(e.value) == message


def test_to_torch_rejects_tracers_and_deleted_arrays():
    with pytest.raises(TypeError, match=r"^to_torch: array must be a concrete jax.Array \(DLPack cannot export "
                                        r"values traced inside jit / vmap / grad\); got "):
        jax.jit(to_torch)(jnp.zeros(2))
    a = jnp.ones(3)
    a.delete()
    with pytest.raises(ValueError, match=r"^to_torch: array must be alive; got a deleted \(donated\) array$"):
        to_torch(a)


@pytest.mark.skipif(torch.cuda.is_available() and jax.default_backend() == "gpu", reason="JAX has a GPU here")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA tensor")
def test_cuda_tensor_without_jax_gpu_raises():
    with pytest.raises(ValueError, match=r"^to_jax: tensor must be on a device JAX can use; got tensor.device=cuda:0"):
        to_jax(torch.zeros(2, device="cuda"))


# ---------------------------------------------------------------- call_jax / call_torch


def _gemm_inputs(seed: int = 0):
    """``x [M_cap, K]`` bf16 (rows past offsets[-1] are padding), ``w [E, N, K]`` bf16, offsets int32."""
    rng = np.random.default_rng(seed)
    M_cap, K, N, E = 12, 64, 32, 3
    x = rng.standard_normal((M_cap, K)).astype(np.float32)
    w = (rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(np.float32)
    offsets = np.array([0, 4, 4, 10], np.int32)  # expert 1 empty, two padding rows
    return x, w, offsets


def test_call_jax_runs_a_pallas_op_on_torch_tensors():
    x, w, offsets = _gemm_inputs()
    x_t = torch.from_numpy(x).to(TORCH_DEVICE, torch.bfloat16)
    w_t = torch.from_numpy(w).to(TORCH_DEVICE, torch.bfloat16)
    offsets_t = torch.from_numpy(offsets).to(TORCH_DEVICE).to(torch.int64)  # SGLang-style int64: checked int32
    y_t = call_jax(moe_pallas.grouped_gemm, x_t, w_t, offsets_t, implementation="reference")
    assert isinstance(y_t, torch.Tensor) and y_t.dtype == torch.bfloat16 and y_t.device == x_t.device
    direct = moe_pallas.grouped_gemm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
                                     jnp.asarray(offsets), implementation="reference")
    assert torch_bytes(y_t) == jax_bytes(direct)
    assert float(y_t.float().abs().sum()) > 0  # not all zeros


def test_call_jax_combine_with_kwargs_and_containers():
    rng = np.random.default_rng(1)
    y = rng.standard_normal((6, 64)).astype(np.float32)
    src2dst = np.array([[0, 3], [5, -1], [1, 2]], np.int32)
    weights = rng.random((3, 2)).astype(np.float32)
    out = call_jax(
        lambda args, kw: {"out": moe_pallas.combine(*args, **kw), "ids": (args[1],)},
        (torch.from_numpy(y).to(TORCH_DEVICE), torch.from_numpy(src2dst).to(TORCH_DEVICE)),
        {"topk_weights": torch.from_numpy(weights).to(TORCH_DEVICE), "routed_scaling_factor": 2.5,
         "implementation": "reference"},
    )
    direct = moe_pallas.combine(jnp.asarray(y), jnp.asarray(src2dst), jnp.asarray(weights),
                                routed_scaling_factor=2.5, implementation="reference")
    assert isinstance(out["out"], torch.Tensor) and torch_bytes(out["out"]) == jax_bytes(direct)
    assert isinstance(out["ids"], tuple) and out["ids"][0].tolist() == src2dst.tolist()


def test_call_torch_runs_a_torch_op_on_jax_arrays():
    x, w, offsets = _gemm_inputs(seed=2)
    xj, wj, oj = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(offsets)
    y = call_torch(moe_torch.grouped_gemm, xj, wj, oj, implementation="reference")
    assert isinstance(y, jax.Array) and y.dtype == jnp.bfloat16 and y.shape == (12, 32)
    direct = moe_torch.grouped_gemm(to_torch(xj).clone(), to_torch(wj).clone(), to_torch(oj).clone(),
                                    implementation="reference")
    assert jax_bytes(y) == torch_bytes(direct)
    assert float(jnp.abs(y.astype(jnp.float32)).sum()) > 0


def test_call_torch_int64_outputs_are_checked_and_named_tuples_kept():
    from collections import namedtuple

    Pair = namedtuple("Pair", "idx val")
    out = call_torch(lambda a: Pair(torch.argsort(a), a * 2), jnp.asarray([3.0, 1.0, 2.0]))
    assert isinstance(out, Pair) and out.idx.dtype == jnp.int32 and out.idx.tolist() == [1, 2, 0]
    assert out.val.tolist() == [6.0, 2.0, 4.0]


# ---------------------------------------------------------------- stream order (GPU only)

N_BIG = 256 * 2**20  # 256M int32 elements, 1 GiB: long enough that an unordered read sees the poison


@gpu_only
@pytest.mark.parametrize("side_stream", [False, True], ids=["default_stream", "side_stream"])
def test_gpu_torch_writes_then_jax_reads_at_once(side_stream):
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):  # torch's *current* stream during the write and the hand-over
        x = torch.full((N_BIG,), -1, dtype=torch.int32, device="cuda")  # poison
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the writes below start
        x.fill_(0)
        for _ in range(6):  # a chain of writes on the current stream; each element ends at 3
            x.add_(1)
        x.mul_(2).sub_(9)  # 6 * 2 - 9 = 3
        a = to_jax(x)
        total = int(jnp.sum(a))
        expected = int(torch.sum(x, dtype=torch.int64))
    assert expected == 3 * N_BIG  # 3 * 2**28 < 2**31: exact in int32 too
    assert total == expected


@gpu_only
@pytest.mark.parametrize("side_stream", [False, True], ids=["default_stream", "side_stream"])
def test_gpu_jax_computes_then_torch_reads_at_once(side_stream):
    @jax.jit
    def slow(seed):  # a sort of 256M elements: tens of ms in flight after dispatch returns
        return jnp.sort(jnp.arange(N_BIG, dtype=jnp.int32)[::-1] + seed)  # = arange + seed

    slow(jnp.int32(5)).block_until_ready()  # compile first; its freed buffer holds arange + 5 (a stale answer)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        a = slow(jnp.int32(0))  # dispatch returns at once; the sort is in flight
        t = to_torch(a)
        total = int(torch.sum(t, dtype=torch.int64))
        first, last = int(t[0]), int(t[-1])
    assert (first, last) == (0, N_BIG - 1)
    assert total == N_BIG * (N_BIG - 1) // 2
