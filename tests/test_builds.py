"""Builds without NCCL or CUDA (PyPI's macOS and Windows wheels, CPU-only builds): the distributed helpers and
lessons 07, 08 and 09 run in a process that sees such a build (`dist.is_nccl_available()` is False, the nccl default
timeout None, `torch.version.cuda` None), made by a sitecustomize module that every Python started below imports."""

from pathlib import Path

import nbformat
import pytest
import torch.distributed as dist
from torch.distributed import constants, distributed_c10d

import conftest
from helpers import distributed

ROOT = Path(__file__).resolve().parent.parent

# Imported by every Python process whose PYTHONPATH starts with its folder: the kernel, the ranks, torchrun.
WITHOUT_NCCL = """
import torch
import torch.distributed as dist
from torch.distributed import constants, distributed_c10d

torch.version.cuda = None  # a CPU-only build
for module in (dist, distributed_c10d):
    module.is_nccl_available = lambda: False
for module in (constants, distributed_c10d):
    module.default_pg_nccl_timeout = None
"""


def _without_nccl(monkeypatch) -> None:
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    monkeypatch.setattr(distributed_c10d, "is_nccl_available", lambda: False)
    monkeypatch.setattr(constants, "default_pg_nccl_timeout", None)


def test_default_backend_is_gloo_without_nccl_even_with_gpus(monkeypatch):
    _without_nccl(monkeypatch)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 8)
    assert distributed.default_backend(2) == "gloo"


def test_asking_for_nccl_without_nccl_names_what_is_built_in(monkeypatch):
    _without_nccl(monkeypatch)
    with pytest.raises(ValueError, match=r"backend='nccl' is not built into this PyTorch \(available: \['gloo'"):
        distributed.setup_process_group(0, 1, backend="nccl", init_method="tcp://127.0.0.1:1")


def test_a_world_of_one_forms_without_nccl(monkeypatch):
    _without_nccl(monkeypatch)
    with distributed.world_of_one(timeout_s=30) as device:
        assert dist.get_backend() == "gloo" and device.type == "cpu"
        assert distributed.all_reduce_metrics({"n": 3.0}) == {"n": 3.0}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["07_processes_and_collectives", "08_data_parallel", "09_sharded_data_parallel"])
def test_the_distributed_lessons_pass_on_a_build_without_nccl(tmp_path, monkeypatch, name):
    from nbclient import NotebookClient

    path = ROOT / "notebooks" / f"{name}.ipynb"
    reason = conftest.notebook_skip_reason(path)
    if reason:
        pytest.skip(reason)
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_NCCL)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT}")
    notebook = nbformat.read(path, as_version=4)
    probe = "import torch, torch.distributed as dist\nprint('probe:', dist.is_nccl_available(), torch.version.cuda)"
    notebook.cells.insert(0, nbformat.v4.new_code_cell(probe))  # what the kernel sees, before the lesson
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    )
    client.execute()  # raises CellExecutionError at the first cell that fails
    printed = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "probe: False None" in printed  # the kernel saw a build without NCCL or CUDA
    if name == "07_processes_and_collectives":
        assert "'nccl': 'None'" in printed  # its timeouts cell, where NCCL's default is missing
