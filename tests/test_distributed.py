"""helpers.distributed (process-group helpers, samplers) and helpers.processes (launch: results, failures, timeouts)."""

import os
import socket
import sys
import time

import pytest
import torch
from torch.utils.data import DistributedSampler

from helpers import compat
from helpers.distributed import (
    GlobalBatchSampler,
    all_reduce_metrics,
    default_backend,
    find_free_port,
    finish_run,
    is_rank0,
    print_rank0,
    setup_process_group,
    teardown_process_group,
    world_of_one,
)
from helpers.hangs import CAN_DUMP
from helpers.processes import HangError, RankError, import_fresh, is_running, launch
from helpers.torchrun import run_torchrun, torchrun_command
from helpers.workers import common
from helpers.workers import ddp as workers

NO_GPU_PAIR = not torch.cuda.is_available() or torch.cuda.device_count() < 2


def _pids(folder) -> list[int]:
    return [int(path.read_text()) for path in sorted(folder.glob("rank*.pid"))]


# ---------------------------------------------------------------- small helpers, no processes


def test_find_free_port_can_be_bound():
    port = find_free_port()
    assert 1024 <= port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.skipif(not NO_GPU_PAIR, reason="checks the CPU fallback")
def test_default_backend_is_gloo_without_a_gpu_per_rank():
    assert default_backend(2) == "gloo"


def test_default_backend_rejects_a_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        default_backend(0)


def test_rank0_helpers_without_a_process_group(capsys):
    assert is_rank0()
    print_rank0("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"
    assert all_reduce_metrics({"correct": 3, "samples": 4.0}) == {"correct": 3.0, "samples": 4.0}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, 1\], got 2"),
        ({"rank": 0, "world_size": 0}, "world_size must be a positive int"),
        ({"rank": 0, "world_size": 1, "backend": "udp"}, "backend must be one of"),
        ({"rank": 0, "world_size": 1, "timeout_s": 0}, "timeout_s must be a positive number"),
    ],
)
def test_setup_process_group_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        setup_process_group(**kwargs)


def test_setup_and_teardown_a_world_of_one():
    setup_process_group(0, 1, init_method=f"tcp://127.0.0.1:{find_free_port()}", timeout_s=30)
    try:
        assert all_reduce_metrics({"x": 2.5, "n": torch.tensor(3)}, average=True) == {"x": 2.5, "n": 3.0}
    finally:
        teardown_process_group()
    teardown_process_group()  # a second call is harmless
    assert is_rank0()


@pytest.mark.parametrize(
    "ending, world_size, calls",
    [
        ("teardown", 1, ["barrier", "destroy"]),
        ("teardown", 2, ["destroy"]),
        ("finish_run", 1, ["barrier", "destroy"]),
        ("finish_run", 2, ["barrier"]),
    ],
)
def test_a_group_ends_at_a_barrier_and_a_rank_of_several_never_destroys_it_at_the_end_of_a_run(
    monkeypatch, ending, world_size, calls
):
    """torch 2.6's gloo now and then hangs in destroy_process_group: right after a collective (a barrier first
    prevents it in a world of one), and in a rank whose peers have left (then only skipping it does). teardown has
    no barrier in a larger world, where a failed rank never arrives; finish_run, at the end of a run that succeeded,
    meets there and leaves the group to the process's os._exit."""
    import torch.distributed as dist

    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: world_size)
    monkeypatch.setattr(dist, "barrier", lambda: made.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: made.append("destroy"))
    (teardown_process_group if ending == "teardown" else finish_run)()
    assert made == calls


def test_world_of_one_is_rank_0_of_1_inside_the_block_and_gone_after():
    import torch.distributed as dist

    with world_of_one(timeout_s=30) as device:
        assert device == torch.device("cpu") and dist.get_rank() == 0 and dist.get_world_size() == 1
        assert all_reduce_metrics({"x": 2.0}) == {"x": 2.0}
    assert not dist.is_initialized()
    with pytest.raises(ZeroDivisionError), world_of_one(timeout_s=30):
        1 / 0  # noqa: B018
    assert not dist.is_initialized()  # left even when the block raised


