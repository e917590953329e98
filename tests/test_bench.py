"""The benchmark's table, ratio and report code on tiny inputs (not the speed itself)."""
import pytest
import torch

from helpers import bench


def test_throughput_ratio_is_hand_time_over_helper_time():
    # helpers take 10% longer in every repetition: 1/1.1 of the throughput
    assert bench.throughput_ratio([1.1, 2.2, 3.3], [1.0, 2.0, 3.0]) == pytest.approx(1 / 1.1)
    with pytest.raises(ValueError):
        bench.throughput_ratio([1.0], [])


def test_machine_line_names_cpu_torch_and_device():
    line = bench.machine_line(bench.machine_info(torch.device("cpu")))
    assert torch.__version__ in line and "device cpu" in line and "cores" in line


def test_notebook_durations_sums_cells_per_notebook(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="notebooks.00_setup_and_devices.ipynb" name="Cell 0" file="notebooks/00_setup_and_devices.ipynb" time="1.5"/>'
        '<testcase classname="notebooks.00_setup_and_devices.ipynb" name="Cell 1" file="notebooks/00_setup_and_devices.ipynb" time="2.0"/>'
        '<testcase classname="notebooks.02_training_loop.ipynb" name="Cell 0" file="notebooks/02_training_loop.ipynb" time="4.0"/>'
        '<testcase classname="tests.test_x" name="test_y" file="tests/test_x.py" time="9.0"/>'
        '</testsuite></testsuites>')
    rows = bench.notebook_durations(report)
    assert rows == [{"notebook": "00_setup_and_devices.ipynb", "seconds": 3.5},
                    {"notebook": "02_training_loop.ipynb", "seconds": 4.0}]


def test_activation_checkpointing_rows_on_a_tiny_stack():
    rows = bench.activation_checkpointing(torch.device("cpu"), width=16, depth=4, batch=8, segments=(0, 2), repeat=1)
    assert [row["segments"] for row in rows] == [0, 2]
    assert rows[0]["saved after forward"] == 5 * 8 * 16 * 4 and rows[0]["memory ratio"] == 1.0
    assert rows[1]["saved after forward"] < rows[0]["saved after forward"]


def test_mixed_precision_rows_on_cpu():
    rows = bench.mixed_precision(torch.device("cpu"), batch=4, repeat=1)
    assert [row["precision"] for row in rows] == ["fp32", "bf16"]
    assert rows[1]["memory ratio"] < 1.0
