"""Batched device sampling (opentinker/engine/sampling.py): batch invariance, distributions,
log-probs, the hash, and input checks.

Distribution tests are chi-square goodness-of-fit tests at p = 0.001 (critical values in
``_CHI2_P001``). The draws are deterministic (fixed seeds), so a test passes or fails the same
way on every run; the threshold says how unlucky a correct sampler would have to be.
"""

from __future__ import annotations

import pytest
import torch

from opentinker.engine.sampling import _PREFIX, SamplingBatch, _unit, sample, truncate, uniforms
from protocols.messages import SamplingParams

_CHI2_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 15: 37.70}
"""Chi-square critical values at p = 0.001 by degrees of freedom."""
_SEEDS = [0, 1, -1, 2**63 - 1, 2**40 + 7, 123456789]
_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _reference_truncate(logits_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``_truncate`` from opentinker/sampler.py (today's per-row sampler), verbatim."""
    if top_k > 0 and top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    if top_p < 1.0:
        sorted_V, idx_V = torch.sort(logits_V, descending=True)
        cum_V = torch.softmax(sorted_V, -1).cumsum(-1)
        drop_V = cum_V - torch.softmax(sorted_V, -1) >= top_p
        logits_V = logits_V.masked_fill(torch.zeros_like(drop_V).scatter(0, idx_V, drop_V), float("-inf"))
    return logits_V


def _mixed_params(n: int, vocab: int, gen: torch.Generator) -> list[SamplingParams]:
    temps, ks, ps = [0.5, 1.0, 1.3], [0, 0, 1, 5, 50, vocab + 3], [1.0, 1.0, 0.3, 0.9, 0.99]
    pick = lambda xs: xs[int(torch.randint(len(xs), (), generator=gen))]  # noqa: E731
    return [SamplingParams(temperature=pick(temps), top_k=pick(ks), top_p=pick(ps))
            for _ in range(n)]


def _draw(logits_B_V: torch.Tensor, params: list[SamplingParams], seeds: list[int],
          positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = SamplingBatch.from_params(params, seeds, positions, logits_B_V.device)
    return batch.sample(logits_B_V)


def _chi2(counts_N: torch.Tensor, probs_N: torch.Tensor) -> float:
    expected_N = probs_N.double() * counts_N.sum()
    return float(((counts_N.double() - expected_N) ** 2 / expected_N).sum())


@pytest.mark.parametrize("tile", [0, 1000])
@pytest.mark.parametrize("device", _DEVICES)
def test_a_row_draws_the_same_alone_among_others_and_in_any_order(
        device: str, tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tile``: the noise drawn in vocabulary tiles of at most 1000 columns (5 tiles of 820
    here; 0: the default, one tile)."""
    gen = torch.Generator().manual_seed(0)
    B, V = 32, 4099  # odd V: rows straddle vector and thread-chunk boundaries differently
    if tile:
        import opentinker.engine.sampling as sampling_mod

        monkeypatch.setattr(sampling_mod, "_TILE", tile)
        assert len(sampling_mod._tiles(V)) == 5
    logits_B_V = (torch.randn(B, V, generator=gen) * 3).to(device)
    params = _mixed_params(B, V, gen)
    seeds = [_SEEDS[i % len(_SEEDS)] + 1000 * (i // len(_SEEDS)) for i in range(B)]
    positions = torch.randint(0, 5000, (B,), generator=gen).tolist()
    assert any(p.top_k == 0 and p.top_p == 1 for p in params)  # alone: the fast path
    tok_B, lp_B = _draw(logits_B_V, params, seeds, positions)

    for i in range(B):
        one = slice(i, i + 1)
        tok_1, lp_1 = _draw(logits_B_V[one], params[one], seeds[one], positions[one])
        assert tok_1.item() == tok_B[i].item()
        torch.testing.assert_close(lp_1[0], lp_B[i], rtol=0, atol=1e-6)
    for rows in (torch.randperm(B, generator=gen), torch.randperm(B, generator=gen)[:5],
                 torch.randperm(B, generator=gen)[:17]):
        r, rows = rows.tolist(), rows.to(device)
        tok_R, lp_R = _draw(logits_B_V[rows], [params[j] for j in r], [seeds[j] for j in r],
                            [positions[j] for j in r])
        assert torch.equal(tok_R, tok_B[rows])
        torch.testing.assert_close(lp_R, lp_B[rows], rtol=0, atol=1e-6)

    batch = SamplingBatch.from_params(params, seeds, positions, device)
    tok_S, lp_S = sample(logits_B_V, batch.temperature_B, batch.top_k_B, batch.top_p_B,
                         batch.seed_B, batch.position_B)
    assert torch.equal(tok_S, tok_B) and torch.equal(lp_S, lp_B)


def test_bf16_logits_are_batch_invariant_and_computed_in_float32() -> None:
    gen = torch.Generator().manual_seed(1)
    B, V = 32, 1000
    logits_B_V = (torch.randn(B, V, generator=gen) * 3).bfloat16()  # many exact ties
    params = _mixed_params(B, V, gen)
    tok_B, lp_B = _draw(logits_B_V, params, list(range(B)), [7] * B)
    tok_F, lp_F = _draw(logits_B_V.float(), params, list(range(B)), [7] * B)
    assert lp_B.dtype == torch.float32 and torch.equal(tok_B, tok_F) and torch.equal(lp_B, lp_F)
    for i in (0, 13, 31):
        tok_1, _ = _draw(logits_B_V[i:i + 1], params[i:i + 1], [i], [7])
        assert tok_1.item() == tok_B[i].item()


def test_a_row_joining_a_running_batch_draws_as_it_would_alone() -> None:
    gen = torch.Generator().manual_seed(2)
    V, steps, join = 1000, 12, 4
    logits_T_V = torch.zeros(steps, V)  # flat: every draw is a fresh uniform choice
    row = SamplingParams(temperature=1.0)
    alone = SamplingBatch.from_params([row], [42], [50], "cpu")
    solo_T = []
    for t in range(steps):
        solo_T.append(alone.sample(logits_T_V[t:t + 1])[0].item())
        alone = alone.advance()
    assert len(set(solo_T)) >= steps - 1  # positions advance, so draws differ

    others = _mixed_params(31, V, gen)
    running = SamplingBatch.from_params(others, list(range(100, 131)), list(range(31)), "cpu")
    for t in range(join):
        running.sample(torch.randn(31, V, generator=gen))
        running = running.advance()
    merged = SamplingBatch.from_params(
        others + [row], list(range(100, 131)) + [42],
        running.position_B.tolist() + [50], "cpu")
    for t in range(steps):
        logits_B_V = torch.cat([torch.randn(31, V, generator=gen), logits_T_V[t:t + 1]])
        assert merged.sample(logits_B_V)[0][-1].item() == solo_T[t]
        merged = merged.advance()


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_frequencies_match_the_tempered_softmax(temperature: float) -> None:
    N = 20_000
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])
    params = [SamplingParams(temperature=temperature)] * N
    tok_N, lp_N = _draw(logits_V.expand(N, -1), params, [2**40 + 3 * i for i in range(N)], [9] * N)
    logp_V = torch.log_softmax(logits_V / temperature, -1)
    assert _chi2(torch.bincount(tok_N, minlength=6), logp_V.exp()) < _CHI2_P001[5]
    torch.testing.assert_close(lp_N, logp_V[tok_N], rtol=1e-6, atol=1e-6)


def test_top_k_draws_only_the_top_k_at_their_renormalised_frequencies() -> None:
    N, k = 20_000, 3
    logits_V = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0, 1.5])
    params = [SamplingParams(top_k=k)] * N
    tok_N, lp_N = _draw(logits_V.expand(N, -1), params, list(range(N)), [0] * N)
    top_K = torch.tensor([1, 5, 3])
    counts_V = torch.bincount(tok_N, minlength=6)
    assert counts_V.sum() == counts_V[top_K].sum()
    assert _chi2(counts_V[top_K], torch.softmax(logits_V[top_K], -1)) < _CHI2_P001[k - 1]
    torch.testing.assert_close(lp_N, torch.log_softmax(logits_V, -1)[tok_N])  # pre-truncation


def test_top_p_draws_the_nucleus_with_its_crossing_token_at_renormalised_frequencies() -> None:
    N, top_p = 20_000, 0.8
    logits_V = torch.tensor([1.0, -0.5, 2.0, 0.2, -2.0, 1.2])
    probs_V = torch.softmax(logits_V, -1)
    nucleus = torch.isfinite(_reference_truncate(logits_V, 0, top_p)).nonzero()[:, 0]
    mass = probs_V[nucleus].sort().values  # ascending: mass[0] is the crossing token's
    assert mass[1:].sum() < top_p <= mass.sum() and 2 <= len(nucleus) < 6
    tok_N, lp_N = _draw(logits_V.expand(N, -1), [SamplingParams(top_p=top_p)] * N,
                        [-7 * i for i in range(N)], [3] * N)
    counts_V = torch.bincount(tok_N, minlength=6)
    assert counts_V.sum() == counts_V[nucleus].sum()
    chi2 = _chi2(counts_V[nucleus], probs_V[nucleus] / probs_V[nucleus].sum())
    assert chi2 < _CHI2_P001[len(nucleus) - 1]
    torch.testing.assert_close(lp_N, torch.log_softmax(logits_V, -1)[tok_N])


@pytest.mark.parametrize(("vocab", "large_k"), [(300, True), (3000, True), (3000, False)])
def test_truncated_sets_equal_todays_truncate_on_random_logits(vocab: int, large_k: bool) -> None:
    gen = torch.Generator().manual_seed(vocab)
    B = 96
    x_B_V = torch.randn(B, vocab, generator=gen) * torch.logspace(-1.5, 1, B)[:, None]
    ks = [0, 0, 1, 7, 100] + ([2000, vocab - 1, vocab, vocab + 5] if large_k else [])
    ps = [1.0, 0.05, 0.5, 0.9, 0.99, 0.999]
    top_k = [ks[i % len(ks)] for i in range(B)]
    top_p = [ps[(i // 3) % len(ps)] for i in range(B)]
    kept_B_V = torch.isfinite(truncate(x_B_V, torch.tensor(top_k), torch.tensor(top_p),
                                       max(top_k), True))
    ref_B_V = torch.stack([torch.isfinite(_reference_truncate(x_B_V[i], top_k[i], top_p[i]))
                           for i in range(B)])
    assert torch.equal(kept_B_V, ref_B_V)
    if vocab > _PREFIX and not large_k:  # both the prefix and the full-sort fallback ran
        sizes = [int(ref_B_V[i].sum()) for i in range(B) if top_p[i] < 1]
        assert min(sizes) < _PREFIX < max(sizes)


def test_log_probs_are_the_pre_truncation_tempered_log_softmax_at_the_drawn_tokens() -> None:
    gen = torch.Generator().manual_seed(3)
    B, V = 64, 500
    logits_B_V = torch.randn(B, V, generator=gen) * 4
    params = _mixed_params(B, V, gen)
    tok_B, lp_B = _draw(logits_B_V, params, list(range(B)), list(range(B)))
    T_B = torch.tensor([p.temperature for p in params])
    ref_B = torch.log_softmax(logits_B_V / T_B[:, None], -1).gather(1, tok_B[:, None])[:, 0]
    assert tok_B.dtype == torch.int64 and lp_B.dtype == torch.float32
    torch.testing.assert_close(lp_B, ref_B, rtol=1e-6, atol=1e-6)
    greedy = [i for i, p in enumerate(params) if p.top_k == 1]
    assert greedy and torch.equal(tok_B[greedy], logits_B_V[greedy].argmax(-1))


def test_uniforms_are_in_the_open_unit_interval_and_streams_are_uncorrelated() -> None:
    N = 100_000
    seed_N = torch.arange(N) * 2654435761 - 2**62
    u_N_4 = uniforms(seed_N, torch.zeros(N, dtype=torch.int64), 4)
    assert 0 < u_N_4.min() and u_N_4.max() < 1
    extremes = _unit(torch.tensor([0, 2**32 - 1]))
    assert 0 < extremes[0] < 1e-6 and 1 - 1e-6 < extremes[1] < 1
    assert abs(u_N_4.mean().item() - 0.5) < 0.005 and abs(u_N_4.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u_N_4, bins=16, min=0, max=1)
    assert _chi2(hist, torch.full((16,), 1 / 16)) < _CHI2_P001[15]

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()

    seq_N = torch.arange(N)
    zero_N = torch.zeros(N, dtype=torch.int64)
    u_seq = uniforms(seq_N, zero_N, 1)[:, 0]
    row_V = uniforms(seq_N[:1], zero_N[:1], N + 1)[0]
    streams = {
        "adjacent seeds": (u_seq[:-1], u_seq[1:]),
        "adjacent vocabulary ids": (u_N_4[:, 0], u_N_4[:, 1]),
        "adjacent positions": (u_seq, uniforms(seq_N, zero_N + 1, 1)[:, 0]),
        "seeds 2**32 apart": (u_seq, uniforms(seq_N + 2**32, zero_N, 1)[:, 0]),
        "positions 2**32 apart": (u_seq, uniforms(seq_N, zero_N + 2**32, 1)[:, 0]),
        "one row along the vocabulary": (row_V[:-1], row_V[1:]),
    }
    for name, (a, b) in streams.items():
        assert abs(corr(a, b)) < 0.02, name
        assert (a == b).float().mean() < 1e-3, name


def test_seeds_wrap_mod_2_pow_64() -> None:
    logits_B_V = torch.randn(3, 50)
    params = [SamplingParams()] * 3
    wrapped = _draw(logits_B_V, params, [2**64 + 5, 2**64 - 1, -(2**63)], [1, 1, 1])
    plain = _draw(logits_B_V, params, [5, -1, 2**63], [1, 1, 1])
    assert torch.equal(wrapped[0], plain[0])


def _rows(B: int = 4) -> dict[str, torch.Tensor]:
    return {"temperature_B": torch.ones(B), "top_k_B": torch.zeros(B, dtype=torch.int64),
            "top_p_B": torch.ones(B), "seed_B": torch.arange(B),
            "position_B": torch.zeros(B, dtype=torch.int64)}


@pytest.mark.parametrize(("field", "value"), [
    ("temperature_B", torch.tensor([1.0, 0.0, 1.0, 1.0])),
    ("temperature_B", torch.tensor([1.0, -1.0, 1.0, float("nan")])),
    ("top_p_B", torch.tensor([1.0, 0.0, 1.0, 1.0])),
    ("top_p_B", torch.tensor([1.0, 1.5, 1.0, 1.0])),
    ("top_k_B", torch.tensor([0, -1, 0, 0])),
    ("position_B", torch.tensor([0, -1, 0, 0])),
    ("seed_B", torch.arange(5)),
    ("top_p_B", torch.ones(4, 1)),
    ("temperature_B", torch.ones(4, dtype=torch.int64)),
    ("seed_B", torch.ones(4)),
])
def test_bad_rows_raise_value_error_naming_the_field(field: str, value: torch.Tensor) -> None:
    rows = _rows() | {field: value}
    with pytest.raises(ValueError, match=field):
        sample(torch.randn(4, 10), **rows)


def test_bad_logits_and_params_raise_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="logits_B_V"):
        sample(torch.randn(10), **_rows(10))
    for bad, field in [(SamplingParams(temperature=0.0), "temperature"),
                       (SamplingParams(top_p=1.5), "top_p"), (SamplingParams(top_p=0.0), "top_p"),
                       (SamplingParams(top_k=-2), "top_k")]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingBatch.from_params([SamplingParams(), bad], [0, 1], [0, 0], "cpu")
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatch.from_params([SamplingParams()] * 2, [0], [0, 0], "cpu")
    with pytest.raises(ValueError, match="positions"):
        SamplingBatch.from_params([SamplingParams()], [0], [-1], "cpu")
    with pytest.raises(ValueError, match="logits_B_V"):  # would broadcast one row to two
        SamplingBatch.from_params([SamplingParams()] * 2, [0, 1], [0, 0], "cpu").sample(
            torch.randn(1, 10))
