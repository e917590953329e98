"""The save-and-resume exercise gives each kind of mistake its own hint."""

import numpy as np
import pytest
import torch

from helpers.exercises.resuming import check_training_checkpoint


class WithoutOptimizer:
    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save(
            {
                "model": model.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "epoch": epoch,
                "position": position,
            },
            path,
        )

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        return state["epoch"], state["position"]


class WithoutRandomState:
    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "position": position,
            },
            path,
        )

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        return state["epoch"], state["position"]


class WithoutScheduler:
    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "epoch": epoch,
                "position": position,
            },
            path,
        )

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        return state["epoch"], state["position"]


class RestartingTheEpoch:
    """Saves everything but resumes at the start of the epoch it stopped in (fine only at an epoch boundary)."""

    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "epoch": epoch,
            },
            path,
        )

    def resume(self, path, model, optimizer, scheduler):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        return state["epoch"], 0


class WithNumpyArrays(WithoutRandomState):
    """Saves numpy's random state as numpy returns it: an array that weights_only=True refuses."""

    def save(self, path, model, optimizer, scheduler, *, epoch, position):
        torch.save({"model": model.state_dict(), "numpy": np.random.get_state(), "epoch": epoch}, path)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (WithoutOptimizer, "the optimizer state was not restored"),
        (WithoutRandomState, "the random state was not restored"),
        (WithoutScheduler, "the scheduler was not restored"),
        (RestartingTheEpoch, r"resume returned \(1, 0\).*the place in the data"),
        (WithNumpyArrays, "does not load with torch.load.path, weights_only=True."),
    ],
)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_training_checkpoint(wrong)
