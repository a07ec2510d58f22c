"""Adam's sampled numbers per parameter (``adam`` of ``modules[]``), against the
formulas worked out element by element in f64: with every parameter at the same step
count (the bias corrections taken as two numbers) and with counts that differ (a
parameter that missed steps), rows never updated, rows whose second moment is
negligible beside the parameter's largest, and ε both below and above the gradients'
scale."""

from __future__ import annotations

import pytest
import torch

from gradflow.measurement import adam_state


def by_hand(m, v, steps, lengths, b1, b2, eps):
    rows = []
    for mm, vv, t in zip(m.double().split(lengths), v.double().split(lengths), steps.tolist()):
        v_hat = vv / (1 - b2**t)
        root = v_hat.sqrt()
        updated = vv > 0
        u = torch.where(updated, (mm / (1 - b1**t)) / (root + eps), torch.zeros_like(mm))
        carrying = updated & (root >= root.max() * adam_state.CARRIES)
        rows.append(
            [
                (u * u).sum().item(),
                u.abs().max().item(),
                updated.sum().item(),
                (carrying & (v_hat < eps * eps)).sum().item(),
                carrying.sum().item(),
            ]
        )
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("steps", [[3, 3, 3, 3, 3], [1, 2, 3, 40, 7]], ids=["same", "mixed"])
@pytest.mark.parametrize("eps", [1e-8, 1e-4, 1e-3])
def test_each_parameter_gets_the_numbers_of_its_own_moments(steps, eps):
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 300, 1, 64, 2000]
    n = sum(lengths)
    m = torch.randn(n, generator=generator) * 1e-3
    v = torch.rand(n, generator=generator) ** 4 * 1e-6
    v[10:40] = 0  # rows never updated: no moment at all
    m[10:40] = 0
    v[100:110] = 1e-20  # far below CARRIES of the parameter's largest: carry nothing
    counts = torch.tensor(steps, dtype=torch.float32)
    got = adam_state._stats(m.clone(), v.clone(), counts, lengths, 0.9, 0.999, eps)
    want = by_hand(m, v, counts, lengths, 0.9, 0.999, eps)
    got = got.double().view(len(lengths), adam_state.WIDTH)
    assert torch.allclose(got, want, rtol=1e-4), (got, want)
    assert got[1, 2].item() == 300 - 30, "rows with v = 0 are not updated"
    assert got[1, 4].item() <= 300 - 30 - 10, "negligible rows carry none of the gradient"
    if eps >= 1e-3:
        assert got[:, 3].sum().item() > 0, "an ε above the gradients' scale puts rows below it"
