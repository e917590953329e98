import math

import pytest
import torch

from helpers import compat
from helpers.mfu import (
    DATASHEET_TFLOPS,
    PRECISIONS,
    datasheet_flops,
    default_matmul_size,
    gpu_model,
    matmul_dtype,
    matmul_flops,
    mfu,
    utilization_line,
)


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L4", "L4"),
        ("Tesla T4", "T4"),
        ("NVIDIA T4", "T4"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA GeForce RTX 3080", "RTX 3080"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("NVIDIA GeForce RTX 4080", "RTX 4080"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("nvidia geforce rtx 4090", "RTX 4090"),  # case
        ("  NVIDIA  GeForce RTX 4090 ", "RTX 4090"),  # stray spaces
    ],
)
def test_gpu_model_maps_cuda_device_names_to_table_rows(name, model):
    assert gpu_model(name) == model
    assert model in DATASHEET_TFLOPS


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA L40S",  # not an L4
        "NVIDIA L40",
        "NVIDIA GeForce RTX 4090 Laptop GPU",  # laptop parts run at other clocks and power
        "NVIDIA GeForce RTX 3080 Laptop GPU",
        "NVIDIA GeForce RTX 4090 D",
        "NVIDIA GeForce RTX 3090 Ti",
        "NVIDIA GeForce RTX 3080 Ti",
        "NVIDIA H100 NVL",  # decided: left out, its figures were printed per pair and per board
        "NVIDIA H200 NVL",
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",  # a slice of the GPU
        "NVIDIA A10G",
        "NVIDIA A100X",
        "NVIDIA GH200 480GB",
        "AMD Instinct MI300X",
        "Tesla V100-SXM3-32GB",
        "",
    ],
)
def test_gpu_model_is_none_for_names_the_table_does_not_know(name):
    assert gpu_model(name) is None


def test_gpu_model_refuses_a_non_string():
    with pytest.raises(TypeError, match="name must be a str"):
        gpu_model(None)


def test_datasheet_rows_are_ordered_and_use_known_precisions():
    for model, figures in DATASHEET_TFLOPS.items():
        assert set(figures) <= set(PRECISIONS), model
        assert "fp32" in figures, model
        assert all(value > 0 for value in figures.values()), model
        for half in ("bf16", "fp16"):
            if half in figures:
                assert figures[half] >= figures.get("tf32", figures["fp32"]), (model, half)
        if "tf32" in figures:
            assert figures["tf32"] >= figures["fp32"], model


def test_datasheet_figures_are_the_dense_ones():
    assert DATASHEET_TFLOPS["A100"]["bf16"] == 312
    assert DATASHEET_TFLOPS["A100"]["tf32"] == 156
    assert DATASHEET_TFLOPS["H100 SXM"]["bf16"] == pytest.approx(989, abs=1)
    assert DATASHEET_TFLOPS["H100 PCIe"]["bf16"] == pytest.approx(756, abs=1)
    assert DATASHEET_TFLOPS["H200"] == DATASHEET_TFLOPS["H100 SXM"]  # the same GH100 compute
    assert DATASHEET_TFLOPS["RTX 4090"]["bf16"] == pytest.approx(2 * DATASHEET_TFLOPS["RTX 4090"]["fp32"], rel=0.01)
    assert DATASHEET_TFLOPS["RTX 3090"]["fp16"] == 71  # FP32 accumulate: half the FP16-accumulate 142


@pytest.mark.parametrize("model", ["T4", "V100 SXM2", "V100 PCIe", "V100S PCIe"])
def test_gpus_before_ampere_have_no_tf32_or_bf16(model):
    assert "tf32" not in DATASHEET_TFLOPS[model]
    assert "bf16" not in DATASHEET_TFLOPS[model]
    assert "fp16" in DATASHEET_TFLOPS[model]


def test_datasheet_flops_on_a_cpu_points_to_the_measured_ceiling():
    peak, why = datasheet_flops("cpu", "bf16")
    assert peak is None
    assert why == "no datasheet peak for a CPU: MFU is taken against the matmul ceiling measured here"
    assert datasheet_flops(torch.device("mps"), "fp32")[0] is None


def _fake_gpu(monkeypatch, name: str) -> list:
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def device_name(device=None) -> str:
        asked.append(device)
        return name

    monkeypatch.setattr(torch.cuda, "get_device_name", device_name)
    return asked


def test_datasheet_flops_on_a_known_gpu(monkeypatch):
    asked = _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB")
    peak, why = datasheet_flops("cuda", "bf16")
    assert peak == 312e12
    assert why == "A100 datasheet, dense bf16: 312 TFLOP/s"
    assert asked == [torch.device("cuda", 0)]  # an indexed device
    assert datasheet_flops(torch.device("cuda", 0), "tf32")[0] == 156e12
    assert datasheet_flops("cuda:0", "fp32")[0] == 19.5e12


