"""The techniques that ranks run are notebook cells: notebook 08's DDP training step and notebook 09's sharding and
step are `%%writefile` cells that write the module the ranks import (`lesson_ddp.py`, `lesson_fsdp.py`). These tests
take each cell as stored, write its module as the kernel does, and launch ranks on it; then on a copy edited as a
learner would edit the cell (a step that forgets `sampler.set_epoch`, blocks that stay gathered after forward), and
check that the ranks then compute something else."""

import ast
import re
from pathlib import Path
from types import ModuleType

import nbformat
import pytest
import torch
from torch import nn

from helpers import compat
from helpers.distributed import world_of_one
from helpers.processes import import_fresh, launch
from helpers.workers import fsdp
from helpers.workers.common import train_validation_split

ROOT = Path(__file__).resolve().parent.parent
DDP_NOTEBOOK, FSDP_NOTEBOOK = "08_data_parallel.ipynb", "09_sharded_data_parallel.ipynb"

SHARDS_ON_CPU, NO_SHARDING_WHY = compat.fsdp2_runs_on("cpu")
needs_fsdp2_on_cpu = pytest.mark.skipif(not SHARDS_ON_CPU, reason=NO_SHARDING_WHY)


def cell_module(notebook: str, filename: str) -> str:
    """The text that the notebook's `%%writefile <filename>` cell writes: the cell below its first line."""
    cells = nbformat.read(ROOT / "notebooks" / notebook, as_version=4).cells
    sources = [cell.source for cell in cells if cell.cell_type == "code"]
    writing = [source for source in sources if source.splitlines()[0].split() == ["%%writefile", filename]]
    assert len(writing) == 1, f"{notebook}: expected one `%%writefile {filename}` cell, found {len(writing)}"
    return writing[0].split("\n", 1)[1]


def edited(text: str, old: str, new: str) -> str:
    """The cell's text with one edit, as a learner would make it; the edited line must be in the cell."""
    assert text.count(old) == 1, f"the cell no longer holds {old!r}: update this test with the cell"
    return text.replace(old, new)


def write_module(folder: Path, name: str, text: str, monkeypatch) -> ModuleType:
    """Write `text` as module `name` in `folder` (on sys.path, which spawned ranks inherit) and import it fresh."""
    (folder / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(folder))
    return import_fresh(name)


# ---------------------------------------------------------------- the cells, read and imported (no processes)


@pytest.mark.parametrize(
    "notebook, filename, functions",
    [
        (DDP_NOTEBOOK, "lesson_ddp.py", {"train_rank"}),
        (FSDP_NOTEBOOK, "lesson_fsdp.py", {"shard_model", "train_steps", "lesson_worker", "load_worker"}),
    ],
)
def test_the_notebook_writes_the_module_its_launch_imports_fresh(notebook, filename, functions):
    text = cell_module(notebook, filename)
    defined = {node.name for node in ast.parse(text).body if isinstance(node, ast.FunctionDef)}
    assert functions <= defined
    sources = [c.source for c in nbformat.read(ROOT / "notebooks" / notebook, as_version=4).cells]
    name = filename.removesuffix(".py")
    assert any(f'import_fresh("{name}")' in source for source in sources)  # an edit reaches the kernel and ranks
    assert name.startswith("lesson_")  # written by the notebook, never committed:
    assert "/notebooks/lesson_*.py" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_fsdp_cell_s_step_is_the_library_s_step(tmp_path, monkeypatch):
    """In one process the cell's train_steps and helpers.workers.fsdp.train_steps (the torchrun run's) agree."""
    lesson = write_module(tmp_path, "stored_fsdp_step", cell_module(FSDP_NOTEBOOK, "lesson_fsdp.py"), monkeypatch)
    batches = fsdp.step_batches(3, 2, 8)
    losses = []
    for train in (lesson.train_steps, fsdp.train_steps):
        model = fsdp.mlp(3, (16,))
        losses.append(train(model, fsdp.adamw(model, 1e-2), batches, 1, 2))
    assert losses[0] == losses[1] and len(losses[0]) == 2


