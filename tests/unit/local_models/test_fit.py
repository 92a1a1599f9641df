"""local_models/fit.py: the shared fitting routine of the generated models, on a model small enough to train in
milliseconds (the real fits run in test_fit_paths.py)."""

from __future__ import annotations

import pytest
import torch

from local_models.fit import FitError, Recipe, fit, margin_loss, margins


class Table(torch.nn.Module):
    """Logits read from a table: position i of every sequence predicts table[i]."""

    def __init__(self, positions: int, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(positions, vocab))

    def forward(self) -> torch.Tensor:
        return self.table[None]


def test_margins_are_the_target_logit_over_the_best_rival() -> None:
    logits = torch.tensor([[[1.0, 4.0, 2.0], [0.0, 0.0, 5.0]]])
    got = margins(logits, torch.tensor([[1, -100]]))
    assert got[0, 0] == 2.0 and got[0, 1] == float("inf")
    assert margins(logits, torch.tensor([[0, 1]])).tolist() == [[-3.0, -5.0]]


def test_the_hinge_pushes_only_the_tokens_short_of_the_margin() -> None:
    recipe = Recipe(lr=0.1, max_steps=1, hinge=3.5)
    logits = torch.tensor([[[9.0, 0.0], [1.0, 0.0]]], requires_grad=True)
    margin_loss(logits, torch.tensor([[0, 0]]), recipe).backward()
    ce_only = torch.tensor([[[9.0, 0.0], [1.0, 0.0]]], requires_grad=True)
    margin_loss(ce_only, torch.tensor([[0, 0]]), Recipe(lr=0.1, max_steps=1, hinge_weight=0.0)).backward()
    extra = logits.grad - ce_only.grad
    assert extra[0, 0].abs().max() == 0  # margin 9: past the hinge
    assert extra[0, 1].tolist() == [-1.0, 1.0]  # margin 1: pushed up by the hinge's full slope


def test_a_fit_stops_once_every_target_clears_the_margin() -> None:
    model = Table(4, 8)
    targets = torch.tensor([[3, 1, 4, 1]])
    recipe = Recipe(lr=0.1, max_steps=300, check_every=5, warmup=5)
    report = fit(
        "table",
        model,
        lambda _s: margin_loss(model(), targets, recipe),
        lambda: float(margins(model(), targets).min()),
        recipe,
        reproduce="(none)",
    )
    assert report["attempt"] == 1 and report["steps"] % 5 == 0 and report["margin"] >= 3.0
    assert float(margins(model(), targets).min().detach()) == pytest.approx(report["margin"], abs=0.01)
    assert "CPU capability" in report["capability"]


def test_a_fit_that_cannot_converge_restarts_then_raises_one_clear_error() -> None:
    model = Table(1, 4)
    # Two sequences that need different tokens from the same logits: no fit exists.
    targets = torch.tensor([[0], [1]])
    starts: list[float] = []

    def loss(step: int) -> torch.Tensor:
        if step == 1:
            starts.append(float(model.table.abs().sum()))
        return margin_loss(model().expand(2, 1, 4), targets, recipe)

    recipe = Recipe(lr=0.05, max_steps=20, check_every=10, warmup=2, attempts=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # (so that the fit's one thread differs from it on any machine)
    with pytest.raises(FitError) as failed:
        fit(
            "local:contradiction",
            model,
            loss,
            lambda: float(margins(model().expand(2, 1, 4), targets).min()),
            recipe,
            reproduce="python -m make_it --force",
        )
    assert starts == [0.0, 0.0, 0.0]  # every attempt from the initial weights
    message = str(failed.value)
    assert "local:contradiction did not fit" in message and "after 3 attempts of 20 steps" in message
    assert "at best" in message
    assert "CPU capability" in message and message.endswith("Reproduce: python -m make_it --force")
    assert torch.get_num_threads() == 3  # (the fit's one thread is given back)
    torch.set_num_threads(threads)