def test_datasheet_flops_names_an_unknown_gpu(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA L40S")
    peak, why = datasheet_flops("cuda:0", "bf16")
    assert peak is None
    assert "NVIDIA L40S" in why
    assert "measured here" in why


def test_datasheet_flops_says_when_the_gpu_lacks_the_precision(monkeypatch):
    _fake_gpu(monkeypatch, "Tesla T4")
    peak, why = datasheet_flops("cuda:0", "bf16")
    assert peak is None
    assert "no bf16 on the T4 datasheet" in why
    assert datasheet_flops("cuda:0", "fp16") == (65e12, "T4 datasheet, dense fp16: 65 TFLOP/s")


def test_datasheet_flops_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    peak, why = datasheet_flops("cuda", "bf16")
    assert peak is None
    assert "CUDA is not available" in why


def test_datasheet_flops_refuses_an_unknown_precision_or_device():
    with pytest.raises(ValueError, match=r"precision must be one of \['fp32', 'tf32', 'bf16', 'fp16'\], got 'fp8'"):
        datasheet_flops("cpu", "fp8")
    with pytest.raises(ValueError, match="device must name a device"):
        datasheet_flops("gpu", "fp32")
    with pytest.raises(TypeError, match="device must be a torch.device"):
        datasheet_flops(0, "fp32")


def test_matmul_dtype():
    assert [matmul_dtype(p) for p in PRECISIONS] == [torch.float32, torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ValueError, match="precision must be one of"):
        matmul_dtype("float32")


def test_default_matmul_size_by_device(monkeypatch):
    assert default_matmul_size("cpu") == 1024
    assert default_matmul_size("mps") == 2048
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (70 * 2**30, 80 * 2**30)
    )
    assert default_matmul_size("cuda") == 8192
    assert asked == [torch.device("cuda", 0)]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 16 * 2**30))
    assert default_matmul_size("cuda:0") == 4096
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_matmul_size("cuda:0") == 8192


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_matmul_flops_on_the_cpu_is_a_positive_rate(precision):
    flops = matmul_flops("cpu", precision, size=64, repeat=2)
    assert math.isfinite(flops)
    assert flops > 0


def test_matmul_flops_restores_threads_and_the_fp32_mode():
    threads, mode = torch.get_num_threads(), compat.fp32_precision()
    matmul_flops("cpu", "fp32", size=32, repeat=1, threads=1)
    assert torch.get_num_threads() == threads
    assert compat.fp32_precision() == mode


def test_matmul_flops_runs_tf32_with_tf32_on_and_fp32_with_it_off(monkeypatch):
    modes = []
    monkeypatch.setattr("helpers.mfu.loop.precisions_for", lambda device, tf32=False: ["fp32", "tf32", "bf16"])
    real_mm = torch.mm

    def spying_mm(*args, **kwargs):
        modes.append(compat.fp32_precision()["matmul"])
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", spying_mm)
    matmul_flops("cpu", "tf32", size=8, repeat=1)
    assert set(modes) == {"tf32"}
    modes.clear()
    matmul_flops("cpu", "fp32", size=8, repeat=1)
    assert set(modes) == {"ieee"}


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_matmul_flops_refuses_what_the_cpu_does_not_offer(precision):
    with pytest.raises(ValueError, match=rf"precision must be one of \['fp32', 'bf16'\] on cpu.*got '{precision}'"):
        matmul_flops("cpu", precision, size=8)


def test_matmul_flops_refuses_bad_arguments():
    with pytest.raises(ValueError, match="size must be a positive int or None, got 0"):
        matmul_flops("cpu", "fp32", size=0)
    with pytest.raises(ValueError, match="repeat must be a positive int, got 0"):
        matmul_flops("cpu", "fp32", size=8, repeat=0)
    with pytest.raises(ValueError, match="threads must be a positive int or None, got 0"):
        matmul_flops("cpu", "fp32", size=8, threads=0)
    with pytest.raises(ValueError, match="precision must be one of"):
        matmul_flops("cpu", "int8", size=8)


def test_matmul_flops_refuses_cuda_where_there_is_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        matmul_flops("cuda", "fp32", size=8)


def test_mfu_arithmetic():
    assert mfu(1000, 6e9, 12e12) == 0.5
    assert mfu(0, 6e9, 12e12) == 0
    assert mfu(2_000.0, 1e6, 1e9) == 2.0  # above 1 when the model beats the peak it is held against


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((-1, 6e9, 1e12), "tokens_per_s must be a finite number >= 0, got -1"),
        ((True, 6e9, 1e12), "tokens_per_s must be a finite number >= 0, got True"),
        ((100, 0, 1e12), "flops_per_token must be a finite number above 0, got 0"),
        ((100, -6e9, 1e12), "flops_per_token must be a finite number above 0"),
        ((100, 6e9, 0), "peak_flops must be a finite number above 0, got 0"),
        ((100, 6e9, False), "peak_flops must be a finite number above 0, got False"),
        ((100, 6e9, math.inf), "peak_flops must be a finite number above 0, got inf"),
        ((100, 6e9, "1e12"), "peak_flops must be a finite number above 0"),
    ],
)
def test_mfu_refuses_bad_inputs(arguments, message):
    with pytest.raises(ValueError, match=message):
        mfu(*arguments)


def test_utilization_line_with_a_datasheet_figure():
    line = utilization_line(12_345, 170e6, measured=530e12, datasheet=989.5e12, precision="bf16")
    assert line.startswith("12,345 tokens/s, 2.10 TFLOP/s: MFU ")
    assert "0.0021 of the bf16 datasheet peak (990 TFLOP/s)" in line
    assert "0.004 of the bf16 matmul ceiling measured here (530 TFLOP/s)" in line


def test_utilization_line_without_a_datasheet_figure_uses_gflops_on_a_cpu():
    line = utilization_line(5_000, 4e6, measured=80e9, datasheet=None, precision="fp32")
    assert line == "5,000 tokens/s, 20.0 GFLOP/s: MFU 0.25 of the fp32 matmul ceiling measured here (80.0 GFLOP/s)"
    assert "datasheet" not in line


def test_utilization_line_refuses_bad_peaks():
    with pytest.raises(ValueError, match="measured must be a finite number above 0"):
        utilization_line(1, 1, measured=0, datasheet=None, precision="fp32")
    with pytest.raises(ValueError, match="datasheet must be a finite number above 0"):
        utilization_line(1, 1, measured=1e9, datasheet=-1.0, precision="fp32")
    with pytest.raises(ValueError, match="precision must be one of"):
        utilization_line(1, 1, measured=1e9, datasheet=None, precision="bfloat16")
