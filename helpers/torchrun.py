"""Launching a script under torchrun from a notebook or a test: one machine, several nodes, automatic restarts.

    from helpers.torchrun import run_torchrun, start_torchrun, rank_processes
    run_torchrun("helpers.cli.train_gpt", ["--strategy", "ddp"], nproc_per_node=2)         # wait for it
    node = start_torchrun(module, args, nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29400")  # a Popen
    rank_processes(node)[1].kill()                                                         # lose a rank

`torchrun_command` writes the command line: `--standalone` on one machine, or a c10d rendezvous at
`rdzv_endpoint` that every node's launcher joins (`nnodes=2`, or an elastic range such as "1:2"), with
`--max-restarts` for restarting the whole group when a rank dies. Every launcher runs in its own session,
so stopping it (`stop_launcher`) stops its ranks too. The ranks reconnect after a restart through a fresh
prefix of torchrun's store (helpers.distributed.attempt_store).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from helpers.checks import check_int, check_positive_number

PROJECT = Path(__file__).resolve().parent.parent


def parse_nnodes(nnodes: int | str) -> tuple[int, int]:
    """`nnodes` as (fewest, most) nodes: 2 -> (2, 2), "1:2" -> (1, 2)."""
    if isinstance(nnodes, int) and not isinstance(nnodes, bool):
        check_int("nnodes", nnodes)
        return nnodes, nnodes
    match = re.fullmatch(r"(\d+)(?::(\d+))?", nnodes) if isinstance(nnodes, str) else None
    if not match or int(match[1]) < 1 or int(match[2] or match[1]) < int(match[1]):
        raise ValueError(f"nnodes must be a positive int or a range 'MIN:MAX' with 1 <= MIN <= MAX, got {nnodes!r}")
    return int(match[1]), int(match[2] or match[1])


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' as (host, port)."""
    host, _, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 2**16:
        raise ValueError(f"rdzv_endpoint must be 'host:port' with a port in [1, 65535], got {endpoint!r}")
    return host, int(port)


def torchrun_command(
    module: str,
    args: Sequence[str] = (),
    *,
    nproc_per_node: int = 2,
    nnodes: int | str = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "course",
    max_restarts: int = 0,
    join_s: float | None = None,
) -> list[str]:
    """The torchrun command line (through this Python) that runs `python -m module args...` on every rank.

    One machine (no `rdzv_endpoint`): `--standalone`. Several nodes: each node's launcher gets the same
    `rdzv_endpoint` ('host:port' of node 0), `rdzv_id` and `nnodes` (a count, or 'MIN:MAX' for an elastic group),
    and they meet at a c10d rendezvous, which numbers the nodes in the order they join. With `node_rank` each node
    gets a fixed number instead (torchrun's static rendezvous, `rdzv_endpoint` being node 0's address and a free
    port; a fixed count of nodes). `max_restarts`: how often torchrun starts the whole group again after a rank
    fails. `join_s`: how long a c10d rendezvous waits for more nodes once MIN have joined (torchrun's default: 30 s).
    """
    check_int("nproc_per_node", nproc_per_node)
    check_int("max_restarts", max_restarts, minimum=0)
    fewest, most = parse_nnodes(nnodes)
    if node_rank is not None:
        check_int("node_rank", node_rank, minimum=0, maximum=most - 1)
        if fewest != most:
            raise ValueError(
                f"node_rank={node_rank} fixes the nodes' numbers, which an elastic nnodes={nnodes!r} "
                "cannot have: leave node_rank out (the c10d rendezvous numbers the nodes as they join)"
            )
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}"]
    if max_restarts:
        command.append(f"--max-restarts={max_restarts}")
    if rdzv_endpoint is None:
        if most > 1:
            raise ValueError(f"nnodes={nnodes!r} needs rdzv_endpoint, the 'host:port' where the nodes meet")
        command.append("--standalone")
    else:
        parse_endpoint(rdzv_endpoint)
        if not isinstance(rdzv_id, str) or not re.fullmatch(r"[\w.-]+", rdzv_id):
            raise ValueError(f"rdzv_id must be a name of letters, digits, '.', '_' or '-', got {rdzv_id!r}")
        nodes = f"{fewest}:{most}" if fewest != most else str(most)
        if node_rank is not None:
            host, port = parse_endpoint(rdzv_endpoint)
            command += [f"--nnodes={nodes}", f"--node-rank={node_rank}", "--rdzv-backend=static"]
            command += [f"--master-addr={host}", f"--master-port={port}"]
        else:
            command += [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        command.append(f"--rdzv-id={rdzv_id}")
        if join_s is not None:
            check_positive_number("join_s", join_s)
            command.append(f"--rdzv-conf=last_call_timeout={join_s}")
    return [*command, "-m", module, *[str(arg) for arg in args]]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This process's environment, plus the project on PYTHONPATH and one thread per rank unless set."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")]))
    return {**env, **extra}


def start_torchrun(
    module: str,
    args: Sequence[str] = (),
    *,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    **launcher: object,
) -> subprocess.Popen:
    """Start torchrun (torchrun_command's options) in its own session; its output, merged, in `.stdout` as text."""
    command = torchrun_command(module, args, **launcher)  # type: ignore[arg-type]
    env = dict(env or torchrun_env())
    if launcher.get("rdzv_endpoint") and launcher.get("node_rank") is None:
        # torchrun's c10d rendezvous shares one store through all its rounds, and a node that joins a later round
        # (--nnodes=1:2 taking a second node) waits forever for the address that node 0 published in the first
        # (torch 2.6 to 2.15). Opting out, each round's rank 0 publishes a store of its own.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return subprocess.Popen(
        command,
        cwd=cwd or PROJECT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=os.name == "posix",
    )


