"""The benchmark's table, ratio and report code on tiny inputs (not the speed itself)."""

import json

import pytest
import torch

from helpers.cli import bench
from helpers.data import DigitsDataset


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
        "<testsuites><testsuite>"
        '<testcase classname="notebooks.00_setup_and_devices.ipynb" name="Cell 0" file="notebooks/00_setup_and_devices.ipynb" time="1.5"/>'
        '<testcase classname="notebooks.00_setup_and_devices.ipynb" name="Cell 1" file="notebooks/00_setup_and_devices.ipynb" time="2.0"/>'
        '<testcase classname="notebooks.02_training_loop.ipynb" name="Cell 0" file="notebooks/02_training_loop.ipynb" time="4.0"/>'
        '<testcase classname="tests.test_x" name="test_y" file="tests/test_x.py" time="9.0"/>'
        "</testsuite></testsuites>"
    )
    rows = bench.notebook_durations(report)
    assert rows == [
        {"notebook": "00_setup_and_devices.ipynb", "seconds": 3.5},
        {"notebook": "02_training_loop.ipynb", "seconds": 4.0},
    ]


@pytest.mark.slow
def test_activation_checkpointing_rows_on_a_tiny_stack():
    rows = bench.activation_checkpointing(torch.device("cpu"), width=16, depth=4, batch=8, segments=(0, 2), repeat=1)
    assert [row["segments"] for row in rows] == [0, 2]
    assert rows[0]["saved after forward"] == 5 * 8 * 16 * 4 and rows[0]["memory ratio"] == 1.0
    assert rows[1]["saved after forward"] < rows[0]["saved after forward"]


@pytest.mark.slow
def test_mixed_precision_rows_on_cpu():
    rows = bench.mixed_precision(torch.device("cpu"), batch=4, repeat=1)
    assert [row["precision"] for row in rows] == ["fp32", "bf16"]
    assert rows[1]["memory ratio"] < 1.0


def test_section_sizes_on_cuda_come_from_the_lessons_sizes():
    from helpers.devices import sizes_for

    def lower(sizes):  # WIDTH, DEPTH, BATCH_SIZE -> width, depth, batch
        return {name.lower().removesuffix("_size"): size for name, size in sizes.items()}

    for quick in (True, False):
        sizes = bench.section_sizes(torch.device("cuda"), quick)  # only chooses: no CUDA needed
        assert sizes["checkpointing"] == lower(sizes_for("checkpointing", "cuda"))
        assert sizes["mixed_precision"] == lower(sizes_for("mixed_precision", "cuda"))
    assert bench.section_sizes("cuda:1", True) == bench.section_sizes(torch.device("cuda"), True)


def test_section_sizes_on_cpu_stay_the_benchs_small_ones():
    quick, full = bench.section_sizes(torch.device("cpu"), True), bench.section_sizes(torch.device("cpu"), False)
    assert quick == {"checkpointing": {"width": 256, "depth": 20, "batch": 128}, "mixed_precision": {"batch": 64}}
    assert full == {"checkpointing": {"width": 1024, "depth": 20, "batch": 256}, "mixed_precision": {"batch": 256}}
    assert bench.section_sizes("mps", True) == quick


