"""The shape of a draw (opentinker/engine/sampling.py): ATen ops independent of the batch size,
tokens bitwise equal to a full-row Gumbel argmax (ties to the lower id), bounded scratch, and
the fused Triton kernel equal to the torch path (under ``TRITON_INTERPRET=1`` here; on a GPU
the CUDA tests compare the compiled kernel and capture a draw in a CUDA graph).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import opentinker.engine.sampling as sampling
from opentinker.engine.sampling import draw, truncate, uniforms

_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
_SYNC_OPS = ("_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal")
"""ATen ops that read a device value back to the host."""


class _CountOps(TorchDispatchMode):
    """Counts the ATen ops dispatched inside the ``with`` block, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _rows(B: int, V: int, device: str, seed: int) -> list[torch.Tensor]:
    """``(logits, temperature, top_k, top_p, seed, position)`` of B random rows."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(B, V, generator=gen) * 3, torch.rand(B, generator=gen) + 0.5,
               torch.randint(1, 60, (B,), generator=gen), torch.ones(B),
               torch.randint(-2**62, 2**62, (B,), generator=gen),
               torch.randint(0, 10**6, (B,), generator=gen)]
    return [t.to(device) for t in tensors]


def _gumbel(seed_B: torch.Tensor, position_B: torch.Tensor, V: int) -> torch.Tensor:
    """``g = -log(-log(u))`` over the whole row, as the sampler defines its noise."""
    return uniforms(seed_B, position_B, V).log().neg().log().neg()


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("top_k", [0, 50])
@pytest.mark.parametrize("vocab", [151_936, 49_152])
def test_a_draw_dispatches_the_same_ops_for_any_batch_size(
        vocab: int, top_k: int, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain path (and top-k) launch the same ATen ops for 4 rows and for 64; the plain
    path reads nothing back to the host, and the row keys are hashed once per draw."""
    key_calls = []
    row_keys = sampling._row_keys

    def counting_row_keys(seed_B: torch.Tensor, position_B: torch.Tensor) -> torch.Tensor:
        key_calls.append(seed_B.shape[0])
        return row_keys(seed_B, position_B)

    monkeypatch.setattr(sampling, "_row_keys", counting_row_keys)
    ops = {}
    for B in (4, 64):
        logits, temp, k, p, seed, pos = _rows(B, vocab, device, seed=B)
        k = k if top_k else torch.zeros_like(k)
        draw(logits, temp, k, p, seed, pos, top_k, False)  # fills the per-(V, device) caches
        key_calls.clear()
        with _CountOps() as count:
            draw(logits, temp, k, p, seed, pos, top_k, False)
        assert key_calls == [B]
        ops[B] = count.ops
        # The fused op's own ops (its CPU composite: row keys, noise and argmax in tiles).
        empty = logits.new_empty(0)
        with _CountOps() as inner:
            sampling._gumbel_max(logits, temp.float(), seed, pos, empty, empty)
        ops[(B, "fused")] = inner.ops
    assert ops[4]["opentinker.gumbel_max.default"] == 1  # noise and argmax: one op (one kernel on CUDA)
    assert sum(ops[(4, "fused")].values()) > 20  # the mode saw the composite
    assert ops[4] == ops[64], (sum(ops[4].values()), sum(ops[64].values()))
    assert ops[(4, "fused")] == ops[(64, "fused")]
    if not top_k:
        assert not [op for op in ops[4] if any(s in op for s in _SYNC_OPS)], ops[4]