def test_is_running_tells_a_live_process_from_a_finished_one():
    import subprocess

    assert is_running(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its id no longer names a process
    assert not is_running(child.pid)
    with pytest.raises(ValueError, match="pid must be a positive int"):
        is_running(0)


@pytest.mark.parametrize(
    "world_size, batch_size, drop_last", [(2, 5, False), (3, 4, False), (3, 4, True), (1, 7, False)]
)
def test_global_batch_sampler_joins_the_ranks_batches(world_size, batch_size, drop_last):
    size = 23
    sampler = GlobalBatchSampler(size, world_size, batch_size, seed=4, drop_last=drop_last)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        per_rank = []
        for rank in range(world_size):
            ddp = DistributedSampler(range(size), num_replicas=world_size, rank=rank, seed=4, drop_last=drop_last)
            ddp.set_epoch(epoch)
            indices = list(ddp)
            per_rank.append([indices[i : i + batch_size] for i in range(0, len(indices), batch_size)])
        expected = [[index for batch in step for index in batch] for step in zip(*per_rank, strict=True)]
        assert batches == expected
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first


@pytest.mark.parametrize("kwargs", [{"dataset_size": 0}, {"world_size": 0}, {"batch_size": -1}])
def test_global_batch_sampler_rejects_bad_sizes(kwargs):
    arguments = {"dataset_size": 10, "world_size": 2, "batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be a positive int"):
        GlobalBatchSampler(**arguments)


def _local_function(rank, world_size):
    return rank


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"worker": lambda rank, world_size: rank}, TypeError, "top-level function of an importable module"),
        ({"worker": "describe_rank"}, TypeError, "worker must be a function"),
        ({"nprocs": 0}, ValueError, "nprocs must be a positive int, got 0"),
        ({"backend": "udp"}, ValueError, "backend must be one of"),
        ({"init_method": "udp"}, ValueError, "init_method must be one of"),
        ({"timeout_s": -1}, ValueError, "timeout_s must be a positive number"),
        ({"threads_per_process": 0}, ValueError, "threads_per_process must be a positive int"),
    ],
)
def test_launch_rejects_bad_arguments_before_starting_anything(kwargs, error, match):
    arguments = {"worker": workers.describe_rank, "nprocs": 2, **kwargs}
    with pytest.raises(error, match=match):
        launch(arguments.pop("worker"), **arguments)


def test_launch_refuses_a_function_defined_in_a_notebook_and_says_how_a_cell_writes_a_module(monkeypatch):
    import types

    def worker(rank, world_size):
        return rank

    worker.__module__, worker.__qualname__ = "__main__", "worker"  # as a notebook cell defines it
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a kernel's __main__: no file
    with pytest.raises(
        TypeError, match=r"defined in a notebook cannot reach them; write it into a module .*%%writefile"
    ):
        launch(worker, 2)


def _write_worker(folder, returns: int) -> None:
    (folder / "fresh_lesson.py").write_text(f"def worker(rank, world_size):\n    return {returns}\n")


def test_import_fresh_sees_an_edit_of_the_same_size_and_modification_time(tmp_path, monkeypatch):
    """A cell rerun within a second of the last writes a file that a cached .pyc would still claim to match."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # cache bytecode, as Python does by default
    monkeypatch.syspath_prepend(str(tmp_path))
    _write_worker(tmp_path, 1)
    assert import_fresh("fresh_lesson").worker(0, 1) == 1
    stamp = (tmp_path / "fresh_lesson.py").stat().st_mtime_ns
    _write_worker(tmp_path, 2)  # the same size
    os.utime(tmp_path / "fresh_lesson.py", ns=(stamp, stamp))  # and the same modification time
    assert list((tmp_path / "__pycache__").iterdir())  # the first text's bytecode, which would still pass for it
    module = import_fresh("fresh_lesson")
    assert module.worker(0, 1) == 2 and sys.modules["fresh_lesson"] is module


def test_import_fresh_names_the_cell_to_run_and_refuses_a_bad_name(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no module 'not_written_yet' .* run the cell that writes"):
        import_fresh("not_written_yet")
    with pytest.raises(ValueError, match="name must be a module name"):
        import_fresh("lesson.py/")


@pytest.mark.slow
def test_ranks_run_the_module_as_import_fresh_last_read_it(tmp_path, monkeypatch):
    """The ranks import the worker's module by name: after an edit and import_fresh, they run the edited text."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # a .pyc of the first text, which the ranks would read
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned ranks start with this process's sys.path
    _write_worker(tmp_path, 1)
    import_fresh("fresh_lesson")
    stamp = (tmp_path / "fresh_lesson.py").stat().st_mtime_ns
    _write_worker(tmp_path, 2)
    os.utime(tmp_path / "fresh_lesson.py", ns=(stamp, stamp))
    assert launch(import_fresh("fresh_lesson").worker, 2, timeout_s=120) == [2, 2]