def run_torchrun(
    module: str,
    args: Sequence[str] = (),
    *,
    timeout_s: float = 300.0,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    **launcher: object,
) -> str:
    """Run `module` under torchrun; return its output, or raise with its tail on failure or after `timeout_s`.

    On a timeout torchrun and all its ranks are stopped together.
    """
    check_positive_number("timeout_s", timeout_s)
    process = start_torchrun(module, args, cwd=cwd, env=env, **launcher)
    return finish_torchrun(process, timeout_s)


def finish_torchrun(process: subprocess.Popen, timeout_s: float) -> str:
    """Wait for a started launcher; its output, or an error with its tail (stopping it and its ranks on timeout)."""
    what = " ".join(str(part) for part in process.args[1:])  # type: ignore[index]
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_launcher(process)
        output, _ = process.communicate()
        raise TimeoutError(
            f"{what} did not finish within timeout_s={timeout_s} s and was stopped with all its ranks; "
            f"last output:\n{(output or '')[-3000:]}"
        ) from None
    except BaseException:  # e.g. KeyboardInterrupt in a notebook: leave no rank behind
        stop_launcher(process)
        raise
    if process.returncode != 0:
        raise RuntimeError(f"{what} failed with exit code {process.returncode}; last output:\n{output[-3000:]}")
    return output


def stop_launcher(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to a launcher and everything in its session (torchrun and its ranks)."""
    if os.name != "posix":
        process.kill()
        process.wait()
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL too: a rank may outlive torchrun itself
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


def rank_processes(launcher: subprocess.Popen | int) -> dict[int, psutil.Process]:
    """The rank processes a running torchrun started, by global rank (read from each one's RANK variable)."""
    pid = launcher if isinstance(launcher, int) else launcher.pid
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone meanwhile, or not ours to read
            rank = child.environ().get("RANK")
            if rank is not None and child.environ().get("TORCHELASTIC_RUN_ID") is not None:
                found[int(rank)] = child
    return found


def wait_for_endpoint(endpoint: str, timeout_s: float = 30.0) -> None:
    """Wait until something listens at 'host:port' (a launcher of node 0 serving the rendezvous); raise a
    ConnectionError naming the endpoint when nothing did within `timeout_s`."""
    host, port = parse_endpoint(endpoint)
    check_positive_number("timeout_s", timeout_s)
    deadline, why = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as error:
            why = error.strerror or type(error).__name__
            time.sleep(0.2)
    raise ConnectionError(
        f"rdzv_endpoint {endpoint} cannot be reached ({why}) within {timeout_s} s: start node 0's launcher first, "
        "and give every node an address of node 0 that they can reach (not 127.0.0.1 across machines)"
    )