@pytest.mark.parametrize(("vocab", "tile"), [(151_936, 0), (4099, 1000)])
def test_tokens_are_the_full_row_argmax_with_ties_to_the_lower_id(
        vocab: int, tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens equal ``argmax(x + g)`` over the whole row, computed here, on random rows and on
    rows built to tie exactly (``x = -g`` gives ``x + g = 0``) within a tile and across tiles.
    ``tile``: columns per tile (0: the default, 10 tiles at 151,936)."""
    if tile:
        monkeypatch.setattr(sampling, "_TILE", tile)
    tiles = sampling._tiles(vocab)
    assert len(tiles) >= 5
    gen = torch.Generator().manual_seed(vocab)
    B = 10
    seed_B = torch.randint(-2**62, 2**62, (B,), generator=gen)
    position_B = torch.randint(0, 10**6, (B,), generator=gen)
    temperature_B = torch.ones(B)
    temperature_B[:3] = torch.tensor([0.6, 1.0, 1.7])
    g_B_V = _gumbel(seed_B, position_B, vocab)
    logits_B_V = torch.randn(B, vocab, generator=gen) * 4
    first, second = tiles[1][0] + 7, tiles[3][0] + 2  # in different tiles
    near, far = tiles[2][0] + 3, tiles[2][0] + 11  # in one tile
    logits_B_V[3] = -g_B_V[3]  # every id ties at 0: the first one wins
    logits_B_V[4] = -g_B_V[4] - 1
    logits_B_V[4, [second, first]] = -g_B_V[4, [second, first]]
    logits_B_V[5] = -g_B_V[5] - 1
    logits_B_V[5, [far, near]] = -g_B_V[5, [far, near]]
    logits_B_V[6] = -g_B_V[6] - 1
    logits_B_V[6, [tiles[0][0], tiles[-1][1] - 1]] = -g_B_V[6, [tiles[0][0], tiles[-1][1] - 1]]
    logits_B_V[7, : tiles[-1][0]] = float("-inf")  # only the last tile is finite
    logits_B_V[8, [far, second]] = float("nan")  # argmax takes the first NaN
    logits_B_V[9] = float("-inf")  # argmax of nothing but -inf: id 0

    x_B_V = logits_B_V / temperature_B[:, None]
    ref_B = (x_B_V + g_B_V).argmax(-1)
    assert ref_B[3:7].tolist() == [0, first, near, 0] and ref_B[8:].tolist() == [far, 0]
    tokens_B, logprobs_B = draw(logits_B_V, temperature_B, torch.zeros(B, dtype=torch.int64),
                                torch.ones(B), seed_B, position_B, 0, False)
    assert torch.equal(tokens_B, ref_B)
    ref_lp_B = torch.log_softmax(x_B_V.double(), -1).gather(1, ref_B[:, None])[:, 0]
    torch.testing.assert_close(logprobs_B[:8].double(), ref_lp_B[:8], rtol=1e-6, atol=4e-6)
    assert logprobs_B[8:].isnan().all()

    # a top-k draw takes the same argmax over the truncated row
    top_k_B = torch.full((B,), 5)
    kept_B_V = truncate(x_B_V, top_k_B, torch.ones(B), 5, False)
    tokens_B, _ = draw(logits_B_V, temperature_B, top_k_B, torch.ones(B), seed_B, position_B,
                       5, False)
    assert torch.equal(tokens_B[:8], (kept_B_V + g_B_V).argmax(-1)[:8])


def test_a_plain_draw_holds_at_most_64_mib_of_scratch_at_256_rows_of_151936() -> None:
    """Peak bytes the CPU allocator holds during a draw beyond its inputs (the profiler's
    allocation events, summed in time order): 16 bytes an element of one tile of 256 rows."""
    from torch.profiler import ProfilerActivity, profile

    B, V = 256, 151_936
    logits_B_V = torch.rand(B, V) * 10
    rows = (torch.ones(B), torch.zeros(B, dtype=torch.int64), torch.ones(B), torch.arange(B),
            torch.arange(B))
    draw(logits_B_V, *rows, 0, False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        draw(logits_B_V, *rows, 0, False)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    assert len(events) > 20
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    width = max(c1 - c0 for c0, c1 in sampling._tiles(V))
    assert 16 * B * width <= peak <= 64 * 2**20, peak / 2**20


_INTERPRETED = """
import torch
import opentinker.engine.sampling as sampling
from opentinker.engine.sampling import truncate

sampling._CHUNK, sampling._BLOCK = 1024, 256  # rows span several chunks
gen = torch.Generator().manual_seed(7)
B, V = 6, 3001  # 3 chunks of 1024, the last one partial
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    logits_B_V = (torch.randn(B, V, generator=gen) * 4).to(dtype)
    logits_B_V[0, :2100] = float("-inf")
    logits_B_V[1] = float("-inf")
    temperature_B = torch.rand(B, generator=gen) + 0.3
    keys_B = sampling._row_keys(torch.randint(-2**62, 2**62, (B,), generator=gen),
                                torch.randint(0, 10**6, (B,), generator=gen))
    x_B_V = sampling._tempered(logits_B_V, temperature_B[:, None])
    kept_B_V = truncate(x_B_V, torch.full((B,), 40), torch.full((B,), 0.9), 40, True)
    for x, kept in ((None, None), (x_B_V, kept_B_V)):
        tok_F, lse_F = sampling._gumbel_max_fused(logits_B_V, temperature_B, keys_B, kept)
        tok_T, lse_T = sampling._gumbel_max_torch(logits_B_V, temperature_B[:, None],
                                                  keys_B[:, None], x, kept)
        assert torch.equal(tok_F, tok_T), (dtype, kept is None, tok_F, tok_T)
        assert tok_F[0] >= 2100 and tok_F[1] == 0, tok_F
        torch.testing.assert_close(lse_F, lse_T, rtol=1e-6, atol=1e-6)
print("fused == torch")
"""


def test_the_fused_kernel_draws_what_the_torch_path_draws_under_the_interpreter() -> None:
    """Same tokens and log-sum-exps on random fp32/bf16/fp16 rows (numpy's log stands in for
    CUDA's, so only near-ties could differ), a row finite in its last chunk only, and a row of
    -inf; plain and truncated (top-k + top-p). In a child process: ``TRITON_INTERPRET`` must be
    set before triton is imported."""
    if sampling.triton is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0 and "fused == torch" in run.stdout, run.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_the_compiled_kernel_is_bitwise_the_torch_cuda_path(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: the fused kernel's noise is the torch CUDA path's to the bit (with ``x = -g``
    every id ties at 0, so one ulp of difference in ``g`` anywhere moves the token off 0), and
    it draws the same tokens on random rows."""
    if sampling.triton is None:
        pytest.skip("triton is not installed")
    B, V = 64, 151_936
    logits, temp, _, _, seed, pos = _rows(B, V, "cuda", seed=3)
    logits = logits.to(dtype)
    keys_B = sampling._row_keys(seed, pos)
    tok_F, lse_F = sampling._gumbel_max_fused(logits, temp, keys_B, None)
    tok_T, lse_T = sampling._gumbel_max_torch(logits, temp[:, None], keys_B[:, None], None, None)
    assert torch.equal(tok_F, tok_T)
    torch.testing.assert_close(lse_F, lse_T, rtol=1e-6, atol=1e-5)
    minus_g = _gumbel(seed, pos, V).neg()
    tok_F, _ = sampling._gumbel_max_fused(minus_g, torch.ones(B, device="cuda"), keys_B, None)
    assert tok_F.eq(0).all(), tok_F


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [True, False])
def test_cuda_a_plain_draw_replays_from_a_cuda_graph(
        fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain path captured once replays with new logits and positions as eager draws."""
    if fused and sampling.triton is None:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(sampling, "_FUSED_ON_CUDA", fused)
    B, V = 16, 49_152
    logits, temp, _, top_p, seed, pos = _rows(B, V, "cuda", seed=5)
    top_k = torch.zeros_like(pos)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        draw(logits, temp, top_k, top_p, seed, pos, 0, False)  # compile, fill the caches
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tok_B, lp_B = draw(logits, temp, top_k, top_p, seed, pos, 0, False)
    for step in range(3):
        logits.copy_(torch.randn(B, V, device="cuda") * 3)
        pos.add_(1)
        graph.replay()
        ref_tok, ref_lp = draw(logits, temp, top_k, top_p, seed, pos, 0, False)
        assert torch.equal(tok_B, ref_tok), step
        torch.testing.assert_close(lp_B, ref_lp, rtol=0, atol=0)
