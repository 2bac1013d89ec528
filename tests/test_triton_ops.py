"""The Triton kernels of opentinker/engine/model/triton_ops.py against their torch references.

Where a GPU is present they run compiled on it. On CPU they need Triton's interpreter, which
must be chosen before triton is first imported (its standard library is built then): a CPU run
of this file therefore skips the kernel tests in-process and reruns them in one subprocess
started with ``TRITON_INTERPRET=1`` (:func:`test_kernels_under_the_interpreter`). Plus: the
references against the engine's own torch paths (LoraBatch on a LoraSlots store,
StepAttention), one launch with a grid from shapes only, an ahead-of-time compile of every
kernel for sm_90 through ptxas (no GPU needed), and the module without triton installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from opentinker.engine.model import triton_ops as T

INTERPRETED = T._interpreted()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = T.available(DEVICE)
kernel_test = pytest.mark.skipif(not KERNELS, reason="no triton, or CPU without the interpreter: "
                                 "test_kernels_under_the_interpreter runs these in a subprocess")


@pytest.fixture()
def interp() -> None:
    """On CPU: the kernels really are Triton's interpreter (not a torch fallback)."""
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        assert all(isinstance(T._kernel(n), InterpretedFunction) for n in ("shrink", "expand", "decode"))


@pytest.mark.slow
@pytest.mark.skipif(T.triton is None or KERNELS, reason="no triton, or the kernel tests run in this process")
def test_kernels_under_the_interpreter() -> None:
    """This file's kernel tests, in a fresh process with TRITON_INTERPRET=1 set before import."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-rs", "-p", "no:cacheprovider"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and " passed" in r.stdout and "CPU without the interpreter" not in r.stdout, (
        r.stdout[-6000:] + r.stderr[-3000:])


def _slots(N: int, S: int, gen: torch.Generator) -> torch.Tensor:
    """Slots in arbitrary order with -1 rows, plus a run of 20 rows of one slot (a uniform tile)."""
    slot = torch.randint(-1, S, (N,), generator=gen)
    slot[3:23] = S - 1
    slot[0] = -1
    return slot


def _big(t: torch.Tensor) -> float:
    return t.abs().max().item()


# ------------------------------------------------------------------------------------ LoRA


@kernel_test
@pytest.mark.parametrize("G,R,Din,Dout,N", [(3, 12, 100, 70, 45), (1, 8, 40, 130, 17), (2, 40, 33, 20, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_shrink_expand_match_reference(interp, G, R, Din, Dout, N, dtype) -> None:
    """Several slots in any order, -1 rows, uniform tiles, ranks and dims off the tiles (G*R
    = 80 spans two rank tiles), A a strided view of a larger store, u a column slice of the
    group's output, y a row-strided column block of a fused output; bf16 x/y on fp32 A/B."""
    gen = torch.Generator().manual_seed(G * 1000 + R)
    S = 5
    store = torch.randn(S, G * R, Din + 3, generator=gen).to(DEVICE)
    A = store[:, :, 2:Din + 2]  # not contiguous, storage offset 2
    B = (torch.randn(S, Dout, R, generator=gen) / R**0.5).to(DEVICE)
    scale = (torch.rand(S, generator=gen) + 0.5).to(DEVICE)
    slot = _slots(N, S, gen).to(DEVICE, torch.int32 if dtype == torch.float32 else torch.int64)
    x = torch.randn(N, Din, generator=gen).to(DEVICE, dtype)
    u = T.lora_shrink(x, A, slot, scale)
    u_ref = T.lora_shrink_ref(x, A, slot, scale)
    assert u.dtype == torch.float32 and u.shape == (N, G * R)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: A rounded to bf16 in registers
    assert _big(u - u_ref) <= tol * _big(u_ref)
    assert (u[slot < 0] == 0).all()

    fused = torch.randn(N, G * Dout + 7, generator=gen).to(DEVICE, dtype)
    for j in range(G):
        y = fused[:, 7 + j * Dout:7 + (j + 1) * Dout]
        before = fused.clone()
        y_ref = T.lora_expand_ref(y.clone(), u[:, j * R:(j + 1) * R], B, slot)
        assert T.lora_expand_(y, u[:, j * R:(j + 1) * R], B, slot) is y
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert _big(y.float() - y_ref.float()) <= tol * _big(y_ref)
        assert torch.equal(y[slot < 0], before[:, 7 + j * Dout:7 + (j + 1) * Dout][slot < 0])
        other = torch.ones(fused.shape[1], dtype=torch.bool, device=DEVICE)
        other[7 + j * Dout:7 + (j + 1) * Dout] = False
        assert torch.equal(fused[:, other], before[:, other])  # the neighbours are untouched