def test_launch_rejects_a_nested_function():
    def nested(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="<locals>"):
        launch(nested, 2)


@pytest.mark.skipif(not NO_GPU_PAIR, reason="checks the refusal without GPUs")
def test_launch_refuses_nccl_without_a_gpu_per_rank():
    with pytest.raises(ValueError, match="nccl"):
        launch(workers.describe_rank, 2, backend="nccl")


def test_torchrun_command_and_its_checks():
    command = torchrun_command("helpers.cli.train_ddp", ["--epochs", 2], nproc_per_node=3)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in command and "--nproc_per_node=3" in command
    assert command[-4:] == ["-m", "helpers.cli.train_ddp", "--epochs", "2"]
    with pytest.raises(ValueError, match="nproc_per_node must be a positive int"):
        torchrun_command("helpers.cli.train_ddp", nproc_per_node=0)


# ---------------------------------------------------------------- real launches (2 gloo processes)


@pytest.mark.slow
@pytest.mark.parametrize("init_method", ["env", "file"])  # tcp: test_setup_and_teardown_a_world_of_one
def test_launch_runs_every_rank_and_returns_results_in_rank_order(init_method):
    results = launch(workers.describe_rank, 2, init_method=init_method, timeout_s=120)
    assert [row["rank"] for row in results] == [0, 1]
    assert all(row["world_size"] == 2 and row["sum_of_ranks"] == 1.0 for row in results)
    assert all(row["torch_threads"] == 1 for row in results)
    assert len({row["pid"] for row in results}) == 2 and os.getpid() not in {row["pid"] for row in results}


@pytest.mark.slow
def test_send_recv_and_all_reduce_return_cpu_tensors_that_outlive_the_ranks():
    seed = 5
    results = launch(workers.communication_worker, 2, args=(seed,), timeout_s=120)
    received = results[1]["send_recv"]["received"]
    assert received.device.type == "cpu" and torch.equal(received, workers.payload_for(seed, 1))
    total = workers.contribution_of(seed, 0) + workers.contribution_of(seed, 1)
    for row in results:
        torch.testing.assert_close(row["all_reduce"]["reduced"], total)
    expected_mean = (float(workers.contribution_of(seed, 0).sum()) + float(workers.contribution_of(seed, 1).sum())) / 2
    assert results[0]["all_reduce"]["mean_of_sums"] == pytest.approx(expected_mean)


@pytest.mark.slow
def test_sampler_shards_are_disjoint_cover_the_data_and_reshuffle_with_set_epoch():
    results = launch(workers.sampler_worker, 2, args=(11, 3), timeout_s=120)
    for epoch in ("epoch0", "epoch1"):
        union = results[0][epoch] + results[1][epoch]
        assert sorted(set(union)) == list(range(11)) and len(union) == 12  # one index repeated as padding
    assert all(row["epoch0_again"] == row["epoch0"] and row["epoch1"] != row["epoch0"] for row in results)