@needs_fsdp2_on_cpu
def test_the_fsdp_cell_shards_each_linear_then_the_root_on_the_model_s_device(tmp_path, monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    lesson = write_module(tmp_path, "stored_fsdp_shard", cell_module(FSDP_NOTEBOOK, "lesson_fsdp.py"), monkeypatch)
    with world_of_one(timeout_s=30):
        model = lesson.shard_model(fsdp.mlp(0, (16, 8)))
        linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
        assert isinstance(model, FSDPModule) and all(isinstance(module, FSDPModule) for module in linears)
        assert all(fsdp.local(p).device.type == "cpu" for p in model.parameters())


# ---------------------------------------------------------------- an edited cell changes what the ranks compute


@pytest.mark.slow
def test_a_ddp_step_that_forgets_set_epoch_trains_every_epoch_on_epoch_0_s_shards(tmp_path, monkeypatch):
    stored_text = cell_module(DDP_NOTEBOOK, "lesson_ddp.py")
    forgetful_text = edited(stored_text, "sampler.set_epoch(epoch)", "pass  # the learner deleted set_epoch")
    stored = write_module(tmp_path, "stored_ddp_step", stored_text, monkeypatch)
    forgetful = write_module(tmp_path, "forgetful_ddp_step", forgetful_text, monkeypatch)
    epochs, batch, lr, seed = 2, 64, 0.05, 3
    runs = {}
    for name, module in (("stored", stored), ("forgetful", forgetful)):
        args = (epochs, batch, lr, seed, str(tmp_path / f"{name}.pt"))
        runs[name] = launch(module.train_rank, 2, args=args, timeout_s=180)

    split = len(train_validation_split(seed)[0])
    for ranks in runs.values():
        for epoch in range(epochs):  # each epoch, disjoint shards (and padding to even) of the whole split
            shards = [rank["shards"][epoch] for rank in ranks]
            assert set(shards[0]) | set(shards[1]) == set(range(split))
            assert sum(map(len, shards)) == split + split % 2
    assert all(rank["shards"][0] != rank["shards"][1] for rank in runs["stored"])  # set_epoch: a new order
    assert all(rank["shards"][0] == rank["shards"][1] for rank in runs["forgetful"])  # epoch 0's, again
    assert all(a["shards"][0] == b["shards"][0] for a, b in zip(runs["stored"], runs["forgetful"]))
    stored_weights, forgetful_weights = runs["stored"][0]["weights"], runs["forgetful"][0]["weights"]
    assert not torch.equal(stored_weights["1.weight"], forgetful_weights["1.weight"])  # so it trained elsewhere
    saved = torch.load(tmp_path / "forgetful.pt", weights_only=True)  # rank 0's file: the same weights
    assert torch.equal(saved["1.weight"], forgetful_weights["1.weight"])


@pytest.mark.slow
@needs_fsdp2_on_cpu
def test_blocks_left_gathered_after_forward_make_one_all_gather_fewer_per_block(tmp_path, monkeypatch):
    """Notebook 09's exercise 4: OPTIONS = {"reshard_after_forward": False} in the sharding cell, rerun, relaunch."""
    stored_text = cell_module(FSDP_NOTEBOOK, "lesson_fsdp.py")
    old = 'OPTIONS = {"reshard_after_forward": True}'
    kept_text = edited(stored_text, old, old.replace("True", "False"))
    stored = write_module(tmp_path, "stored_fsdp", stored_text, monkeypatch)
    kept = write_module(tmp_path, "kept_gathered_fsdp", kept_text, monkeypatch)
    assert stored.OPTIONS == {"reshard_after_forward": True} and kept.OPTIONS == {"reshard_after_forward": False}
    calls = {}
    for name, module in (("stored", stored), ("kept", kept)):
        args = (5, (32,), 2, 4, 1e-2, [((8,), 4)], str(tmp_path / name))  # seed, hidden, steps, batch, lr, ...
        calls[name] = [rank["fsdp_calls"] for rank in launch(module.lesson_worker, 2, args=args, timeout_s=240)]

    def count(kind, name):
        return sorted(size for size_kind, size in calls[name][0] if size_kind == kind)

    blocks = sorted(size for kind, size in calls["stored"][0] if kind == "reduce-scatter")  # one per block
    assert len(blocks) == 2 and count("reduce-scatter", "kept") == blocks
    assert count("all-gather", "stored") == sorted(2 * blocks)  # before forward, and again before backward
    assert count("all-gather", "kept") == blocks  # once: the block stayed whole from forward to backward
    assert all(rank_calls == calls["kept"][0] for rank_calls in calls["kept"])  # every rank alike


def test_the_edits_these_tests_make_are_the_ones_the_notebooks_suggest():
    """08's exercise 4 deletes set_epoch in the step's cell; 09's exercise 4 sets reshard_after_forward to False."""
    text = {
        name: " ".join(c.source for c in nbformat.read(ROOT / "notebooks" / name, as_version=4).cells)
        for name in (DDP_NOTEBOOK, FSDP_NOTEBOOK)
    }
    assert re.search(r"delete `sampler\.set_epoch\(epoch\)`", text[DDP_NOTEBOOK])
    assert 'OPTIONS = {"reshard_after_forward": False}' in text[FSDP_NOTEBOOK]
