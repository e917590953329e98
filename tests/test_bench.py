"""The benchmark's sections, report and summary on tiny inputs (not the speed itself)."""

import json
import re

import pytest
import torch

from helpers import compat
from helpers.cli import bench
from helpers.data import DigitsDataset
from helpers.rig import Measurement, Result


def test_machine_line_names_cpu_torch_and_device():
    line = bench.machine_line(bench.machine_info(torch.device("cpu")))
    assert torch.__version__ in line and "device cpu" in line and "cores" in line


def test_machine_line_adds_the_gpu_and_the_allocator_when_known():
    info = {"cpu": "C", "cores": 2, "threads": 2, "torch": "2.x", "device": "cuda", "gpu": "G", "malloc": "kept"}
    assert bench.machine_line(info) == "[C, 2 cores, 2 torch threads, torch 2.x, device cuda, GPU G, malloc kept]"
    del info["gpu"]
    assert bench.machine_line(info).endswith("device cuda, malloc kept]")


def test_notebook_durations_sums_cells_per_notebook(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        "<testsuites><testsuite>"
        '<testcase classname="notebooks.00_setup_and_devices.ipynb" name="Cell 0" file="notebooks/00_setup_and_devices.ipynb" time="1.5"/>'
        '<testcase classname="notebooks.00_setup_and_devices.ipynb" name="Cell 1" file="notebooks/00_setup_and_devices.ipynb" time="2.0"/>'
        '<testcase classname="notebooks.03_training_loop.ipynb" name="Cell 0" file="notebooks/03_training_loop.ipynb" time="4.0"/>'
        '<testcase classname="tests.test_x" name="test_y" file="tests/test_x.py" time="9.0"/>'
        "</testsuite></testsuites>"
    )
    rows = bench.notebook_durations(report)
    assert rows == [
        {"notebook": "00_setup_and_devices.ipynb", "seconds": 3.5},
        {"notebook": "03_training_loop.ipynb", "seconds": 4.0},
    ]


@pytest.mark.slow
def test_activation_checkpointing_on_a_tiny_stack_meters_the_saved_bytes():
    ((caption, measured),) = bench.activation_checkpointing(
        torch.device("cpu"), width=16, depth=4, batch=8, segments=(0, 2), repeat=1
    )
    assert caption == "4 x Linear 16, batch 8" and list(measured.results) == [0, 2]
    assert measured[0].saved_bytes == 5 * 8 * 16 * 4  # the input and each block's output, float32
    assert measured.memory_ratio(2) < 1.0 and measured.label(0) == "none"


@pytest.mark.slow
def test_mixed_precision_compares_the_precisions_of_this_device():
    ((caption, measured),) = bench.mixed_precision(torch.device("cpu"), width=16, depth=2, batch=64, repeat=1)
    assert caption == "MLP, 2 x 16, batch 64" and list(measured.results) == ["fp32", "bf16"]
    assert measured.memory_ratio("bf16") < 1.0 and measured["fp32"].cuda_peak_bytes is None


def test_lesson_sizes_are_the_notebooks_sizes_as_keyword_arguments():
    from helpers.sizes import sizes_for

    for lesson in ("checkpointing", "mixed_precision"):
        for device in ("cpu", "cuda"):  # only chooses: no CUDA needed
            sizes = sizes_for(lesson, device)
            expected = {"width": sizes["WIDTH"], "depth": sizes["DEPTH"], "batch": sizes["BATCH_SIZE"]}
            assert bench.lesson_sizes(lesson, torch.device(device)) == expected


