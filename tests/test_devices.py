import platform
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.devices import available_devices, environment_report, num_threads, pick_device, seed_everything

ROOT = Path(__file__).resolve().parent.parent


def test_pick_device_defaults_to_the_best_available():
    assert pick_device().type == available_devices()[0]
    assert available_devices()[-1] == "cpu"


def test_pick_device_forces_cpu():
    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "gpu", "banana"])
def test_pick_device_rejects_unknown_names(name):
    with pytest.raises(ValueError, match="prefer"):
        pick_device(name)


def test_pick_device_rejects_unavailable_devices():
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="only"):
            pick_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ValueError, match="not available"):
            pick_device("cuda")


@pytest.mark.parametrize("prefer", [None, "cuda", "cuda:1"])
def test_pick_device_gives_cuda_with_an_index_that_cuda_only_calls_accept(monkeypatch, prefer):
    """get_per_process_memory_fraction and its kin refuse torch.device('cuda'): pick_device never returns it."""
    from torch.cuda._utils import _get_device_index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    device = pick_device(prefer)
    assert device == torch.device("cuda", 1)
    assert _get_device_index(device) == 1
    with pytest.raises(ValueError, match="index"):  # what notebook 06 met on a GPU with the bare device
        _get_device_index(torch.device("cuda"))


def test_pick_device_rejects_non_strings():
    with pytest.raises(TypeError, match="prefer"):
        pick_device(0)


def test_seed_everything_repeats_every_generator():
    def draw():
        generator = seed_everything(123)
        return (
            random.random(),
            np.random.rand(),
            torch.rand(1).item(),
            torch.randperm(10, generator=generator).tolist(),
        )

    assert draw() == draw()
    first = draw()
    seed_everything(124)
    assert torch.rand(1).item() != first[2]


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (2**32, ValueError), (1.5, TypeError), (True, TypeError)])
def test_seed_everything_rejects_bad_seeds(seed, error):
    with pytest.raises(error, match="seed"):
        seed_everything(seed)


def test_environment_report_names_versions_and_devices():
    report = environment_report()
    assert report["torch"] == torch.__version__
    assert report["torch_threads"] == torch.get_num_threads()
    assert report["cuda_available"] == torch.cuda.is_available()
    assert len(report["devices"]) >= 1
    for key in ("python", "torchvision", "cuda_version", "cudnn_version", "cpu_count"):
        assert key in report


def test_cpu_name_is_a_readable_string():
    from helpers.devices import cpu_name

    assert isinstance(cpu_name(), str) and cpu_name()


@pytest.mark.slow
def test_keep_freed_memory_answers_whether_it_applied():
    # mallopt changes the allocator of the whole process for good: ask in a child, not in the test process
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    code = "from helpers.devices import keep_freed_memory; print(keep_freed_memory())"
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == str(on_glibc)


@pytest.mark.parametrize("pad", [-1, 1.5, True, "64"])
def test_keep_freed_memory_rejects_bad_pad(pad):
    from helpers.devices import keep_freed_memory

    with pytest.raises(ValueError, match="pad_mib"):
        keep_freed_memory(pad)


def test_num_threads_sets_and_restores():
    before = torch.get_num_threads()
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with num_threads(None):
        assert torch.get_num_threads() == before


def test_num_threads_restores_after_an_error_and_after_changes_inside():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"):
        with num_threads(1):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with num_threads(None):
        torch.set_num_threads(1)  # what a timed run may do; the block's end puts the old count back
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_num_threads_rejects_bad_counts_before_changing_anything(bad):
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="threads must be a positive int or None"):
        with num_threads(bad):
            pass
    assert torch.get_num_threads() == before


def test_sizes_for_picks_cuda_sizes_only_on_cuda():
    from helpers.sizes import LESSON_SIZES, sizes_for

    for lesson, sizes in LESSON_SIZES.items():
        assert sizes_for(lesson, "cpu") == {name: by_kind["cpu"] for name, by_kind in sizes.items()}
        roomy = sizes_for(lesson, torch.device("cuda"), free_bytes=80 * 2**30)  # an 80 GB card gets the top sizes
        assert roomy == {name: by_kind["cuda"] for name, by_kind in sizes.items()}
        assert sizes_for(lesson, "meta") == sizes_for(lesson, "cpu")  # any other device gets the small sizes
    with pytest.raises(ValueError, match="lesson must be one of"):
        sizes_for("amp", "cpu")


def test_fill_sizes_fills_only_the_parameters_left_at_none():
    from helpers.sizes import fill_sizes, sizes_for

    namespace = {"WIDTH": None, "DEPTH": 3, "BATCH_SIZE": None, "SEED": 0}
    chosen = fill_sizes(namespace, "mixed_precision", "cpu")
    expected = sizes_for("mixed_precision", "cpu")
    assert chosen == {"WIDTH": expected["WIDTH"], "BATCH_SIZE": expected["BATCH_SIZE"]}
    assert namespace == {"WIDTH": expected["WIDTH"], "DEPTH": 3, "BATCH_SIZE": expected["BATCH_SIZE"], "SEED": 0}
    assert fill_sizes(namespace, "mixed_precision", "cpu") == {}  # a second run (the knobs' Run) changes nothing