@pytest.mark.slow
def test_ddp_broadcasts_buffers_at_wrap_and_before_each_forward_unless_told_not_to():
    results = launch(workers.buffers_worker, 2, args=(2**32 - 1,), timeout_s=120)
    zero, one = results
    for sync in (True, False):
        # rank 1 set 1.0; the wrap copies rank 0's, except under torch < 2.13's broadcast_buffers=False
        assert torch.equal(one[sync]["at_wrap"], zero[sync]["at_wrap"]) == compat.ddp_syncs_buffers_at_wrap(sync)
        assert not torch.equal(one[sync]["after"], zero[sync]["after"])  # each forward updates from its own batch
    assert torch.equal(one[True]["seen"][1], zero[True]["seen"][1])  # synced again before the second forward
    assert not torch.allclose(one[False]["seen"][1], zero[False]["seen"][1])


@pytest.mark.slow
def test_hand_averaging_ddp_and_one_process_agree_and_no_sync_does_not_communicate():
    seed, batch = 2**32 - 1, 6  # the largest seed a notebook accepts
    results = launch(workers.gradients_worker, 2, args=(seed, batch), timeout_s=120)
    inputs, targets = common.gradient_batch(seed, 4 * batch)
    first_half = workers.full_batch_gradient(seed, inputs[: 2 * batch], targets[: 2 * batch])
    everything = workers.full_batch_gradient(seed, inputs, targets)
    assert not torch.allclose(results[0]["local"], results[1]["local"])
    assert not torch.allclose(results[0]["under_no_sync"], results[1]["under_no_sync"])
    for row in results:
        torch.testing.assert_close(row["under_no_sync"], row["local"] / 2)
        torch.testing.assert_close(row["by_hand"], first_half)
        torch.testing.assert_close(row["ddp"], first_half)
        torch.testing.assert_close(row["after_sync"], everything)


@pytest.mark.slow
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_rank_that_raises_ends_the_run_with_its_rank_and_traceback(tmp_path, bad_rank):
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        launch(workers.failing_worker, 2, args=(bad_rank, "raise", str(tmp_path)), timeout_s=60)
    assert time.monotonic() - start < 45  # well before the 60 s timeout: the failure is noticed, not waited out
    error = caught.value
    assert error.rank == bad_rank and error.error_type == "ValueError"
    assert f"rank {bad_rank} was told to fail" in error.traceback_text and "Traceback" in error.traceback_text
    assert f"rank {bad_rank} of 2 raised ValueError" in str(error)
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(is_running(pid) for pid in pids)


@pytest.mark.slow
def test_a_rank_that_dies_without_a_word_is_named(tmp_path):
    with pytest.raises(RankError) as caught:
        launch(workers.failing_worker, 2, args=(1, "exit", str(tmp_path)), timeout_s=60)
    assert caught.value.rank == 1 and caught.value.error_type == "ProcessExit"
    assert "exited with code 3" in str(caught.value)
    assert not any(is_running(pid) for pid in _pids(tmp_path))


@pytest.mark.slow
def test_a_hanging_rank_hits_the_timeout_and_every_rank_is_stopped(tmp_path):
    start = time.monotonic()
    # 10 s: long enough for both ranks to start and write their pid files on a busy 2-core machine (2-3 s here)
    with pytest.raises(TimeoutError, match="did not finish within timeout_s=10"):
        launch(workers.failing_worker, 2, args=(1, "hang", str(tmp_path)), timeout_s=10)
    assert time.monotonic() - start < 10 + 15  # the timeout, plus at most the grace period to stop the ranks
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(is_running(pid) for pid in pids)


@pytest.mark.slow
@pytest.mark.skipif(not CAN_DUMP, reason="a rank's stack is asked for with SIGUSR1, which Windows lacks")
def test_a_hang_is_reported_with_where_each_rank_is_and_the_rank_that_skipped_the_collective(tmp_path):
    start = time.monotonic()
    with pytest.raises(HangError) as caught:
        launch(workers.failing_worker, 2, args=(1, "skip", str(tmp_path)), timeout_s=10)
    assert time.monotonic() - start < 10 + 30  # the timeout, the stacks and stopping the ranks
    error = caught.value
    assert error.waiting == [0] and sorted(error.stacks) == [0, 1]
    assert error.places[0].startswith("waiting in dist.all_reduce, called at ddp.py:")
    assert error.places[0].endswith("in failing_worker") and "its worker returned" in error.places[1]
    assert "rank(s) [1] never reached the dist.all_reduce at ddp.py:" in str(error)
    assert not any(is_running(pid) for pid in _pids(tmp_path))


