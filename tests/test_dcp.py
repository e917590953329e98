"""Distributed checkpoints (torch.distributed.checkpoint through helpers.workers.fsdp): saved sharded by N ranks,
loaded by M processes (2 -> 1 -> 2, and a world of one), weights and AdamW state unchanged."""

import pytest
import torch

from helpers import compat
from helpers.checkpoint import states_equal
from helpers.distributed import world_of_one
from helpers.processes import launch
from helpers.workers import fsdp as workers

# FSDP2 on CPU ranks needs torch 2.7 (helpers.compat); on the floor torch these run where a GPU per rank exists
SHARDS_ON_CPU, NO_SHARDING_WHY = compat.fsdp2_runs_on("cpu")
needs_fsdp2_on_cpu = pytest.mark.skipif(not SHARDS_ON_CPU, reason=NO_SHARDING_WHY)

SEED, HIDDEN, STEPS, BATCH, LR = 4, (32,), 2, 8, 1e-2


def _different(a: dict, b: dict) -> bool:
    return all(not torch.equal(a[name], b[name]) for name in a)


@needs_fsdp2_on_cpu
def test_a_world_of_one_saves_and_a_plain_process_loads_model_and_optimizer(tmp_path):
    with world_of_one(timeout_s=60):
        model, optimizer = workers.trained_fsdp(SEED, HIDDEN, STEPS, BATCH, LR, rank=0, world_size=1)
        workers.save_sharded(model, optimizer, tmp_path)
        saved = workers.full_state(model, optimizer)
    assert (tmp_path / ".metadata").is_file() and (tmp_path / "__0_0.distcp").is_file()
    plain, loaded = workers.load_checkpoint_here(SEED, HIDDEN, LR, tmp_path)
    assert states_equal(loaded, saved)
    assert set(loaded["optimizer"]["state"]["1.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(loaded["optimizer"]["state"]["1.weight"]["step"]) == STEPS
    assert all(torch.equal(p.detach(), saved["model"][name]) for name, p in plain.named_parameters())


@needs_fsdp2_on_cpu
def test_whole_views_save_a_sharded_run_in_one_file_and_load_it_back_into_fresh_shards(tmp_path):
    from helpers.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint

    with world_of_one(timeout_s=60):
        model, optimizer = workers.trained_fsdp(SEED, HIDDEN, STEPS, BATCH, LR, rank=0, world_size=1)
        whole, whole_optimizer = workers.WholeModel(model), workers.WholeOptimizer(model, optimizer)
        with pytest.raises(RuntimeError, match="call gather"):
            whole.state_dict()
        whole.gather()
        whole_optimizer.gather()
        save_checkpoint(tmp_path / "run.pt", whole, whole_optimizer, step=STEPS)
        saved = workers.full_state(model, optimizer)
        fresh, fresh_optimizer = workers.trained_fsdp(SEED + 1, HIDDEN, 1, BATCH, LR, rank=0, world_size=1)
        views = workers.WholeModel(fresh), workers.WholeOptimizer(fresh, fresh_optimizer)
        for view in views:
            view.gather()
        assert _different(views[0].state_dict(), saved["model"])
        load_checkpoint(tmp_path / "run.pt", *views)
        loaded = workers.full_state(fresh, fresh_optimizer)
    assert set(read_checkpoint(tmp_path / "run.pt")["model"]) == set(saved["model"])  # the plain model's keys
    assert states_equal(loaded, saved)


def test_load_refuses_a_folder_without_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no distributed checkpoint in .*: its .metadata file"):
        workers.load_checkpoint_here(SEED, HIDDEN, LR, tmp_path)


@pytest.mark.slow
@needs_fsdp2_on_cpu
def test_two_ranks_save_one_process_loads_and_two_ranks_load_again(tmp_path):
    saved = launch(workers.save_worker, 2, args=(SEED, HIDDEN, STEPS, BATCH, LR, str(tmp_path)), timeout_s=180)
    assert states_equal(saved[0], saved[1])  # whole state, gathered: the same on both ranks
    files = sorted(path.name for path in tmp_path.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # a file per rank, written in parallel

    _, here = workers.load_checkpoint_here(SEED, HIDDEN, LR, tmp_path)  # 2 ranks -> 1 process
    assert states_equal(here, saved[0])

    again = launch(workers.load_worker, 2, args=(SEED, HIDDEN, LR, str(tmp_path)), timeout_s=180)  # -> 2 ranks
    for rank in again:
        assert _different(rank["before"], saved[0]["model"])  # the fresh model started elsewhere
        assert states_equal(rank["loaded"], saved[0])
