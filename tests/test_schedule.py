"""The loop's arithmetic, without ranks: when early stopping ends a run, when the plateau
schedule halves the lr, and the lr of each step through Horovod's warm-up."""

from __future__ import annotations

from itertools import pairwise

import pytest

from hvd_cpu.training.schedule import scaled_lr, scheduled_lr
from hvd_cpu.training.state import LoopState

FLAT = [1.0] * 30  # a validation loss that never improves after the first epoch


def decide(
    losses: list[float],
    epochs: int,
    patience: int | None = None,
    plateau_patience: int | None = None,
) -> tuple[LoopState, list[float]]:
    """The decisions of Job.run over one validation loss per epoch: the state at the end and
    the lr factor each epoch ran with."""
    state, factors = LoopState(), []
    while not state.finished(epochs, patience):
        epoch = state.epoch + 1
        factors.append(state.lr_factor)
        state.validated(losses[epoch - 1], epoch, plateau_patience)
        state.epoch = epoch
    return state, factors


# early stopping


@pytest.mark.parametrize("best", [1, 3, 6])
@pytest.mark.parametrize("patience", [1, 2, 4])
def test_a_run_stops_exactly_patience_epochs_after_its_best(best: int, patience: int) -> None:
    losses = [10.0 - epoch for epoch in range(1, best + 1)] + [9.5] * 20  # worse, then equal
    state, _ = decide(losses, epochs=60, patience=patience)
    assert state.best_epoch == best
    assert state.best_val_loss == 10.0 - best
    assert state.epoch == best + patience


def test_a_loss_equal_to_the_best_is_no_improvement() -> None:
    state, _ = decide([2.0, 2.0, 2.0, 1.0], epochs=10, patience=2)
    assert (state.epoch, state.best_epoch) == (3, 1)


def test_an_improvement_starts_the_count_again() -> None:
    losses = [3.0, 4.0, 2.9, 4.0, 2.8, 4.0, 4.0, 2.0]
    state, _ = decide(losses, epochs=10, patience=2)
    assert (state.epoch, state.best_epoch, state.since_best) == (7, 5, 2)


def test_without_patience_a_run_that_never_improves_runs_every_epoch() -> None:
    worse = [float(epoch) for epoch in range(1, 21)]
    state, _ = decide(worse, epochs=20)
    assert (state.epoch, state.best_epoch, state.since_best) == (20, 1, 19)


def test_epochs_end_a_run_that_is_still_improving() -> None:
    better = [1.0 / epoch for epoch in range(1, 11)]
    state, _ = decide(better, epochs=5, patience=2)
    assert (state.epoch, state.best_epoch, state.since_best) == (5, 5, 0)


def test_a_resumed_state_that_is_out_of_patience_runs_no_more_epochs() -> None:
    # A checkpoint is written after the epoch that ran out of patience; --resume with more
    # --epochs must not go on from it.
    state = LoopState(epoch=7, best_epoch=4, since_best=3)
    assert state.finished(epochs=20, patience=3)
    assert not state.finished(epochs=20, patience=4)


# the plateau schedule


def test_the_lr_halves_after_each_plateau_patience_epochs_without_progress() -> None:
    state, factors = decide(FLAT, epochs=9, plateau_patience=2)
    assert factors == [1, 1, 1, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125]
    assert state.lr_factor == 0.0625  # halved after the last epoch: none ran with it


def test_an_improvement_restarts_the_plateau_count_but_keeps_the_lower_lr() -> None:
    losses = [1.0, 2.0, 2.0, 0.5, 2.0, 0.4, 2.0, 2.0, 2.0]
    _, factors = decide(losses, epochs=9, plateau_patience=2)
    # halved after epoch 3; epochs 4 and 6 improve in time; halved again after epoch 8
    assert factors == [1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25]


def test_halving_the_lr_does_not_reset_the_patience_of_early_stopping() -> None:
    state, factors = decide(FLAT, epochs=60, patience=5, plateau_patience=2)
    assert state.epoch == 6  # best at epoch 1, five epochs without progress, two halvings
    assert factors == [1, 1, 1, 0.5, 0.5, 0.25]


def test_without_plateau_patience_the_lr_never_changes() -> None:
    state, factors = decide(FLAT, epochs=20)
    assert factors == [1] * 20 and state.lr_factor == 1


# the lr of each step


@pytest.mark.parametrize(
    ("world_size", "scale_lr", "global_batch_steps", "peak"),
    [
        (1, True, True, 0.01),
        (4, True, True, 0.04),
        (4, False, True, 0.01),  # --no-scale-lr
        (4, True, False, 0.01),  # --sync-every K > 1: each step sees one rank's batch
    ],
)
def test_the_lr_scales_with_the_global_batch_only(
    world_size: int, scale_lr: bool, global_batch_steps: bool, peak: float
) -> None:
    assert scaled_lr(0.01, world_size, scale_lr, global_batch_steps) == pytest.approx(peak)


def test_warmup_rises_linearly_from_lr_to_the_peak_then_stays_flat() -> None:
    lr, peak, steps = 0.01, 0.04, 30
    lrs = [scheduled_lr(lr, peak, step, steps, factor=1.0) for step in range(2 * steps)]
    assert lrs[0] == lr
    assert lrs[steps // 3] == pytest.approx(0.02)
    rises = [later - earlier for earlier, later in pairwise(lrs[: steps + 1])]
    assert rises == pytest.approx([(peak - lr) / steps] * steps)
    assert lrs[steps:] == [peak] * steps


def test_no_warmup_starts_at_the_peak() -> None:
    assert scheduled_lr(0.01, 0.04, step=0, warmup_steps=0, factor=1.0) == 0.04


def test_an_unscaled_lr_is_flat_through_the_warmup() -> None:
    lrs = [scheduled_lr(0.01, 0.01, step, warmup_steps=10, factor=1.0) for step in range(20)]
    assert lrs == pytest.approx([0.01] * 20)


def test_the_plateau_factor_scales_the_lr_during_and_after_warmup() -> None:
    for step in (0, 5, 10, 50):
        full = scheduled_lr(0.01, 0.04, step, warmup_steps=10, factor=1.0)
        assert scheduled_lr(0.01, 0.04, step, warmup_steps=10, factor=0.25) == full * 0.25