def test_cuda_step_peak_resets_after_a_warm_up_step_and_reads_the_peak_after_the_measured_one(monkeypatch):
    calls = []
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(bench.torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(bench.torch.cuda, "memory_allocated", lambda device=None: calls.append("allocated") or 100)
    monkeypatch.setattr(bench.torch.cuda, "max_memory_allocated", lambda device=None: calls.append("peak") or 123)
    assert bench.cuda_step_peak(lambda: calls.append("step"), torch.device("cuda")) == 123
    assert calls == ["step", "synchronize", "reset", "allocated", "step", "synchronize", "peak"]


@pytest.mark.slow
def test_mixed_precision_rows_for_an_mlp_on_cpu():
    rows = bench.mixed_precision(torch.device("cpu"), batch=4, repeat=1, width=16, depth=2)
    assert [row["precision"] for row in rows] == ["fp32", "bf16"]
    assert rows[0]["saved bytes"] > 0 and "CUDA peak" not in rows[0]


def test_repeats_for_fits_the_budget_within_bounds():
    assert bench.repeats_for(0.01, budget_s=1.0, calls_per_round=2, least=3, most=1000) == 50
    assert bench.repeats_for(10.0, budget_s=1.0, calls_per_round=2, least=3, most=1000) == 3
    assert bench.repeats_for(1e-6, budget_s=1.0, calls_per_round=2, least=3, most=40) == 40
    assert bench.repeats_for(0.0, budget_s=1.0, calls_per_round=2, least=3, most=40) == 40


@pytest.mark.slow
def test_loop_overhead_gives_one_row_per_case_on_a_tiny_run():
    rows = bench.loop_overhead(torch.device("cpu"), budget_s=0.0, samples=64, least=2, most=2, warmup=1)
    assert [row["case"] for row in rows] == [case.name for case in bench.LOOP_CASES]
    for row in rows:
        assert row["epochs"] == 2 and row["samples/epoch"] == 64
        assert row["hand samples/s"] > 0 and row["helpers samples/s"] > 0 and row["ratio"] > 0
        # the quartiles are printed to 3 decimals; rounding keeps order, so compare the ratio rounded alike
        first, third = map(float, row["middle half"].split("-"))
        assert first <= round(row["ratio"], 3) <= third


@pytest.mark.slow
def test_loop_overhead_times_each_case_on_its_own_epoch_length():
    rows = bench.loop_overhead(torch.device("cpu"), budget_s=0.0, least=1, most=1, warmup=0)
    whole = len(DigitsDataset("train"))
    assert [row["samples/epoch"] for row in rows] == [case.samples or whole for case in bench.LOOP_CASES]


@pytest.mark.slow
@pytest.mark.parametrize("quick", [True, False])
def test_loop_overhead_gives_each_case_its_own_time(monkeypatch, quick):
    asked = []
    monkeypatch.setattr(bench, "repeats_for", lambda seconds, *, budget_s, **bounds: asked.append(budget_s) or 1)
    bench.loop_overhead(torch.device("cpu"), quick=quick, samples=32, warmup=0)
    assert asked == [case.seconds[0 if quick else 1] for case in bench.LOOP_CASES]


@pytest.mark.slow
def test_main_prints_tables_writes_json_and_ends_with_the_loop_ratio(tmp_path, monkeypatch, capsys):
    def tiny_sections(device, quick):
        def loop():
            return [
                {"case": "a", "epochs": 3, "ratio": bench.throughput_ratio([1.25, 2.5], [1.0, 2.0])},
                {"case": "b", "epochs": 3, "ratio": 1.0},
            ]

        return [
            ("1. Loop", loop, ["case", "epochs", "ratio"]),
            (
                "3. Checkpointing",
                lambda: [
                    {"segments": 0, "memory ratio": 1.0, "time ratio": 1.0},
                    {"segments": 10, "memory ratio": 0.5, "time ratio": 1.5},
                ],
                ["segments", "memory ratio", "time ratio"],
            ),
            (
                "4. Precision",
                lambda: [{"precision": "bf16", "memory ratio": 0.5, "time ratio": 2.0}],
                ["precision", "memory ratio", "time ratio"],
            ),
        ]

    monkeypatch.setattr(bench, "_sections", tiny_sections)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    results = bench.main(["--quick", "--default-malloc", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "1. Loop on cpu" in out and "segments" in out and "malloc as the system sets it" in out
    assert out.rstrip().splitlines()[-1] == "loop throughput ratio (helpers/hand-written): 0.800"
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["summary"]["loop_ratio_min"] == pytest.approx(0.8) == results["summary"]["loop_ratio_min"]
    assert [row["case"] for row in saved["sections"]["1. Loop"]] == ["a", "b"]


def test_the_project_folder_is_found_from_the_cli_package():
    assert (bench.PROJECT / "notebooks").is_dir() and (bench.PROJECT / "pyproject.toml").is_file()