@kernel_test
def test_lora_edge_cases(interp) -> None:
    """No adapter anywhere: zeros and y untouched; a preallocated strided out; N = 0."""
    d = DEVICE
    x, A, B = torch.randn(9, 24, device=d), torch.randn(3, 6, 24, device=d), torch.randn(3, 10, 6, device=d)
    none, ones = torch.full((9,), -1, device=d), torch.ones(3, device=d)
    assert (T.lora_shrink(x, A, none, ones) == 0).all()
    y = torch.randn(9, 10, device=d)
    assert torch.equal(T.lora_expand_(y.clone(), torch.randn(9, 6, device=d), B, none), y)
    wide = torch.zeros(9, 20, device=d)
    slot = torch.tensor([2, 0, 1, 1, -1, 2, 0, 0, 2], device=d)
    scale = torch.tensor([1.0, 2.0, 0.5], device=d)
    out = T.lora_shrink(x, A, slot, scale, out_N_R=wide[:, 4:10])
    assert out.data_ptr() == wide[:, 4:10].data_ptr()
    assert _big(wide[:, 4:10] - T.lora_shrink_ref(x, A, slot, scale)) < 1e-5
    assert (wide[:, :4] == 0).all() and (wide[:, 10:] == 0).all()
    assert T.lora_shrink(x[:0], A, slot[:0], ones).shape == (0, 6)
    with pytest.raises(ValueError):
        T.lora_shrink(x, A, slot, ones, out_N_R=torch.zeros(9, 6, dtype=torch.bfloat16, device=d))


