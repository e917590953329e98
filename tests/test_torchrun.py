"""helpers.torchrun and helpers.run_folder: torchrun's command lines and their refusals, a group restarted after a
rank is killed (bit-identical to a run never stopped), two nodes on one machine (c10d and static rendezvous) against
one launcher, an elastic group that takes a second node, and one live run per output folder."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import compat
from helpers.checkpoint import read_checkpoint, states_equal
from helpers.distributed import find_free_port
from helpers.processes import wait_for_lines
from helpers.run_folder import OWNER_FILE, claim_run_folder, folder_owner
from helpers.torchrun import (
    finish_torchrun,
    parse_nnodes,
    rank_processes,
    run_torchrun,
    start_torchrun,
    torchrun_command,
    torchrun_env,
    wait_for_endpoint,
)

TRAIN = "helpers.cli.train_gpt"
SHARDS_ON_CPU, NO_SHARDING_WHY = compat.fsdp2_runs_on("cpu")
PARTS = ("model", "optimizer", "scheduler", "scaler")


# ---------------------------------------------------------------- command lines and bad inputs


def test_one_machine_is_standalone_and_restarts_are_passed_on():
    command = torchrun_command(TRAIN, ["--steps", 3], nproc_per_node=2, max_restarts=2)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert {"--standalone", "--nproc_per_node=2", "--max-restarts=2"} <= set(command)
    assert command[-4:] == ["-m", TRAIN, "--steps", "3"]
    assert not any(part.startswith("--max-restarts") for part in torchrun_command(TRAIN))


def test_several_nodes_meet_at_a_c10d_rendezvous_or_a_static_one():
    c10d = torchrun_command(TRAIN, nproc_per_node=1, nnodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_id="job-7")
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=job-7"} <= set(c10d)
    assert "--standalone" not in c10d and not any(part.startswith("--node-rank") for part in c10d)
    elastic = torchrun_command(TRAIN, nnodes="1:2", rdzv_endpoint="10.0.0.1:29400", join_s=2)
    assert {"--nnodes=1:2", "--rdzv-conf=last_call_timeout=2"} <= set(elastic)
    static = torchrun_command(TRAIN, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400")
    expected = {"--node-rank=1", "--rdzv-backend=static", "--master-addr=10.0.0.1", "--master-port=29400"}
    assert expected <= set(static)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"max_restarts": -1}, r"max_restarts must be an int >= 0, got -1"),
        ({"max_restarts": 1.5}, "max_restarts must be"),
        ({"nproc_per_node": 0}, "nproc_per_node must be a positive int"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, r"node_rank must be an int in \[0, 1\], got 2"),
        ({"nnodes": 2, "node_rank": -1, "rdzv_endpoint": "h:1"}, "node_rank must be"),
        ({"nnodes": "1:2", "node_rank": 0, "rdzv_endpoint": "h:1"}, "node_rank=0 fixes the nodes' numbers"),
        ({"nnodes": 2}, "nnodes=2 needs rdzv_endpoint"),
        ({"nnodes": "2:1", "rdzv_endpoint": "h:1"}, "nnodes must be a positive int or a range"),
        ({"nnodes": 0}, "nnodes must be a positive int"),
        ({"nnodes": "two", "rdzv_endpoint": "h:1"}, "nnodes must be"),
        ({"nnodes": 2, "rdzv_endpoint": "h"}, "rdzv_endpoint must be 'host:port'"),
        ({"nnodes": 2, "rdzv_endpoint": "h:70000"}, r"port in \[1, 65535\]"),
        ({"nnodes": 2, "rdzv_endpoint": "h:1", "rdzv_id": "my job"}, "rdzv_id must be a name"),
        ({"nnodes": "1:2", "rdzv_endpoint": "h:1", "join_s": 0}, "join_s must be a positive number"),
    ],
)
def test_bad_launcher_settings_are_refused_naming_the_setting(options, match):
    with pytest.raises(ValueError, match=match):
        torchrun_command(TRAIN, **options)


def test_node_counts_read_as_the_fewest_and_the_most():
    assert parse_nnodes(1) == (1, 1) and parse_nnodes("2") == (2, 2) and parse_nnodes("1:2") == (1, 2)
    with pytest.raises(ValueError, match="nnodes"):
        parse_nnodes(True)


def test_an_endpoint_nobody_serves_is_named_within_the_time_given():
    endpoint = f"127.0.0.1:{find_free_port()}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"rdzv_endpoint {endpoint} cannot be reached"):
        wait_for_endpoint(endpoint, timeout_s=1.0)
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match="rdzv_endpoint must be"):
        wait_for_endpoint("no-port", timeout_s=1.0)


def test_a_process_that_is_not_a_launcher_has_no_ranks():
    assert rank_processes(os.getpid()) == {}


# ---------------------------------------------------------------- one live run per folder


def test_a_folder_is_claimed_for_the_block_and_released_after(tmp_path):
    with claim_run_folder(tmp_path / "run") as folder:
        assert folder_owner(folder)["pid"] == os.getpid()
        with claim_run_folder(folder):  # the same process may claim again
            pass
    assert folder_owner(tmp_path / "run") is None and not (tmp_path / "run" / OWNER_FILE).exists()
    with pytest.raises(TypeError, match="folder must be a path"):
        with claim_run_folder(3):
            pass


@contextlib.contextmanager
def held_by_another_process(folder: Path):
    """A Python process that claims `folder` and waits; killed at the end, so its claim stays behind, stale."""
    code = f"from helpers.run_folder import claim_run_folder\nwith claim_run_folder({str(folder)!r}):\n    input()\n"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True, env=torchrun_env())
    try:
        deadline = time.monotonic() + 30
        while folder_owner(folder) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_of_runs_started_into_one_folder_at_the_same_instant_exactly_one_gets_it(tmp_path):
    folder, go = tmp_path / "run", tmp_path / "go"
    # A slow file system, played by a pause after each read of who holds the folder: whoever reads the folder as
    # free must not take it on that word alone
    code = (
        "import pathlib, sys, time\nfrom helpers import run_folder\nfrom helpers.run_folder import claim_run_folder\n"
        "read = run_folder.folder_owner\nrun_folder.folder_owner = lambda path: (read(path), time.sleep(0.3))[0]\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.001)\n"
        f"try:\n    with claim_run_folder({str(folder)!r}):\n        print('claimed', flush=True); time.sleep(2)\n"
        "except ValueError:\n    print('refused')\n"
    )
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    time.sleep(1.5)  # all four are waiting for the same instant
    go.touch()
    said = sorted(run.communicate(timeout=60)[0].strip() for run in runs)
    assert said == ["claimed", "refused", "refused", "refused"]


def test_a_folder_a_live_process_holds_is_refused_and_a_dead_one_s_is_taken_over(tmp_path):
    folder = tmp_path / "run"
    with held_by_another_process(folder) as holder:
        with pytest.raises(ValueError, match=f"process {holder.pid} on this machine writes there"):
            with claim_run_folder(folder):
                pass
    assert (folder / OWNER_FILE).exists() and folder_owner(folder) is None
    with claim_run_folder(folder):
        assert folder_owner(folder)["pid"] == os.getpid()


def test_the_training_script_refuses_a_folder_a_live_run_holds(tmp_path):
    from helpers.cli.train_gpt import main

    with held_by_another_process(tmp_path / "run"):
        with pytest.raises(SystemExit, match="is the folder of a run still going"):
            main(["--out", str(tmp_path / "run"), "--steps", "1", "--no-progress"])


# ---------------------------------------------------------------- real launches (gloo, tiny GPT)


def _options(text_file: Path, out: Path, *extra: str, steps: int = 12) -> list[str]:
    tiny = f"--block-size 32 --n-layer 2 --n-head 2 --n-embd 32 --steps {steps} --warmup 2 --eval-every {steps}"
    quiet = "--eval-batches 2 --sample-tokens 0 --no-progress --threads 1 --strategy ddp"
    return ["--text", str(text_file), *tiny.split(), *quiet.split(), "--out", str(out), *extra]


def _env(tmp_path: Path) -> dict:
    return torchrun_env(COURSE_DATA_DIR=str(tmp_path / "data"))


def _same_states(folder_a: Path, folder_b: Path, step: int) -> bool:
    name = f"checkpoints/step-{step:08d}.pt"
    a, b = read_checkpoint(folder_a / name), read_checkpoint(folder_b / name)
    return all(states_equal(a[part], b[part]) for part in PARTS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.skipif(not SHARDS_ON_CPU, reason=NO_SHARDING_WHY))]
)
def test_torchrun_restarts_the_group_after_a_rank_is_killed_and_it_ends_bit_identical(text_file, tmp_path, strategy):
    env, step_lines = _env(tmp_path), ["--log-every", "1", "--save-every", "3", "--dropout", "0.1"]
    step_lines += ["--strategy", strategy]  # fsdp: each checkpoint gathered whole from the shards, one file
    # The run never stopped trains beside the one that is killed (one thread each: the same bits either way)
    straight = start_torchrun(TRAIN, _options(text_file, tmp_path / "straight", *step_lines), nproc_per_node=2, env=env)
    launcher = start_torchrun(
        TRAIN, _options(text_file, tmp_path / "killed", *step_lines), nproc_per_node=2, max_restarts=1, env=env
    )
    try:
        assert wait_for_lines(launcher, "saved step", count=2)  # steps 3 and 6 are on disk
        ranks = rank_processes(launcher)
        assert sorted(ranks) == [0, 1]
        ranks[1].send_signal(signal.SIGKILL)
        output = finish_torchrun(launcher, timeout_s=240)
        finish_torchrun(straight, timeout_s=240)
    finally:
        launcher.kill()
        straight.kill()
    assert output.count("resumed at step") == 1, output[-3000:]  # one restart was enough
    assert _same_states(tmp_path / "straight", tmp_path / "killed", 12)


def _two_launchers(options: list[str], env: dict, *, static: bool) -> str:
    """Node 0's launcher, then node 1's (under c10d once node 0 serves the rendezvous); their outputs, joined."""
    endpoint, nodes = f"127.0.0.1:{find_free_port()}", []
    for node in (0, 1):
        node_rank = node if static else None
        launcher = start_torchrun(
            TRAIN, options, nproc_per_node=1, nnodes=2, node_rank=node_rank, rdzv_endpoint=endpoint, env=env
        )
        nodes.append(launcher)
        if node == 0 and not static:
            wait_for_endpoint(endpoint, timeout_s=60)
    outputs: dict[int, str] = {}
    reader = threading.Thread(target=lambda: outputs.__setitem__(1, finish_torchrun(nodes[1], 240)))
    reader.start()
    try:
        outputs[0] = finish_torchrun(nodes[0], 240)
    finally:
        reader.join()
        for launcher in nodes:
            launcher.kill()
    return outputs[0] + outputs.get(1, "")


SAVING = ["--log-every", "4", "--save-every", "12", "--dropout", "0.1"]


@pytest.fixture(scope="module")
def one_launcher(text_file, tmp_path_factory) -> Path:
    """The folder of a run by one launcher of two ranks, which the two-node runs must match."""
    folder = tmp_path_factory.mktemp("one-launcher")
    run_torchrun(TRAIN, _options(text_file, folder / "run", *SAVING), nproc_per_node=2, env=_env(folder))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_nodes_on_one_machine_train_to_the_weights_of_one_launcher(text_file, tmp_path, one_launcher, rendezvous):
    env = _env(one_launcher)  # the corpus cache the reference run built
    output = _two_launchers(_options(text_file, tmp_path / "two", *SAVING), env, static=rendezvous == "static")
    assert "2 rank(s)" in output
    assert _same_states(one_launcher / "run", tmp_path / "two", 12)


@pytest.mark.slow
def test_an_elastic_group_takes_a_second_node_and_keeps_the_global_batch(text_file, tmp_path):
    env = _env(tmp_path)
    steps, saving = 500, ["--log-every", "25", "--save-every", "25", "--batch-size", "4", "--global-batch", "8"]
    endpoint, options = f"127.0.0.1:{find_free_port()}", _options(text_file, tmp_path / "grown", *saving, steps=steps)
    elastic = {"nproc_per_node": 1, "nnodes": "1:2", "rdzv_endpoint": endpoint, "join_s": 1, "env": env}
    # The reference, one rank throughout, trains beside the elastic run (one thread each: the same bits either way)
    alone = start_torchrun(
        TRAIN, _options(text_file, tmp_path / "alone", *saving, steps=steps), nproc_per_node=1, env=env
    )
    first, second, outputs = start_torchrun(TRAIN, options, **elastic), None, {}
    try:
        assert wait_for_lines(first, "saved step 25")  # training alone, a world of one
        second = start_torchrun(TRAIN, options, **elastic)
        reader = threading.Thread(target=lambda: outputs.__setitem__("second", finish_torchrun(second, 240)))
        reader.start()
        outputs["first"] = finish_torchrun(first, 240)
        reader.join()
        finish_torchrun(alone, 240)
    finally:
        for launcher in (alone, first, second):
            if launcher is not None:
                launcher.kill()
    both = outputs["first"] + outputs.get("second", "")
    assert "2 rank(s)" in both and "resumed at step" in both, both[-3000:]
    # The same windows at every step, the gradient of 2 x 4 sequences halved exactly: the weights of one rank
    assert _same_states(tmp_path / "alone", tmp_path / "grown", steps)
    # and the validation loss of the same weights over the same windows, whatever the world size
    evals = [json.loads((tmp_path / name / "history.json").read_text())["evals"][-1] for name in ("alone", "grown")]
    assert evals[0]["step"] == evals[1]["step"] == steps
    assert abs(evals[0]["val_loss"] - evals[1]["val_loss"]) < 1e-5, evals