@pytest.mark.slow
def test_detail_debugging_names_the_mismatched_collectives():
    with pytest.raises(RankError, match="Detected mismatch between collectives") as caught:
        launch(workers.failing_worker, 2, args=(1, "skip"), timeout_s=60, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert "ALLREDUCE" in str(caught.value)


def test_launch_refuses_an_environment_that_is_not_names_to_strings():
    with pytest.raises(TypeError, match="env must map names to strings"):
        launch(workers.describe_rank, 2, env={"TORCH_DISTRIBUTED_DEBUG": 1})


@pytest.mark.slow
def test_run_torchrun_stops_a_run_that_takes_too_long():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within timeout_s=2"):
        run_torchrun("helpers.cli.train_ddp", ["--epochs", "1000", "--no-progress"], nproc_per_node=2, timeout_s=2)
    assert time.monotonic() - start < 2 + 15


# ---------------------------------------------------------------- the lesson's helpers, in this process


def test_gradient_batch_checks_its_input_and_full_batch_gradient_is_the_seeded_model_s():
    inputs, targets = common.gradient_batch(1, 10)
    assert inputs.shape == (10, 1, 8, 8) and targets.shape == (10,)
    assert torch.equal(common.gradient_batch(1, 10)[0], inputs)  # same seed, same samples
    assert not torch.equal(common.gradient_batch(2**32 - 1, 10)[0], inputs)  # any 32-bit seed works
    model = common.mlp(1, (64,))
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(workers.full_batch_gradient(1, inputs, targets), flat)  # the same, from a fresh seeded model
    with pytest.raises(ValueError, match="samples must be an int in"):
        common.gradient_batch(1, 0)


def test_payloads_differ_by_rank_and_take_any_32_bit_seed():
    seed = 2**32 - 1
    assert torch.equal(workers.payload_for(seed, 1), workers.payload_for(seed, 1))
    assert not torch.equal(workers.payload_for(seed, 1), workers.payload_for(seed, 2))
    assert not torch.equal(workers.contribution_of(seed, 0), workers.contribution_of(seed, 1))


def test_failing_worker_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        workers.failing_worker(0, 2, 1, "explode")


def test_all_reduce_metrics_divides_by_the_world_size_to_average(monkeypatch):
    """Mistake: average=True returning the sum."""
    import torch.distributed as dist

    from helpers.distributed import all_reduce_metrics

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None: tensor.mul_(4))  # four ranks with equal values
    assert all_reduce_metrics({"loss": 2.0}, average=True) == {"loss": 2.0}
    assert all_reduce_metrics({"loss": 2.0}) == {"loss": 8.0}


@pytest.mark.slow
def test_wait_for_lines_counts_the_lines_that_start_with_the_prefix_and_stops_at_the_end():
    import subprocess

    from helpers.processes import wait_for_lines

    script = "print('saved step 1'); print('other'); print('saved step 2', flush=True); import time; time.sleep(60)"
    running = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert wait_for_lines(running, "saved step", count=2)  # returns while the process still runs
        assert running.poll() is None
    finally:
        running.kill()
        running.wait()
    ended = subprocess.Popen([sys.executable, "-c", "print('saved step 1')"], stdout=subprocess.PIPE, text=True)
    assert not wait_for_lines(ended, "saved step", count=2)
    ended.wait()
    silent = subprocess.Popen([sys.executable, "-c", "pass"])
    silent.wait()
    with pytest.raises(ValueError, match="stdout=subprocess.PIPE"):
        wait_for_lines(silent, "x")
    with pytest.raises(ValueError, match="count must be a positive int"):
        wait_for_lines(ended, "x", count=0)