@pytest.mark.parametrize(
    "number, version",
    [(8600, (8, 6, 0)), (8902, (8, 9, 2)), (90100, (9, 1, 0)), (91002, (9, 10, 2)), (92400, (9, 24, 0))],
)
def test_parse_cudnn_version_reads_both_numberings(number, version):
    from helpers.devices import parse_cudnn_version

    assert parse_cudnn_version(number) == version


@pytest.mark.parametrize("bad", [-1, 0, 999, "9.1.0", 9.1, True, None])
def test_parse_cudnn_version_refuses_what_is_not_a_cudnn_number(bad):
    from helpers.devices import parse_cudnn_version

    with pytest.raises(ValueError, match="number must be a cuDNN version"):
        parse_cudnn_version(bad)


@pytest.mark.parametrize(
    "arch_list, capability, runs",
    [
        (["sm_80"], (8, 0), True),
        (["sm_80"], (8, 6), True),  # a binary runs on later minors of its major
        (["sm_80"], (9, 0), False),  # not on the next major
        (["sm_86"], (8, 0), False),  # nor on an earlier GPU
        (["compute_80"], (9, 0), True),  # PTX is compiled at load time for any later GPU
        (["sm_90a"], (9, 0), True),
        (["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], (12, 0), True),
        (["sm_100"], (12, 0), False),
        (["gfx90a"], (9, 0), False),  # a ROCm architecture never matches a CUDA capability
        ([], (8, 0), False),  # a CPU-only build
    ],
)
def test_arch_runs_on_follows_binary_and_ptx_compatibility(arch_list, capability, runs):
    from helpers.devices import arch_runs_on

    assert arch_runs_on(arch_list, capability) is runs


def test_arch_runs_on_refuses_a_single_string():
    from helpers.devices import arch_runs_on

    with pytest.raises(TypeError, match="arch_list must be a list"):
        arch_runs_on("sm_80", (8, 0))


def test_cuda_versions_reads_this_build():
    from helpers.devices import cuda_versions, parse_cudnn_version

    versions = cuda_versions()
    assert versions.torch == torch.__version__ and versions.cuda == torch.version.cuda
    assert versions.arch_list == torch.cuda.get_arch_list()
    if torch.backends.cudnn.is_available():
        assert versions.cudnn == parse_cudnn_version(torch.backends.cudnn.version())
    else:
        assert versions.cudnn is None
    assert versions.driver is None or versions.driver[0].isdigit()


class _Distribution:
    def __init__(self, name: str, version: str):
        self.metadata, self.version = {"Name": name}, version


def _fake_environment(monkeypatch, packages, cuda="13.0", smi_output=None):
    """cuda_versions() in a process whose torch was built for `cuda`, with these pip packages and nvidia-smi."""
    import importlib.metadata
    import shutil

    import helpers.devices as devices

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [_Distribution(*p) for p in packages])
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if smi_output is not None else None)
    queries = []

    def run(command, **kwargs):
        queries.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=smi_output or "", stderr="")

    monkeypatch.setattr(devices.subprocess, "run", run)
    return devices.cuda_versions(), queries


def test_cuda_versions_takes_the_packages_of_the_build_s_cuda_major_exactly(monkeypatch):
    packages = [
        ("nvidia-cudnn-frontend", "1.5.0"),  # starts like cuDNN's package, is not it
        ("nvidia-cudnn-cu12", "9.1.0.70"),  # another CUDA major's cuDNN
        ("nvidia_cudnn_cu13", "9.24.0.43"),  # spelled with underscores: the same package to pip
        ("nvidia-cuda-runtime-cu12", "12.8.90"),
        ("nvidia-cuda-runtime", "13.0.96"),
    ]
    versions, _ = _fake_environment(monkeypatch, packages, cuda="13.0")
    assert (versions.cudnn_wheel, versions.runtime_wheel) == ("9.24.0.43", "13.0.96")
    versions, _ = _fake_environment(monkeypatch, packages, cuda="12.8")
    assert (versions.cudnn_wheel, versions.runtime_wheel) == ("9.1.0.70", "12.8.90")
    versions, _ = _fake_environment(monkeypatch, packages[:1], cuda="13.0")
    assert (versions.cudnn_wheel, versions.runtime_wheel) == (None, None)
    versions, _ = _fake_environment(monkeypatch, packages, cuda=None)  # a CPU-only build uses none of them
    assert (versions.cudnn_wheel, versions.runtime_wheel) == (None, None)


def test_cuda_versions_reads_the_driver_field_from_nvidia_smi(monkeypatch):
    versions, queries = _fake_environment(monkeypatch, [], smi_output="580.65.06\n580.65.06\n")
    assert versions.driver == "580.65.06"
    assert "--query-gpu=driver_version" in queries[0] and "--format=csv,noheader" in queries[0]
    versions, _ = _fake_environment(monkeypatch, [], smi_output="No devices were found\n")
    assert versions.driver is None
    versions, queries = _fake_environment(monkeypatch, [], smi_output=None)  # no nvidia-smi at all
    assert versions.driver is None and queries == []


def test_pick_device_auto_is_the_best_available():
    assert pick_device("auto") == pick_device() == pick_device(None)
