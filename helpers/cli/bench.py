"""The package's performance table: `python -m helpers.cli.bench [--quick]` (or `make bench`).

Every figure is measured here and now; comparisons are ratios taken in the same run, in interleaved
repetitions after warm-up, because absolute times differ from machine to machine. On Linux the run
first asks glibc to keep freed memory (`devices.keep_freed_memory`): without that, every CPU step maps
and page-faults its large buffers afresh, which adds about 10% of jitter per epoch on a small machine
(`--default-malloc` leaves the allocator alone, to see the difference).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from helpers.data import DigitsDataset, PngFolderDataset, export_digits_png, make_loader
from helpers.devices import cpu_name, keep_freed_memory, num_threads, seed_everything, sizes_for
from helpers.loop import autocast_context, train_epoch
from helpers.memory import format_bytes, peak_memory, saved_tensors_meter
from helpers.models import MLP, SmallCNN, deep_linear_stack
from helpers.timing import format_table, median, median_ratio, ratio_quartiles, time_interleaved

LOSS = nn.CrossEntropyLoss()
PROJECT = Path(__file__).resolve().parents[2]  # helpers/cli/bench.py -> the project folder


# ---------------------------------------------------------------- ratios and the machine (unit-tested)


def throughput_ratio(helper_seconds: Sequence[float], hand_seconds: Sequence[float]) -> float:
    """Helper throughput / hand-written throughput, as the median of the per-repetition ratios.

    Same work per repetition, so samples/s ratio = hand time / helper time.
    """
    return median_ratio(list(hand_seconds), list(helper_seconds))


def machine_info(device: torch.device) -> dict:
    """What the figures were measured on."""
    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def machine_line(info: dict) -> str:
    """One line naming the machine, printed at the top of every section."""
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ""
    malloc = f", malloc {info['malloc']}" if "malloc" in info else ""
    return (
        f"[{info['cpu']}, {info['cores']} cores, {info['threads']} torch threads, torch {info['torch']}, "
        f"device {info['device']}{gpu}{malloc}]"
    )


def section_sizes(device: torch.device | str, quick: bool) -> dict[str, dict[str, int]]:
    """The model sizes of the checkpointing and mixed-precision sections on `device`.

    On CUDA, the lessons' GPU sizes (`helpers.devices.sizes_for`, as notebooks 04 and 06 use them): the
    deep Linear stack, and an MLP of `depth` hidden layers of `width` on synthetic inputs, large enough for
    tensor cores and for the allocator's peak to show the effect. Elsewhere the CPU bench's own small sizes
    (the SmallCNN on 28x28 images for mixed precision), which keep `--quick` at about a minute.
    """
    if torch.device(device).type == "cuda":
        stack, mlp = sizes_for("checkpointing", device), sizes_for("mixed_precision", device)
        return {
            "checkpointing": {"width": stack["WIDTH"], "depth": stack["DEPTH"], "batch": stack["BATCH_SIZE"]},
            "mixed_precision": {"width": mlp["WIDTH"], "depth": mlp["DEPTH"], "batch": mlp["BATCH_SIZE"]},
        }
    return {
        "checkpointing": dict(width=256, depth=20, batch=128) if quick else dict(width=1024, depth=20, batch=256),
        "mixed_precision": {"batch": 64 if quick else 256},
    }


def cuda_step_peak(step: Callable[[], None], device: torch.device) -> int:
    """Bytes at the CUDA allocator's peak during one call of `step`, measured after one warm-up call
    (so cuBLAS workspaces and other lazily made state are already in place and counted as the baseline)."""
    step()
    with peak_memory(device) as peak:
        step()
    return peak.bytes


# ---------------------------------------------------------------- section 1: loop overhead


def _hand_loop(model, loader, optimizer, device, *, accumulation_steps=1, amp=None, bar=False):
    """The plain loop, written as a learner writes it: the reference the helpers must keep up with."""
    if bar:
        from tqdm.auto import tqdm

        loader = tqdm(loader, leave=False)
    model.train()
    for index, (inputs, targets) in enumerate(loader):
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast_context(device, amp):
            loss = LOSS(model(inputs), targets)
        (loss / accumulation_steps if accumulation_steps > 1 else loss).backward()
        if (index + 1) % accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def repeats_for(seconds_per_call: float, *, budget_s: float, calls_per_round: int, least: int, most: int) -> int:
    """How many timed rounds fit in `budget_s`, kept within [least, most]."""
    if seconds_per_call <= 0:
        return most
    return max(least, min(most, int(budget_s / (calls_per_round * seconds_per_call))))


class LoopCase(NamedTuple):
    """One row of section 1: what is trained, how long an epoch is, and how long the case is timed."""

    name: str
    model: Callable[[], nn.Module]
    image_size: int
    batch_size: int
    options: dict
    samples: int | None  # training samples per epoch: the first ones of the digits' training split (None: all)
    seconds: tuple[float, float]  # timed seconds in a --quick run and in a full run


# The MLP trains on whole epochs of the training split (45 steps), so its fixed per-epoch cost (argument
# checks, the returned figures) counts as much as in a real epoch. The CNN's steps cost 30x more, and on
# a small shared CPU the paired ratio of two epochs wanders by a few percent whatever their length, so its
# median firms up with the number of rounds, not with longer epochs: it runs 2-step epochs, and gets
# the larger share of the time.
LOOP_CASES = [
    LoopCase("MLP, batch 32", MLP, 8, 32, {}, None, (8, 20)),
    LoopCase("CNN 28x28, batch 64", SmallCNN, 28, 64, {}, 128, (10, 60)),
    LoopCase("CNN 28x28, progress bar", SmallCNN, 28, 64, {"bar": True}, 128, (10, 60)),
    LoopCase("MLP, accumulation 4", MLP, 8, 16, {"accumulation_steps": 4}, None, (8, 20)),
    LoopCase("MLP, bf16 autocast", MLP, 8, 32, {"amp": "bf16"}, None, (8, 20)),
]


def loop_overhead(
    device: torch.device,
    *,
    quick: bool = False,
    budget_s: float | None = None,
    samples: int | None = None,
    least: int = 10,
    most: int = 1000,
    warmup: int = 3,
) -> list[dict]:
    """train_epoch against the hand-written loop, same model, data and seed, interleaved.

    Each case is timed for its own seconds (LoopCase.seconds; `budget_s` sets one for all), in at least
    `least` and at most `most` rounds; `samples` sets every case's epoch length instead of its own.
    """
    from torch.utils.data import Subset

    rows = []
    for case in LOOP_CASES:
        digits = DigitsDataset("train", size=case.image_size)
        limit = case.samples if samples is None else samples
        dataset = digits if limit is None else Subset(digits, range(min(limit, len(digits))))
        budget = case.seconds[0 if quick else 1] if budget_s is None else budget_s
        runs = {}
        for who in ("helpers", "hand-written"):
            seed_everything(0)
            model = case.model().to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            loader = make_loader(dataset, batch_size=case.batch_size, shuffle=True, seed=0)
            if who == "helpers":
                runs[who] = functools.partial(
                    train_epoch,
                    model,
                    loader,
                    optimizer,
                    LOSS,
                    device=device,
                    accumulation_steps=case.options.get("accumulation_steps", 1),
                    amp=case.options.get("amp"),
                    progress=case.options.get("bar", False),
                )
            else:
                runs[who] = functools.partial(_hand_loop, model, loader, optimizer, device, **case.options)
        probe = time_interleaved(runs, repeat=1, warmup=warmup, device=device)
        repeat = repeats_for(
            max(max(v) for v in probe.values()), budget_s=budget, calls_per_round=len(runs), least=least, most=most
        )
        seconds = time_interleaved(runs, repeat=repeat, warmup=0, device=device)
        rows.append(
            {
                "case": case.name,
                "samples/epoch": len(dataset),
                "epochs": repeat,
                "hand samples/s": len(dataset) / median(seconds["hand-written"]),
                "helpers samples/s": len(dataset) / median(seconds["helpers"]),
                "ratio": throughput_ratio(seconds["helpers"], seconds["hand-written"]),
                "middle half": "{:.3f}-{:.3f}".format(*ratio_quartiles(seconds["hand-written"], seconds["helpers"])),
            }
        )
    return rows


# ---------------------------------------------------------------- section 2: DataLoader


def dataloader_throughput(
    device: torch.device, *, workers: Iterable[int], batch_sizes: Iterable[int], epochs: int = 2
) -> list[dict]:
    """Samples/s reading the PNG digits from disk, and the start-up of each epoch, over loader settings."""
    import time

    root = export_digits_png(size=28) / "train"
    dataset = PngFolderDataset(root)
    pin_options = (False, True) if device.type == "cuda" else (False,)
    rows = []
    for batch_size in batch_sizes:
        for num_workers in workers:
            for pin in pin_options:
                for persistent in (False, True) if num_workers > 0 else (False,):
                    loader = make_loader(
                        dataset,
                        batch_size=batch_size,
                        shuffle=True,
                        seed=0,
                        num_workers=num_workers,
                        pin_memory=pin,
                        persistent_workers=persistent,
                    )
                    first_batch, total = [], []
                    for _ in range(epochs):
                        start = time.perf_counter()
                        for index, (inputs, _labels) in enumerate(loader):
                            inputs.to(device, non_blocking=pin)
                            if index == 0:
                                first_batch.append(time.perf_counter() - start)
                        total.append(time.perf_counter() - start)
                    del loader
                    rows.append(
                        {
                            "batch": batch_size,
                            "workers": num_workers,
                            "pin_memory": pin,
                            "persistent": persistent,
                            "samples/s": len(dataset) / median(total),
                            "last epoch start (ms)": 1e3 * first_batch[-1],
                        }
                    )
    return rows


# ---------------------------------------------------------------- section 3: activation checkpointing


def activation_checkpointing(
    device: torch.device, *, width: int, depth: int, batch: int, segments: Iterable[int], repeat: int
) -> list[dict]:
    """Saved-activation bytes and step time of a deep Linear stack against checkpoint segment count."""
    from torch.utils.checkpoint import checkpoint_sequential

    seed_everything(0)
    model = deep_linear_stack(width, depth).to(device)
    inputs = torch.randn(batch, width, device=device)

    def step(count: int) -> None:
        output = model(inputs) if count == 0 else checkpoint_sequential(model, count, inputs, use_reentrant=False)
        output.sum().backward()
        model.zero_grad(set_to_none=True)

    steps = {count: (lambda c=count: step(c)) for count in segments}
    seconds = time_interleaved(steps, repeat=repeat, warmup=1, device=device)
    rows = []
    for count in segments:
        with saved_tensors_meter(exclude=model) as meter:
            output = model(inputs) if count == 0 else checkpoint_sequential(model, count, inputs, use_reentrant=False)
            forward_bytes = meter.bytes
            output.sum().backward()
        model.zero_grad(set_to_none=True)
        row = {
            "segments": count,
            "saved after forward": forward_bytes,
            "peak saved in step": meter.peak_bytes,
            "step ms": 1e3 * median(seconds[count]),
        }
        if device.type == "cuda":
            row["CUDA peak"] = cuda_step_peak(steps[count], device)
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["memory ratio"] = row["saved after forward"] / base["saved after forward"]
        row["time ratio"] = median_ratio(seconds[int(row["segments"])], seconds[int(base["segments"])])
        if device.type == "cuda":
            row["peak ratio"] = row["CUDA peak"] / base["CUDA peak"]
    return rows


# ---------------------------------------------------------------- section 4: mixed precision


def mixed_precision(
    device: torch.device, *, batch: int, repeat: int, width: int | None = None, depth: int | None = None
) -> list[dict]:
    """Step time and saved-activation bytes, fp32 against bf16 (and fp16 with GradScaler on CUDA).

    The model is the SmallCNN on 28x28 images, or, given `width` and `depth`, an MLP of `depth` hidden layers
    of `width` on 8x8 inputs (64 features, as in notebook 04); the inputs are random either way. On CUDA each
    precision's row also has the allocator's peak in one forward and backward pass.
    """
    from helpers.loop import precisions_for
    from helpers.rig import precision_steps

    precisions = precisions_for(device)
    seed_everything(0)
    if width is None or depth is None:
        model: nn.Module = SmallCNN(channels=32).to(device)
        inputs = torch.rand(batch, 1, 28, 28, device=device)
    else:
        model = MLP(64, (width,) * depth, 10).to(device)
        inputs = torch.randn(batch, 64, device=device)
    targets = torch.randint(0, 10, (batch,), device=device)
    steps = precision_steps(model, inputs, targets, precisions=precisions, device=device)
    seconds = time_interleaved(steps, repeat=repeat, warmup=2, device=device)
    rows: list[dict[str, Any]] = []
    for name in precisions:
        amp = None if name == "fp32" else name
        with saved_tensors_meter(exclude=model) as meter, autocast_context(device, amp):
            loss = LOSS(model(inputs), targets)
        row = {
            "precision": name,
            "step ms": 1e3 * median(seconds[name]),
            "saved bytes": meter.bytes,
            "time ratio": median_ratio(seconds[name], seconds["fp32"]),
        }
        del loss
        if device.type == "cuda":

            def step(amp: str | None = amp) -> None:
                with autocast_context(device, amp):
                    step_loss = LOSS(model(inputs), targets)
                step_loss.backward()
                model.zero_grad(set_to_none=True)

            row["CUDA peak"] = cuda_step_peak(step, device)
        rows.append(row)
    for row in rows:
        row["memory ratio"] = row["saved bytes"] / rows[0]["saved bytes"]
        if device.type == "cuda":
            row["peak ratio"] = row["CUDA peak"] / rows[0]["CUDA peak"]
    return rows


# ---------------------------------------------------------------- section 5: inference


def inference(device: torch.device, *, batch_sizes: Iterable[int], threads: Iterable[int], repeat: int) -> list[dict]:
    """Latency and throughput against batch size and threads: plain, no_grad and inference_mode."""
    import contextlib

    seed_everything(0)
    model = SmallCNN().to(device).eval()
    modes = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    rows = []
    for count in threads if device.type == "cpu" else [None]:
        with num_threads(count):
            for batch in batch_sizes:
                inputs = torch.rand(batch, 1, 28, 28, device=device)

                def run(mode: str, x: torch.Tensor = inputs) -> None:
                    with modes[mode]():
                        model(x)

                calls = {mode: functools.partial(run, mode) for mode in modes}
                seconds = time_interleaved(calls, repeat=repeat, warmup=2, device=device)
                for mode in modes:
                    latency = median(seconds[mode])
                    rows.append(
                        {
                            "threads": torch.get_num_threads(),
                            "batch": batch,
                            "mode": mode,
                            "latency ms": 1e3 * latency,
                            "samples/s": batch / latency,
                            "speed-up vs plain": median_ratio(seconds["plain"], seconds[mode]),
                        }
                    )
    return rows


# ---------------------------------------------------------------- section 6: notebook suite


def notebook_durations(junit_xml: Path) -> list[dict]:
    """Seconds per notebook (its cells summed) from a pytest JUnit XML report of an nbval run."""
    totals: dict[str, float] = {}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        name = case.get("file") or case.get("classname") or ""
        if ".ipynb" not in name and "ipynb" not in (case.get("classname") or ""):
            continue
        notebook = Path(name.replace(".", "/")).name if not name.endswith(".ipynb") else Path(name).name
        totals[notebook] = totals.get(notebook, 0.0) + float(case.get("time", 0.0))
    return [{"notebook": name, "seconds": seconds} for name, seconds in sorted(totals.items())]


def notebook_suite() -> list[dict]:
    """Run every notebook as the test suite does and report each one's wall time."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "notebooks.xml"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "notebooks", "-q", f"--junitxml={report}", "-o", "junit_family=xunit1"],
            cwd=PROJECT,
            check=False,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(f"the notebook run failed (exit {done.returncode}):\n{done.stdout[-2000:]}")
        rows = notebook_durations(report)
    rows.append({"notebook": "total", "seconds": sum(r["seconds"] for r in rows)})
    return rows


