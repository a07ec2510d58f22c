"""Per-parameter reductions of the flat vectors the update checks build: each
parameter's own numbers, whatever its neighbours hold, exact counts past 2**24, and a
rank that holds no element of a parameter."""

from __future__ import annotations

import math

import torch

from gradflow.measurement import intended


def by_hand(upd, before, after, lengths):
    rows = []
    for u, b, a in zip(upd.split(lengths), before.split(lengths), after.split(lengths)):
        if u.numel() == 0:
            rows.append([0.0, 0.0, 0.0, 0.0])
            continue
        ratio = (u.abs() / intended.ulp(b, torch.bfloat16)).max().item()
        if not torch.isfinite(u).all():
            ratio = math.nan
        nonzero = u != 0
        rows.append(
            [
                (u * u).sum().item(),
                ratio,
                nonzero.sum().item(),
                (nonzero & (a == b)).sum().item(),
            ]
        )
    return torch.tensor(rows, dtype=torch.float64)


def test_each_parameter_gets_its_own_sums_maxima_and_counts():
    torch.manual_seed(0)
    lengths = [5, 300, 0, 7, 1, 64]
    n = sum(lengths)
    before = torch.randn(n).bfloat16().float()
    upd = torch.randn(n) * 1e-3
    upd[::3] = 0  # updates that are exactly zero are not counted
    upd[100] = float("nan")  # the second parameter's update is not finite
    after = (before + upd).bfloat16().float()
    got = intended.summary(upd, before, after, torch.bfloat16, lengths, len(lengths))
    want = by_hand(upd, before, after, lengths)
    assert got.shape == (len(lengths), 4)
    assert torch.allclose(got.double(), want, rtol=1e-5, equal_nan=True), (got, want)
    assert math.isnan(got[1, 1].item()), "a NaN update is never hidden by the maximum"
    assert got[2].tolist() == [0.0, 0.0, 0.0, 0.0], "no element held: nothing to count"


def test_counts_stay_exact_past_two_to_the_24():
    big = (1 << 24) + 5
    mask = torch.ones(big, dtype=torch.bool)
    mask[:2] = False
    counts = intended.segment_counts(mask, [big, 0])
    assert counts.tolist() == [big - 2, 0]
    assert counts.dtype == torch.float64