def test_quick_runs_a_quarter_of_the_batch_on_cuda_only():
    for lesson in ("checkpointing", "mixed_precision"):
        full = bench.lesson_sizes(lesson, torch.device("cuda"))
        assert bench.lesson_sizes(lesson, torch.device("cuda"), quick=True) == full | {"batch": full["batch"] // 4}
        cpu = torch.device("cpu")
        assert bench.lesson_sizes(lesson, cpu, quick=True) == bench.lesson_sizes(lesson, cpu)


def test_sections_pass_quick_to_the_sizes_and_include_compile_and_adamw(monkeypatch):
    asked = []
    monkeypatch.setattr(
        bench, "lesson_sizes", lambda lesson, device, quick: asked.append(quick) or {"width": 8, "depth": 2}
    )
    quick, full = ([title for title, _ in bench._sections(torch.device("cuda"), q)] for q in (True, False))
    assert [title.split(".")[0] for title in full] == ["1", "2", "3", "4", "5", "6", "7", "9"]
    assert "torch.compile" in full[5] and "AdamW" in full[6] and "GPT" in full[7]
    assert quick == full[:5] + full[6:]  # the cold compile is left out of --quick
    assert asked == [True, True, False, False]


@pytest.mark.slow  # compiles a GPT step in the full run's ladder
@pytest.mark.parametrize("quick", [True, False])
def test_gpt_ladder_adds_the_switches_one_at_a_time_and_names_each_rungs_mfu(monkeypatch, tmp_path, quick):
    """The capstone's ladder on a tiny GPT: fp32 eager, fused AdamW, bf16 on a CPU, compile only in a full run."""
    tiny = {"N_LAYER": 1, "N_EMBD": 16, "HEAD_SIZE": 8, "BLOCK_SIZE": 16, "BATCH_SIZE": 2}
    monkeypatch.setattr(bench, "sizes_for", lambda lesson, device: tiny)
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path))
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x\n" * 2000)
    monkeypatch.setattr("helpers.mfu.matmul_flops", lambda device, precision: 1e9)
    [(caption, measured)] = bench.gpt_ladder(
        torch.device("cpu"), quick=quick, repeat=3, steps_per_call=1, text=str(text)
    )
    compiles = not quick and compat.compiled_gpt_gradients_right("cpu")[0]
    rungs = ["fp32 eager", "+ fused AdamW", "+ bf16", *(["+ compile"] if compiles else [])]
    assert list(measured.results) == rungs and measured.unit == "token"
    assert "MFU vs the matmul ceiling: fp32 eager " in caption and all(name in caption for name in rungs)


def test_quick_names_the_cold_compile_of_the_last_full_run_or_how_to_measure_it():
    def run(quick: bool, rows: list) -> dict:
        return {"quick": quick, "sections": {"6. torch.compile": rows}}

    row = {"device": "cpu", "measured": "SmallCNN 28x28, batch 64; first call: eager 0.12 s, compiled 31.47 s"}
    cuda = {"device": "cuda", "measured": "SmallCNN 28x28, batch 512; first call: eager 1.00 s, compiled 12.00 s"}
    assert bench.cold_compile_note(run(False, [row, row, cuda])).endswith("first call in 31.5 s on cpu, 12.0 s on cuda")
    for previous in (None, run(True, [row]), run(False, []), {"quick": False, "sections": {}}):
        assert "`make bench` measures it" in bench.cold_compile_note(previous)


COLUMNS = ["variant", "ms/step", "middle half (ms)", "time ratio", "ratio middle half"]  # the rig's, on CPU


@pytest.mark.slow
def test_compiled_training_times_eager_and_compiled_steps_and_the_first_calls_apart():
    ((caption, measured),) = bench.compiled_training(torch.device("cpu"), batch=4, repeat=1)
    assert re.fullmatch(r"SmallCNN 28x28, batch 4; first call: eager \d+\.\d\d s, compiled \d+\.\d\d s", caption)
    assert list(measured.results) == ["eager", "compiled"] and measured.baseline == "eager"
    assert [list(row) for row in measured.rows()] == [COLUMNS, COLUMNS]
    assert all(len(result.seconds) == 1 for result in measured.results.values())


def _weights_apart(caption: str) -> float:
    found = re.search(r"differ by at most (\S+)$", caption)
    assert found, caption
    return float(found.group(1))