# ---------------------------------------------------------------- the command


def _sections(device: torch.device, quick: bool) -> list[tuple[str, Callable[[], list[dict]], list[str]]]:
    repeat = 12 if quick else 40
    sizes = section_sizes(device, quick)
    stack, precision = sizes["checkpointing"], sizes["mixed_precision"]
    cuda_peak = ["CUDA peak", "peak ratio"] if device.type == "cuda" else []
    if "width" in precision:
        precision_model = f"MLP, {precision['depth']} x {precision['width']}, batch {precision['batch']}"
    else:
        precision_model = f"SmallCNN, 28x28, batch {precision['batch']}"
    return [
        (
            "1. Loop overhead (helpers.loop.train_epoch vs the hand-written loop)",
            lambda: loop_overhead(device, quick=quick),
            ["case", "samples/epoch", "epochs", "hand samples/s", "helpers samples/s", "ratio", "middle half"],
        ),
        (
            "2. DataLoader on PNG files",
            lambda: dataloader_throughput(
                device, workers=(0, 2) if quick else (0, 1, 2), batch_sizes=(64,) if quick else (32, 128), epochs=2
            ),
            ["batch", "workers", "pin_memory", "persistent", "samples/s", "last epoch start (ms)"],
        ),
        (
            f"3. Activation checkpointing (deep Linear stack, {stack['depth']} x {stack['width']}, batch {stack['batch']})",
            lambda: activation_checkpointing(device, segments=(0, 2, 5, 10), repeat=max(3, repeat // 4), **stack),
            [
                "segments",
                "saved after forward",
                "peak saved in step",
                "memory ratio",
                "step ms",
                "time ratio",
                *cuda_peak,
            ],
        ),
        (
            f"4. Mixed precision ({precision_model})",
            lambda: mixed_precision(device, repeat=max(3, repeat // 2), **precision),
            ["precision", "step ms", "time ratio", "saved bytes", "memory ratio", *cuda_peak],
        ),
        (
            "5. Inference (SmallCNN, 28x28)",
            lambda: inference(
                device,
                batch_sizes=(1, 64) if quick else (1, 16, 64, 256),
                threads=sorted({1, os.cpu_count() or 1}),
                repeat=repeat,
            ),
            ["threads", "batch", "mode", "latency ms", "samples/s", "speed-up vs plain"],
        ),
    ]


def _bytes_columns(rows: list[dict]) -> list[dict]:
    keys = ("saved after forward", "peak saved in step", "saved bytes", "CUDA peak")
    return [{k: (format_bytes(v) if k in keys else v) for k, v in row.items()} for row in rows]


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the suite, print a table per section and a summary, write the figures as JSON."""
    from tqdm.auto import tqdm

    parser = argparse.ArgumentParser(prog="python -m helpers.cli.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run, under a minute on a 2-core CPU")
    parser.add_argument("--json", default=str(PROJECT / "bench-results.json"), help="where to write the figures")
    parser.add_argument("--skip-notebooks", action="store_true", help="leave out section 6 (the notebook suite)")
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's malloc as it is (by default freed memory is kept: steady CPU timings)",
    )
    args = parser.parse_args(argv)
    kept = False if args.default_malloc else keep_freed_memory()

    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    malloc = "keeps freed memory" if kept else "as the system sets it"
    results: dict = {"quick": args.quick, "machines": {}, "sections": {}}
    plan = [(device, *section) for device in devices for section in _sections(device, args.quick)]
    with tqdm(total=len(plan) + (0 if args.quick or args.skip_notebooks else 1), desc="bench", unit="section") as bar:
        for device, title, run, columns in plan:
            info = {**machine_info(device), "malloc": malloc}
            results["machines"][device.type] = info
            bar.set_postfix_str(f"{title.split('(')[0].strip()} on {device.type}")
            rows = [{"device": device.type, **row} for row in run()]
            results["sections"].setdefault(title, []).extend(rows)
            tqdm.write(f"\n{format_table(_bytes_columns(rows), columns, title=f'{title} on {device.type}')}")
            tqdm.write(machine_line(info))
            bar.update(1)
        if not args.quick and not args.skip_notebooks:
            title = "6. Notebook suite (wall time under the test run)"
            bar.set_postfix_str("notebook suite")
            rows = notebook_suite()
            results["sections"][title] = rows
            tqdm.write(f"\n{format_table(rows, ['notebook', 'seconds'], title=title)}")
            tqdm.write(machine_line(machine_info(devices[0])))  # the notebooks ran in their own processes
            bar.update(1)
    if args.quick or args.skip_notebooks:
        print("\n6. Notebook suite: skipped (run without --quick, or see `make test`'s durations)")

    def section_rows(number: str) -> list[dict]:  # a section's rows on every device (titles name each one's sizes)
        return [row for title, rows in results["sections"].items() if title.startswith(number) for row in rows]

    loop_rows, checkpoint_rows, precision_rows = section_rows("1."), section_rows("3."), section_rows("4.")
    worst = min(row["ratio"] for row in loop_rows)
    results["summary"] = {"loop_ratio_min": worst}
    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print("\nSummary")
    last = devices[-1].type
    checkpoint_rows = [row for row in checkpoint_rows if row["device"] == last]
    ten = max(checkpoint_rows, key=lambda row: row["segments"])
    bf16 = next(row for row in precision_rows if row["precision"] == "bf16" and row["device"] == last)
    print(
        f"  on {last}: activation checkpointing, {ten['segments']} segments: {ten['memory ratio']:.3f}x the saved bytes, "
        f"{ten['time ratio']:.3f}x the step time"
    )
    print(f"  bf16 autocast: {bf16['memory ratio']:.3f}x the saved bytes, {bf16['time ratio']:.3f}x the step time")
    if "peak ratio" in ten and "peak ratio" in bf16:
        print(
            f"  CUDA allocator peak: {ten['peak ratio']:.3f}x with {ten['segments']} checkpoint segments, "
            f"{bf16['peak ratio']:.3f}x with bf16 autocast"
        )
    print(f"  figures written to {args.json}")
    print(f"loop throughput ratio (helpers/hand-written): {worst:.3f}")
    return results


if __name__ == "__main__":
    main()
