"""helpers.compat: each version or build branch, on both sides (the versions given as strings where the other side
is not installed), and a process that sees a build without NCCL."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers import compat


@pytest.mark.parametrize(
    ("version", "expected"),
    [("2.6.0+cu124", (2, 6)), ("2.15.0", (2, 15)), ("2.13.0.dev20260101+cpu", (2, 13)), ("10.0", (10, 0))],
)
def test_torch_version_reads_major_and_minor(version, expected):
    assert compat.torch_version(version) == expected


def test_torch_version_refuses_what_is_not_a_version():
    with pytest.raises(ValueError, match="version"):
        compat.torch_version("nightly")


def test_this_torch_is_at_least_the_floor():
    assert compat.at_least(compat.FLOOR)
    assert compat.torch_version() >= (2, 6)


def test_the_floor_is_the_one_pyproject_declares():
    import re
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parent.parent
    requirement = next(
        r
        for r in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
        if r.startswith("torch>")
    )
    floor = compat.release_name(compat.FLOOR)
    assert re.search(r">=\s*(\d+\.\d+)", requirement)[1] == floor
    pins = (root / "constraints" / "floor.txt").read_text()  # what `make test-floor` installs
    assert re.search(r"^torch==(\d+\.\d+)\.\d+$", pins, re.MULTILINE)[1] == floor


@pytest.mark.parametrize(
    ("version", "sync", "keyword", "at_wrap"),
    [
        ("2.6.0", True, "broadcast_buffers", True),
        ("2.6.0", False, "broadcast_buffers", False),  # the old keyword also skips the wrap's broadcast
        ("2.12.1", False, "broadcast_buffers", False),
        ("2.13.0", False, "forward_sync_buffers", True),  # the new one still broadcasts at the wrap
        ("2.15.0", True, "forward_sync_buffers", True),
    ],
)
def test_ddp_buffer_sync_names_the_keyword_of_each_release(version, sync, keyword, at_wrap):
    assert compat.ddp_buffer_sync(sync, version=version) == {keyword: sync}
    assert compat.ddp_syncs_buffers_at_wrap(sync, version=version) is at_wrap


def test_ddp_buffer_sync_is_a_keyword_this_ddp_takes():
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    (keyword,) = compat.ddp_buffer_sync(False)
    assert keyword in inspect.signature(DistributedDataParallel.__init__).parameters


def test_ddp_buffer_sync_refuses_a_non_bool():
    with pytest.raises(TypeError, match="sync"):
        compat.ddp_buffer_sync(1)


@pytest.mark.parametrize(
    ("device_type", "version", "runs"),
    [("cuda", "2.6.0", True), ("cpu", "2.6.0", False), ("cpu", "2.7.0", True), ("cpu", "2.15.0", True)],
)
def test_fsdp2_runs_on_gpus_from_the_floor_and_on_the_cpu_from_2_7(device_type, version, runs):
    ok, why = compat.fsdp2_runs_on(device_type, version=version)
    assert ok is runs
    assert version in why
    if not runs:
        assert "needs torch 2.7" in why and "GPU" in why


def test_fsdp2_runs_on_refuses_a_device_object():
    with pytest.raises(TypeError, match="device_type"):
        compat.fsdp2_runs_on(torch.device("cpu"))


def test_fp32_precision_switches_and_restores_matmul_and_conv():
    before = compat.fp32_precision()
    try:
        compat.set_fp32_precision(matmul="tf32", conv="ieee")
        assert compat.fp32_precision() == {"matmul": "tf32", "conv": "ieee"}
        with compat.fp32_precision_as("ieee"):
            assert compat.fp32_precision() == {"matmul": "ieee", "conv": "ieee"}
        assert compat.fp32_precision() == {"matmul": "tf32", "conv": "ieee"}
        compat.set_fp32_precision(matmul="ieee")  # None leaves conv alone
        assert compat.fp32_precision() == {"matmul": "ieee", "conv": "ieee"}
    finally:
        compat.set_fp32_precision(**before)
    assert compat.fp32_precision() == before


def test_fp32_precision_follows_torch_s_own_matmul_setting():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert compat.fp32_precision()["matmul"] == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert compat.fp32_precision()["matmul"] == "ieee"
    finally:
        torch.set_float32_matmul_precision(before)


def test_fp32_precision_as_restores_after_an_error():
    before = compat.fp32_precision()
    with pytest.raises(KeyError), compat.fp32_precision_as("tf32"):
        raise KeyError("inside")
    assert compat.fp32_precision() == before


@pytest.mark.parametrize(("matmul", "conv"), [("highest", None), (None, "fp16"), ("TF32", None)])
def test_set_fp32_precision_refuses_unknown_modes(matmul, conv):
    with pytest.raises(ValueError, match="ieee"):
        compat.set_fp32_precision(matmul=matmul, conv=conv)


def test_default_timeouts_are_torch_s_own():
    timeouts = compat.default_timeouts()
    assert timeouts["gloo"] == timeouts["mpi"] == timedelta(minutes=30)
    assert timeouts["nccl"] == (timedelta(minutes=10) if dist.is_nccl_available() else None)


def test_default_timeouts_in_a_build_without_nccl(monkeypatch):
    """PyPI's macOS and Windows wheels: no NCCL, and no nccl default timeout."""
    from torch.distributed import constants

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    monkeypatch.setattr(constants, "default_pg_nccl_timeout", None)
    assert compat.default_timeouts() == {"nccl": None, "gloo": timedelta(minutes=30), "mpi": timedelta(minutes=30)}


@pytest.mark.parametrize(("version", "name"), [("2.6.0", "cache_size_limit"), ("2.7.0", "recompile_limit")])
def test_recompile_limit_name_follows_the_rename_in_2_7(version, name):
    assert compat.recompile_limit_name(version=version) == name


def test_recompile_limit_name_is_a_setting_of_this_torch():
    limit = getattr(torch._dynamo.config, compat.recompile_limit_name())
    assert isinstance(limit, int) and limit > 0


@pytest.mark.parametrize(
    ("device_type", "backend", "version", "accurate"),
    [
        ("cpu", "inductor", "2.6.0", False),
        ("cpu", "inductor", "2.9.1", False),
        ("cpu", "inductor", "2.10.0", True),
        ("cuda", "inductor", "2.6.0", True),  # Triton kernels reduce in a tree
        ("cpu", "aot_eager", "2.6.0", True),  # no kernels of its own: eager mode's
    ],
)
def test_compiled_statistics_accurate_names_the_cpu_kernels_before_2_10(device_type, backend, version, accurate):
    ok, why = compat.compiled_statistics_accurate(device_type, backend, version=version)
    assert ok is accurate
    assert ("torch 2.10" in why) is not accurate and len(why) < 200


def test_fp32_precision_as_leaves_torch_s_own_getters_working():
    """After torch.set_float32_matmul_precision (the old API), switching only the new settings made the old getters
    raise on torch 2.9+ ("a mix of the legacy and new APIs"); torch.compile reads them."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        with compat.fp32_precision_as("tf32"):
            assert torch.get_float32_matmul_precision() == "high"
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    "device_type, version, right",
    [("cpu", "2.6.0", False), ("cpu", "2.6.9+cu124", False), ("cpu", "2.7.0", True), ("cpu", "2.15.0", True),
     ("cuda", "2.6.0", True)],
)  # fmt: skip
def test_compiled_gpt_gradients_are_refused_on_a_cpu_before_2_7(device_type, version, right):
    ok, why = compat.compiled_gpt_gradients_right(device_type, version=version)
    assert ok is right
    assert ("2.7" in why and "upgrade torch" in why) is not right