@kernel_test
def test_lora_kernels_equal_lorabatch_on_a_slot_store(interp) -> None:
    """On a real LoraSlots store (ranks 4 and 6, so R = 6 with zero padding; q/k/v one group of
    G = 3; alphas differ): one shrink for the group and one expand per projection, reading
    store.A / store.B in place, equal the engine's torch LoraBatch."""
    from opentinker.engine.model import LoraBatch, LoraWeights
    from opentinker.engine.model.config import DecoderSpec
    from opentinker.engine.model.lora_slots import LoraSlots
    from protocols.messages import LoraSpec

    spec = DecoderSpec(family="llama", vocab_size=64, hidden_size=40, intermediate_size=48, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=10, tie_word_embeddings=True)
    store = LoraSlots(spec, device=DEVICE)
    adapters = []
    for seed, (rank, alpha) in enumerate([(4, 8.0), (6, 3.0), (4, 4.0)]):
        ls = LoraSpec(rank=rank, alpha=alpha, seed=seed)
        named = LoraWeights.new(ls, spec)
        for name, t in named.items():
            if ".lora_B." in name:
                t.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
        w = LoraWeights.from_named(named, ls, spec)
        store.put(w)
        adapters.append(w)
    rows = [adapters[2], None, adapters[0], adapters[1], adapters[0], adapters[2], None, adapters[1]]
    L = 3
    x = torch.randn(len(rows) * L, spec.hidden_size, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    slot = torch.tensor([-1 if a is None else a.slot for a in rows]).repeat_interleave(L).to(DEVICE)
    scale = torch.tensor([0.0 if o is None else o.scale for o in store.owners], device=DEVICE)
    group, R = ("q_proj", "k_proj", "v_proj"), store.rank
    lora = LoraBatch(rows, [L] * len(rows), method="stacked")
    with torch.no_grad():
        u = T.lora_shrink(x, store.A[(0, group)], slot, scale)
        for j, m in enumerate(group):
            y0 = torch.randn(x.shape[0], store.B[(0, m)].shape[1], device=DEVICE)
            ours = T.lora_expand_(y0.clone(), u[:, j * R:(j + 1) * R], store.B[(0, m)], slot)
            ref = lora.apply(0, m, x, y0.clone())
            assert _big(ours - ref) < 1e-5 * max(1.0, _big(ref))


# ------------------------------------------------------------------------------------ attention


def _paged_case(B: int, Hq: int, Hkv: int, D: int, block_size: int, ctx: list[int], dtype: torch.dtype,
                seed: int = 0, device: str = "cpu") -> tuple:
    """Pools with shuffled blocks; block-table entries past a context are out of range (-1 or
    huge), so reading one would fault or show."""
    gen = torch.Generator().manual_seed(seed)
    M = max(-(-c // block_size) for c in ctx) + 2
    nb = B * M + 3
    k = torch.randn(nb * block_size, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(nb * block_size, Hkv, D, generator=gen).to(dtype)
    bt = torch.randperm(nb, generator=gen)[:B * M].view(B, M).to(torch.int32)
    for b, c in enumerate(ctx):
        used = -(-c // block_size)
        bt[b, used:] = torch.where(torch.arange(M - used) % 2 == 0, -1, 10**9).to(torch.int32)
    q_wide = torch.randn(B, Hq + 3, D, generator=gen).to(dtype)
    q = q_wide[:, 3:]  # a strided view, as a slice of a fused projection would be
    return tuple(t.to(device) for t in (q, k, v, bt, torch.tensor(ctx, dtype=torch.int32)))


@kernel_test
@pytest.mark.parametrize("Hq,Hkv,D,block_size,dtype", [
    (14, 2, 32, 8, torch.float32),    # GQA 7
    (4, 4, 24, 16, torch.float32),    # GQA 1, head_dim off the power of two
    (14, 2, 16, 16, torch.bfloat16),  # bf16 q and pools
    (6, 3, 32, 8, torch.bfloat16),
])
def test_paged_decode_attention_matches_reference(interp, Hq, Hkv, D, block_size, dtype) -> None:
    """Contexts of 0, 1, exactly one block, partial blocks and many tiles (block_t 16)."""
    ctx = [37, 0, 1, block_size, 100, 2 * block_size + 3]
    q, k, v, bt, ctx_t = _paged_case(len(ctx), Hq, Hkv, D, block_size, ctx, dtype, seed=Hq + D, device=DEVICE)
    scale = D**-0.5
    o = T.paged_decode_attention(q, k, v, bt, ctx_t, block_size, scale, block_t=16)
    ref = T.paged_decode_attention_ref(q, k, v, bt, ctx_t, block_size, scale)
    assert o.dtype == dtype and o.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _big(o.float() - ref.float()) < tol
    assert (o[1] == 0).all()  # ctx 0
    o64 = T.paged_decode_attention(q, k, v, bt, ctx_t, block_size, scale)  # the default tile
    assert _big(o64.float() - ref.float()) < tol
    out = torch.full((len(ctx), Hq, D + 5), 7.0, dtype=dtype, device=DEVICE)[:, :, 2:D + 2]
    assert T.paged_decode_attention(q, k, v, bt, ctx_t, block_size, scale, out=out, block_t=32) is out
    assert _big(out.float() - ref.float()) < tol


def test_paged_reference_equals_step_attention() -> None:
    """The reference is the engine's StepAttention on decode rows (GQA as repeat_kv)."""
    import numpy as np

    from opentinker.engine.model import StepAttention

    ctx, bs, Hq, Hkv, D = [5, 17, 8, 1], 8, 6, 2, 16
    q, k, v, bt, ctx_t = _paged_case(len(ctx), Hq, Hkv, D, bs, ctx, torch.float32, seed=3)
    last = torch.tensor([int(bt[b, (c - 1) // bs]) * bs + (c - 1) % bs for b, c in enumerate(ctx)])
    attn = StepAttention([k.clone()], [v.clone()], bs, last, bt, ctx_t.long(), np.ones(len(ctx), dtype=np.int64),
                         np.array(ctx))
    with torch.no_grad():
        engine = attn(0, q.contiguous(), k[last], v[last])
    ref = T.paged_decode_attention_ref(q, k, v, bt, ctx_t, bs, D**-0.5)
    assert _big(engine - ref) < 1e-5


@kernel_test
def test_one_launch_grid_from_shapes(interp, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each op is one launch whose grid depends on shapes only (not on slots or contexts)."""
    grids: list[tuple[str, tuple]] = []
    real = T._kernel

    class Spy:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: tuple):
            grids.append((self.name, grid))
            return real(self.name)[grid]

    monkeypatch.setattr(T, "_kernel", Spy)
    d = DEVICE
    x, A, B = torch.randn(40, 24, device=d), torch.randn(8, 6, 24, device=d), torch.randn(8, 10, 6, device=d)
    for slot in (torch.arange(40) % 8, torch.zeros(40, dtype=torch.long), torch.full((40,), -1)):
        u = T.lora_shrink(x, A, slot.to(d), torch.ones(8, device=d))
        T.lora_expand_(torch.zeros(40, 10, device=d), u, B, slot.to(d))
    q, k, v, bt, _ = _paged_case(3, 4, 2, 16, 8, [30, 30, 30], torch.float32, device=d)
    for ctx in ([30, 0, 9], [1, 2, 3]):
        T.paged_decode_attention(q, k, v, bt, torch.tensor(ctx, dtype=torch.int32, device=d), 8, 0.25)
    assert grids == [("shrink", (3, 1)), ("expand", (3, 1))] * 3 + [("decode", (3, 2))] * 2


# ------------------------------------------------------------------------------------ build


@pytest.mark.slow
@pytest.mark.skipif(T.triton is None or INTERPRETED, reason="needs triton in compiled mode")
def test_kernels_compile_for_sm90_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter checks semantics, not what the compiler accepts: compile every kernel
    ahead of time for an H100/H200 (sm_90) through ptxas, bf16 and fp32 (IEEE dots)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"no triton CUDA backend: {e}")
    consts = {"shrink": dict(BLOCK_N=16, BLOCK_R=32, BLOCK_K=64),
              "expand": dict(BLOCK_N=16, BLOCK_R=16, BLOCK_D=64),
              "decode": dict(GROUP=7, BLOCK_H=16, BLOCK_D=128, BLOCK_T=64, BLOCK_SIZE=16)}
    for dt, ieee in (("bf16", False), ("fp32", True)):
        ptrs = {"x_ptr": dt, "y_ptr": dt, "q_ptr": dt, "k_ptr": dt, "v_ptr": dt, "o_ptr": dt, "slot_ptr": "i32",
                "bt_ptr": "i32", "ctx_ptr": "i32"}
        for name, c in consts.items():
            fn = T._kernel(name)
            c = {**c, "F32_DOT": ieee}
            sig = {a: "constexpr" if a in c else "fp32" if a == "sm_scale" else
                   f"*{ptrs.get(a, 'fp32')}" if a.endswith("_ptr") else "i32" for a in fn.arg_names}
            kernel = triton.compile(ASTSource(fn, sig, c), target=GPUTarget("cuda", 90, 32))
            assert ("mma" in kernel.asm["ptx"]) == (dt == "bf16")  # tensor cores; fp32 IEEE: FMA


@pytest.mark.skipif(INTERPRETED, reason="not a kernel test")
def test_without_triton_imports_and_refuses_clearly() -> None:
    code = """
import sys
sys.modules["triton"] = None
sys.modules["triton.language"] = None
import torch
from opentinker.engine.model import triton_ops as T
assert T.triton is None and not T.available("cpu") and not T.available("cuda")
try:
    T.lora_shrink(torch.zeros(2, 4), torch.zeros(1, 2, 4), torch.zeros(2, dtype=torch.long), torch.ones(1))
except RuntimeError as e:
    assert "triton" in str(e) and "not installed" in str(e), e
else:
    raise AssertionError("no error")
u = T.lora_shrink_ref(torch.ones(2, 4), torch.ones(1, 2, 4), torch.tensor([0, -1]), torch.ones(1))
assert u.tolist() == [[4.0, 4.0], [0.0, 0.0]]
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.skipif(T.triton is None or INTERPRETED, reason="needs triton in compiled mode")
def test_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA is available with triton; CPU only through the interpreter, which must be chosen
    before triton is imported (this process imported it compiled)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert T.available("cuda") and not T.available("cpu")
    args = (torch.zeros(2, 4), torch.zeros(1, 2, 4), torch.zeros(2, dtype=torch.long), torch.ones(1))
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 before triton is imported"):
        T.lora_shrink(*args)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not T.available("cpu")
    with pytest.raises(RuntimeError, match="was set after triton was imported"):
        T.lora_shrink(*args)
