"""Checkpoints across torch releases: a file written by the floor torch resumes on the newest, and one written by
the newest resumes on the floor (CI runs this module in both environments, on the files in tests/data/), with
weights_only=True; a file that cannot be used says which release wrote it and which reads it.

Each file holds a tiny GPT and its AdamW after two steps, and, in `extra`, the loss and weights of the third step
as the writing release computed them: the reading release must take the same third step. Write this release's file:
`python tests/test_checkpoint_releases.py` (from the project folder)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from helpers.gpt import GPT, GPTConfig, optimizer_groups

DATA = Path(__file__).resolve().parent / "data"
FILES = sorted(DATA.glob("gpt-checkpoint-torch-*.pt"))
CONFIG = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)


def fresh() -> tuple[GPT, torch.optim.Optimizer]:
    """The tiny GPT and its AdamW (weight decay on the matrices, as the capstone's script builds it)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return model, torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))


def step(model: GPT, optimizer: torch.optim.Optimizer, seed: int) -> float:
    """One AdamW step on a batch drawn from `seed`; the loss."""
    tokens = torch.randint(0, 256, (4, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(seed))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def write(folder: Path = DATA) -> Path:
    """This release's file: the state after two steps, and the third step as this release takes it."""
    model, optimizer = fresh()
    step(model, optimizer, 1), step(model, optimizer, 2)
    state = copy.deepcopy((model.state_dict(), optimizer.state_dict()))  # state_dict() holds the live tensors
    third_loss = step(model, optimizer, 3)
    third = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    model.load_state_dict(state[0])
    optimizer.load_state_dict(state[1])
    release = torch.__version__.split("+")[0]
    path = folder / f"gpt-checkpoint-torch-{release}.pt"
    return save_checkpoint(path, model, optimizer, step=2, extra={"third_loss": third_loss, "third_weights": third})


def test_both_ends_of_the_supported_releases_have_a_file():
    releases = [path.stem.removeprefix("gpt-checkpoint-torch-") for path in FILES]
    assert "2.6.0" in releases, releases  # the floor, pyproject.toml's torch>=2.6
    assert len(releases) >= 2, releases  # and a newer one


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem.removeprefix("gpt-checkpoint-"))
def test_a_checkpoint_of_another_release_resumes_and_takes_the_same_next_step(path, one_thread):
    model, optimizer = fresh()
    loaded = load_checkpoint(path, model, optimizer, restore_rng=False)  # torch.load(weights_only=True)
    assert loaded["step"] == 2 and loaded["torch"].startswith(path.stem.removeprefix("gpt-checkpoint-torch-"))
    if "decoupled_weight_decay" in fresh()[1].param_groups[0]:  # a key newer releases added to AdamW's groups
        assert optimizer.param_groups[0]["decoupled_weight_decay"] is True  # AdamW's, from a file without it too
    loss = step(model, optimizer, 3)
    weights = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    print(f"{path.name} on torch {torch.__version__}: loss {loss:.7f} vs {loaded['extra']['third_loss']:.7f}")
    assert loss == pytest.approx(loaded["extra"]["third_loss"], abs=1e-5)
    torch.testing.assert_close(weights, loaded["extra"]["third_weights"], rtol=0, atol=1e-5)


def test_a_checkpoint_that_cannot_be_used_names_the_release_that_wrote_it(tmp_path):
    other = next(path for path in FILES if not torch.__version__.startswith(path.stem.split("-")[-1]))
    wider = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(CheckpointError, match=rf"written by torch {other.stem.split('-')[-1]}\S*, read by torch"):
        load_checkpoint(other, wider, restore_rng=False)


if __name__ == "__main__":
    print(f"wrote {write()}", file=sys.stderr)