@pytest.mark.slow
def test_adamw_implementations_reach_the_same_weights_and_give_the_rigs_columns():
    models = {"linear": lambda: torch.nn.Linear(5, 3), "stack": lambda: bench.deep_linear_stack(4, 3)}
    tables = bench.optimizer_implementations(torch.device("cpu"), models=models, repeat=2)
    assert [caption.split(";")[0] for caption, _ in tables] == ["linear", "stack"]
    for caption, measured in tables:
        assert list(measured.results) == ["for-loop", "foreach", "fused"] and measured.baseline == "for-loop"
        assert [list(row) for row in measured.rows()] == [COLUMNS] * 3
        assert _weights_apart(caption) <= 1e-6  # after 2 warm-up and 2 timed steps each


@pytest.mark.slow
def test_adamw_implementations_report_weights_that_went_apart(monkeypatch):
    adamw = torch.optim.AdamW

    def faster_when_fused(parameters, lr, *, foreach, fused):  # a planted bug: the fused copy gets 10x the lr
        return adamw(parameters, lr=lr * (10 if fused else 1), foreach=foreach, fused=fused)

    monkeypatch.setattr(bench.torch.optim, "AdamW", faster_when_fused)
    ((caption, _),) = bench.optimizer_implementations(
        torch.device("cpu"), models={"m": lambda: torch.nn.Linear(5, 3)}, repeat=1
    )
    assert _weights_apart(caption) > 1e-3


@pytest.mark.slow
def test_inference_compares_the_three_modes_per_thread_count_and_batch():
    tables = bench.inference(torch.device("cpu"), batch_sizes=(1, 4), threads=(1,), repeat=1)
    assert [caption for caption, _ in tables] == ["1 threads, batch 1", "1 threads, batch 4"]
    assert all(list(measured.results) == ["plain", "no_grad", "inference_mode"] for _, measured in tables)


@pytest.mark.slow
def test_dataloader_throughput_names_each_loader_setting():
    ((caption, measured),) = bench.dataloader_throughput(torch.device("cpu"), workers=(0, 1), batch_sizes=(256,))
    assert caption.startswith("batch 256, ") and caption.endswith(" PNG files per epoch")
    assert list(measured.results) == ["0 workers", "1 workers", "1 workers, persistent"] and measured.unit == "epoch"


def test_repeats_for_fits_the_budget_within_bounds():
    assert bench.repeats_for(0.01, budget_s=1.0, calls_per_round=2, least=3, most=1000) == 50
    assert bench.repeats_for(10.0, budget_s=1.0, calls_per_round=2, least=3, most=1000) == 3
    assert bench.repeats_for(1e-6, budget_s=1.0, calls_per_round=2, least=3, most=40) == 40
    assert bench.repeats_for(0.0, budget_s=1.0, calls_per_round=2, least=3, most=40) == 40


@pytest.mark.slow
def test_loop_overhead_gives_one_measurement_per_case_on_a_tiny_run():
    tables = bench.loop_overhead(torch.device("cpu"), budget_s=0.0, samples=64, least=2, most=2, warmup=1)
    assert [caption.split(":")[0] for caption, _ in tables] == [case.name for case in bench.LOOP_CASES]
    for caption, measured in tables:
        assert caption.endswith("64 samples per epoch, 2 rounds")
        assert list(measured.results) == ["hand-written", "helpers"] and measured.unit == "epoch"
        assert all(len(result.seconds) == 2 for result in measured.results.values())


@pytest.mark.slow
def test_loop_overhead_times_each_case_on_its_own_epoch_length():
    tables = bench.loop_overhead(torch.device("cpu"), budget_s=0.0, least=1, most=1, warmup=0)
    whole = len(DigitsDataset("train"))
    assert all(f"{case.samples or whole} samples" in caption for (caption, _), case in zip(tables, bench.LOOP_CASES))


@pytest.mark.slow
@pytest.mark.parametrize("quick", [True, False])
def test_loop_overhead_gives_each_case_its_own_time(monkeypatch, quick):
    asked = []
    monkeypatch.setattr(bench, "repeats_for", lambda seconds, *, budget_s, **bounds: asked.append(budget_s) or 1)
    bench.loop_overhead(torch.device("cpu"), quick=quick, samples=32, warmup=0)
    assert asked == [case.seconds[0 if quick else 1] for case in bench.LOOP_CASES]


def _measured(seconds: dict, saved: dict | None = None) -> Measurement:
    results = {name: Result(name, values, (saved or {}).get(name)) for name, values in seconds.items()}
    return Measurement(torch.device("cpu"), results, baseline=next(iter(seconds)))


def test_main_prints_tables_writes_json_and_ends_with_the_loop_ratio(tmp_path, monkeypatch, capsys):
    def tiny_sections(device, quick):
        loops = [  # the helpers take 25% longer in one case: 0.8 of the hand-written throughput
            ("case a", _measured({"hand-written": [1.0, 2.0, 3.0], "helpers": [1.25, 2.5, 3.75]})),
            ("case b", _measured({"hand-written": [1.0, 1.0, 1.0], "helpers": [1.0, 1.0, 1.0]})),
        ]
        stack = _measured({0: [1.0, 1.0, 1.0], 10: [1.5, 1.5, 1.5]}, saved={0: 100, 10: 50})
        precision = _measured({"fp32": [1.0, 1.0, 1.0], "bf16": [2.0, 2.0, 2.0]}, saved={"fp32": 100, "bf16": 50})
        compiled = _measured({"eager": [1.0, 1.0, 1.0], "compiled": [0.6, 0.6, 0.6]})
        adamw = [  # the summary quotes the last table: the model with the most parameter tensors
            ("cnn", _measured({"for-loop": [1.0, 1.0, 1.0], "foreach": [0.5, 0.5, 0.5], "fused": [0.5, 0.5, 0.5]})),
            ("stack", _measured({"for-loop": [1.0, 1.0, 1.0], "foreach": [0.3, 0.3, 0.3], "fused": [0.2, 0.2, 0.2]})),
        ]
        return [
            ("1. Loop", lambda: loops),
            ("3. Checkpointing", lambda: [("stack", stack)]),
            ("4. Precision", lambda: [("mlp", precision)]),
            ("6. Compile", lambda: [("cnn", compiled)]),
            ("7. AdamW", lambda: adamw),
        ]

    monkeypatch.setattr(bench, "_sections", tiny_sections)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    results = bench.main(["--quick", "--default-malloc", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "1. Loop on cpu" in out and "case a; ratios against 'hand-written'" in out and "x1.25" in out
    assert "malloc as the system sets it" in out and "\r" not in out  # no progress-bar redraws in a log
    assert "10 segments: 0.500x the saved bytes, 1.500x the step time" in out
    assert "bf16 autocast: 0.500x the saved bytes, 2.000x the step time" in out
    assert "torch.compile: 0.600x the step time" in out and "fused AdamW: 0.200x the step time" in out
    assert (
        "8. Notebook suite: skipped" in out and "7. AdamW on cpu" in out and "stack; ratios against 'for-loop'" in out
    )
    assert out.rstrip().splitlines()[-1] == "loop throughput ratio (helpers/hand-written): 0.800"
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["summary"]["loop_ratio_min"] == pytest.approx(0.8) == results["summary"]["loop_ratio_min"]
    assert [row["measured"] for row in saved["sections"]["1. Loop"]] == ["case a", "case a", "case b", "case b"]
    assert saved["sections"]["1. Loop"][1]["time ratio"] == pytest.approx(1.25)


def test_the_project_folder_is_found_from_the_cli_package():
    assert (bench.PROJECT / "notebooks").is_dir() and (bench.PROJECT / "pyproject.toml").is_file()


def test_summary_leaves_out_the_sections_that_did_not_run():
    stack = _measured({0: [1.0], 10: [2.0]}, saved={0: 100, 10: 25})
    precision = _measured({"fp32": [1.0]}, saved={"fp32": 100})  # a device without bf16
    lines = bench.summary_lines({"3 cpu": [("stack", stack)], "4 cpu": [("mlp", precision)]}, "cpu")
    assert lines == ["  on cpu: activation checkpointing, 10 segments: 0.250x the saved bytes, 2.000x the step time"]
