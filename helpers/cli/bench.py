"""The package's performance table: `python -m helpers.cli.bench [--quick]` (or `make bench`).

The notebooks' experiments, run by the rig they use (`helpers.rig.measure`), with its columns: time per unit and its
middle half, the time ratio to the first variant with the middle half of the per-round ratios (all taken in one run,
in interleaved rounds after warm-up, CUDA synchronized before each reading of the clock), bytes saved for backward,
and on CUDA each call's own allocator peak (above what was allocated when it began). `--quick` runs fewer rounds,
on the best device only (the GPU where there is one), on CUDA a quarter of the lessons' batch, and leaves out the
torch.compile section, whose cold compile alone takes tens of seconds: it says what the last full run measured. On Linux, glibc is first asked to keep freed memory
(`devices.keep_freed_memory`): about 10% less jitter in CPU epochs (`--default-malloc` leaves the allocator alone).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential
from torch.utils.data import Subset

from helpers.compat import compiled_gpt_gradients_right
from helpers.data import DigitsDataset, PngFolderDataset, export_digits_png, make_loader
from helpers.devices import cpu_name, keep_freed_memory, num_threads, seed_everything
from helpers.loop import autocast_context, precision_steps, precisions_for, train_epoch
from helpers.models import MLP, SmallCNN, deep_linear_stack
from helpers.progress import progress_bar
from helpers.rig import Measurement, measure
from helpers.sizes import sizes_for
from helpers.timing import format_table, time_call

LOSS = nn.CrossEntropyLoss()
PROJECT = Path(__file__).resolve().parents[2]  # helpers/cli/bench.py -> the project folder
Table = tuple[str, Measurement]  # a caption and what was measured under it


def machine_info(device: torch.device) -> dict:
    """What the figures were measured on."""
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    info |= {"device": str(device), "python": platform.python_version()}
    return info | ({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})


def machine_line(info: dict) -> str:
    """One line naming the machine, printed under every section."""
    extras = "".join(f", {label} {info[key]}" for key, label in (("gpu", "GPU"), ("malloc", "malloc")) if key in info)
    where = f"{info['cores']} cores, {info['threads']} torch threads, torch {info['torch']}, device {info['device']}"
    return f"[{info['cpu']}, {where}{extras}]"


def lesson_sizes(lesson: str, device: torch.device, quick: bool = False) -> dict[str, Any]:
    """A lesson's sizes on `device` ('mixed_precision', 'checkpointing') as keywords; `quick` on CUDA: batch / 4."""
    sizes = {name.lower().removesuffix("_size"): size for name, size in sizes_for(lesson, device).items()}
    return sizes | ({"batch": max(1, sizes["batch"] // 4)} if quick and device.type == "cuda" else {})


# ---------------------------------------------------------------- 1. the loop's overhead (notebook 03's claim)
def hand_loop(model, loader, optimizer, device, *, accumulation_steps=1, amp=None, progress=False):
    """The plain loop, written as a learner writes it: the reference the helpers must keep up with."""
    loader = progress_bar(loader, enabled=progress, leave=False)  # as train_epoch: shown only where someone watches
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
    per_round = calls_per_round * seconds_per_call
    return most if per_round <= 0 else max(least, min(most, int(budget_s / per_round)))


class LoopCase(NamedTuple):
    """One loop comparison: what is trained, how long an epoch is, and how long the case is timed."""

    name: str
    model: Callable[[], nn.Module]
    image_size: int
    batch_size: int
    options: dict  # accumulation_steps, amp, progress: as train_epoch and hand_loop take them
    samples: int | None  # training samples per epoch: the first ones of the digits' training split (None: all)
    seconds: tuple[float, float]  # timed seconds in a --quick run and in a full run


# The MLP trains whole epochs (45 steps), so its fixed per-epoch cost counts as in a real epoch. The CNN's steps
# cost 30x more and the paired ratio of two epochs wanders by a few percent whatever their length, so its median
# firms up with the number of rounds: it runs 2-step epochs and gets the larger share of the time.
LOOP_CASES = [
    LoopCase("MLP, batch 32", MLP, 8, 32, {}, None, (8, 20)),
    LoopCase("CNN 28x28, batch 64", SmallCNN, 28, 64, {}, 128, (10, 60)),
    LoopCase("CNN 28x28, progress bar", SmallCNN, 28, 64, {"progress": True}, 128, (10, 60)),
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
) -> list[Table]:
    """train_epoch vs the hand-written loop: same model, data and seed, an epoch per call, interleaved. Each case is
    timed for its own seconds (`budget_s`: one for all) in [least, most] rounds; `samples`: every epoch's length."""
    tables = []
    for case in LOOP_CASES:
        digits = DigitsDataset("train", size=case.image_size)
        limit = case.samples if samples is None else samples
        dataset = digits if limit is None else Subset(digits, range(min(limit, len(digits))))
        epochs = {}
        for who, train in (("hand-written", hand_loop), ("helpers", functools.partial(train_epoch, loss_fn=LOSS))):
            seed_everything(0)
            model = case.model().to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            loader = make_loader(dataset, batch_size=case.batch_size, shuffle=True, seed=0)
            options = {"progress": False, **case.options}  # the same options for both
            epochs[who] = functools.partial(train, model, loader, optimizer, device=device, **options)
        probe = measure(epochs, device=device, repeat=1, warmup=warmup, unit="epoch")
        longest = max(max(result.seconds) for result in probe.results.values())
        budget = case.seconds[0 if quick else 1] if budget_s is None else budget_s
        rounds = repeats_for(longest, budget_s=budget, calls_per_round=len(epochs), least=least, most=most)
        caption = f"{case.name}: {len(dataset)} samples per epoch, {rounds} rounds"
        tables.append((caption, measure(epochs, device=device, repeat=rounds, warmup=0, unit="epoch")))
    return tables


# ---------------------------------------------------------------- 2. DataLoader (notebook 02's experiment)
def dataloader_throughput(device: torch.device, *, workers: Iterable[int], batch_sizes: Iterable[int]) -> list[Table]:
    """An epoch over the PNG digits on disk, by loader settings (workers, persistent workers, pinned memory)."""
    dataset = PngFolderDataset(export_digits_png(size=28) / "train")
    pins, tables = (False, True) if device.type == "cuda" else (False,), []
    for batch_size in batch_sizes:
        epochs = {}
        for count, pin, persistent in itertools.product(workers, pins, (False, True)):
            if count > 0 or not persistent:  # persistent workers need workers
                name = f"{count} workers" + (", persistent" if persistent else "") + (", pinned" if pin else "")
                options = {"num_workers": count, "pin_memory": pin, "persistent_workers": persistent}
                loader = make_loader(dataset, batch_size=batch_size, shuffle=True, seed=0, **options)
                epochs[name] = functools.partial(_read_epoch, loader, device, pin)
        # measure synchronizes CUDA after each epoch, so the clock includes the last non-blocking copy
        measured = measure(epochs, device=device, repeat=3, warmup=1, unit="epoch")
        tables.append((f"batch {batch_size}, {len(dataset)} PNG files per epoch", measured))
    return tables


def _read_epoch(loader, device: torch.device, non_blocking: bool) -> None:
    for inputs, _ in loader:
        inputs.to(device, non_blocking=non_blocking)


# ---------------------------------------------------------------- 3. activation checkpointing (notebook 10's)
def activation_checkpointing(
    device: torch.device, *, width: int, depth: int, batch: int, repeat: int, segments: Sequence[int] = (0, 2, 5, 10)
) -> list[Table]:
    """A step of notebook 10's deep Linear stack by checkpoint segment count (0: none): time, saved bytes, CUDA peak."""
    seed_everything(0)
    model, inputs = deep_linear_stack(width, depth).to(device), torch.randn(batch, width, device=device)

    def step(count: int) -> None:
        output = model(inputs) if count == 0 else checkpoint_sequential(model, count, inputs, use_reentrant=False)
        output.sum().backward()
        model.zero_grad(set_to_none=True)

    steps = {count: functools.partial(step, count) for count in segments}
    labels = {count: f"{count} segments" if count else "none" for count in segments}
    measured = measure(steps, device=device, repeat=repeat, warmup=1, saved_tensors=True, exclude=model, labels=labels)
    return [(f"{depth} x Linear {width}, batch {batch}", measured)]


# ---------------------------------------------------------------- 4. mixed precision (notebook 06's)
def mixed_precision(device: torch.device, *, width: int, depth: int, batch: int, repeat: int) -> list[Table]:
    """A training step of notebook 06's MLP on 64 random features, in each precision worth comparing on `device`."""
    seed_everything(0)
    model, inputs, targets = MLP(64, (width,) * depth, 10), torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    steps = precision_steps(model, inputs, targets, precisions=precisions_for(device), device=device)
    measured = measure(steps, device=device, repeat=repeat, saved_tensors=True)  # the weights are not counted
    return [(f"MLP, {depth} x {width}, batch {batch}", measured)]


# ---------------------------------------------------------------- 5. inference (notebook 12's and 15's)
def inference(device: torch.device, *, batch_sizes: Iterable[int], threads: Iterable[int], repeat: int) -> list[Table]:
    """A forward pass of the SmallCNN: plain, no_grad and inference_mode, by thread count and batch size."""
    seed_everything(0)
    model = SmallCNN().to(device).eval()
    no_grad, inference_mode = torch.no_grad()(model.__call__), torch.inference_mode()(model.__call__)
    modes, tables = {"plain": model.__call__, "no_grad": no_grad, "inference_mode": inference_mode}, []
    for count in threads if device.type == "cpu" else [None]:
        with num_threads(count):
            for batch in batch_sizes:
                inputs = torch.rand(batch, 1, 28, 28, device=device)
                calls = {mode: functools.partial(forward, inputs) for mode, forward in modes.items()}
                measured = measure(calls, device=device, repeat=repeat, warmup=2, unit="batch")
                tables.append((f"{torch.get_num_threads()} threads, batch {batch}", measured))
    return tables


# ---------------------------------------------------------------- 6. torch.compile (the closing lesson's)
def compiled_training(device: torch.device, *, batch: int, repeat: int) -> list[Table]:
    """A training step (train_epoch over one batch) of the SmallCNN on 28x28 images, eager and torch.compile'd; the
    first call of each, which compiles the compiled one, is timed apart and named in the caption."""
    seed_everything(0)
    model, one_batch = SmallCNN(), [(torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,)))]
    replicas = {name: copy.deepcopy(model).to(device) for name in ("eager", "compiled")}
    replicas["compiled"].compile()  # in place: its forward runs under torch.compile, its parameters stay its own
    train, steps, first = functools.partial(train_epoch, loss_fn=LOSS, device=device, progress=False), {}, []
    for name, replica in replicas.items():
        steps[name] = functools.partial(train, replica, one_batch, torch.optim.SGD(replica.parameters(), lr=0.01))
        first.append(f"{name} {time_call(steps[name], repeat=1, warmup=0, device=device)[0]:.2f} s")
    caption = f"SmallCNN 28x28, batch {batch}; first call: {', '.join(first)}"
    return [(caption, measure(steps, device=device, repeat=repeat))]


# ---------------------------------------------------------------- 7. optimizer implementations (the closing lesson's)
ADAMW_IMPLEMENTATIONS = {"for-loop": (False, False), "foreach": (True, False), "fused": (False, True)}  # foreach, fused


def optimizer_implementations(device: torch.device, *, models: dict[str, Callable], repeat: int) -> list[Table]:
    """AdamW's step per implementation, each on its own copy of each model holding the same fixed random gradients:
    time per step, and how far the copies' weights lie apart after the same steps (the most from the for-loop's)."""
    tables = []
    for caption, build in models.items():
        seed_everything(0)
        model, steps, replicas = build().to(device), {}, {}
        gradients = [torch.randn_like(parameter) for parameter in model.parameters()]
        for name, (foreach, fused) in ADAMW_IMPLEMENTATIONS.items():
            replicas[name] = replica = copy.deepcopy(model)
            for parameter, gradient in zip(replica.parameters(), gradients):
                parameter.grad = gradient.clone()
            steps[name] = torch.optim.AdamW(replica.parameters(), lr=1e-3, foreach=foreach, fused=fused).step
        measured, reference = measure(steps, device=device, repeat=repeat), list(replicas["for-loop"].parameters())
        apart = max((a - b).abs().max().item() for r in replicas.values() for a, b in zip(reference, r.parameters()))
        tables.append((f"{caption}; weights after the same steps differ by at most {apart:.1e}", measured))
    return tables


# ---------------------------------------------------------------- 9. the capstone's ladder (notebook 16)
def gpt_ladder(
    device: torch.device, *, quick: bool, repeat: int, steps_per_call: int = 4, text: str | None = None
) -> list[Table]:
    """The capstone GPT at its sizes for the device, a plain fp32 step and then the course's switches one at a time
    (fused AdamW, TF32 where the GPU has it, 16-bit autocast, torch.compile but in --quick): tokens per second, and
    each rung's MFU against the matmul ceiling measured here in its precision, named in the caption. `text`: the
    corpus (a file or folder); None: the capstone's, the standard library's source."""
    from helpers.cli.train_gpt import Config, build, train_step
    from helpers.gpt import flops_per_token
    from helpers.mfu import matmul_flops, mfu

    sizes = sizes_for("capstone", device)
    offered = precisions_for(device, tf32=True)
    sixteen = "bf16" if "bf16" in offered else "fp16"
    shape: dict[str, Any] = {
        "n_layer": sizes["N_LAYER"],
        "n_embd": sizes["N_EMBD"],
        "n_head": sizes["N_EMBD"] // sizes["HEAD_SIZE"],
    }
    batch = max(1, sizes["BATCH_SIZE"] // 4) if quick and device.type == "cuda" else sizes["BATCH_SIZE"]
    config = Config(block_size=sizes["BLOCK_SIZE"], batch_size=batch, **shape, text=text, progress=False)
    changes: list[tuple[str, dict[str, Any]]] = [("fp32 eager", {}), ("+ fused AdamW", {"fused_adamw": True})]
    changes += [("+ TF32", {"precision": "tf32"})] if "tf32" in offered else []
    compiles = not quick and compiled_gpt_gradients_right(device.type)[0]  # torch 2.6 on a CPU: a wrong gradient
    changes += [(f"+ {sixteen}", {"precision": sixteen})] + ([("+ compile", {"compile": True})] if compiles else [])
    calls, precisions = {}, {}
    for name, change in changes:
        config = dataclasses.replace(config, **change)
        run = build(config, device)
        batches, precisions[name] = run.batches(), config.precision
        calls[name] = functools.partial(lambda r, b: [train_step(r, b) for _ in range(steps_per_call)], run, batches)
    per = steps_per_call * run.tokens_per_step
    measured = measure(calls, device=device, repeat=repeat, warmup=1, per=per, unit="token")
    ceilings = {precision: matmul_flops(device, precision) for precision in set(precisions.values())}
    per_token = flops_per_token(config.model_config())
    shares = [
        f"{name} {mfu(1e3 / measured.median_ms(name), per_token, ceilings[precisions[name]]):.2f}" for name in calls
    ]
    caption = f"GPT {sum(p.numel() for p in run.module.parameters()) / 1e6:.1f}M, {sizes}; MFU vs the matmul ceiling: "
    return [(caption + ", ".join(shares), measured)]


# ---------------------------------------------------------------- 8. notebook suite
def notebook_durations(junit_xml: Path) -> list[dict]:
    """Seconds per notebook (its cells summed) from a pytest JUnit XML report of an nbval run."""
    totals: defaultdict[str, float] = defaultdict(float)
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        if case.get("file", "").endswith(".ipynb"):
            totals[Path(case.get("file", "")).name] += float(case.get("time", 0.0))
    return [{"notebook": name, "seconds": seconds} for name, seconds in sorted(totals.items())]


def notebook_suite() -> list[dict]:
    """Run every notebook as the test suite does and report each one's wall time."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "notebooks.xml"
        pytest = ["-m", "pytest", "notebooks", "-q", "-o", "junit_family=xunit1", f"--junitxml={report}"]
        done = subprocess.run([sys.executable, *pytest], cwd=PROJECT, check=False, capture_output=True, text=True)
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(f"the notebook run failed (exit {done.returncode}):\n{done.stdout[-2000:]}")
        rows = notebook_durations(report)
    return [*rows, {"notebook": "total", "seconds": sum(r["seconds"] for r in rows)}]


# ---------------------------------------------------------------- the command
def _sections(device: torch.device, quick: bool) -> list[tuple[str, Callable[[], list[Table]]]]:
    """The sections to run on `device`; `quick` leaves out section 6, whose cold compile alone takes tens of seconds
    (main says what it cost in the last full run instead)."""
    sections = _all_sections(device, quick)
    return [section for section in sections if not (quick and section[0].startswith("6."))]


def cold_compile_note(previous: dict | None) -> str:
    """What --quick says instead of section 6: the first compiled call of the last full run whose figures are in
    `previous` (the JSON the bench writes), or how to measure it."""
    rows = [] if not previous or previous.get("quick") else previous.get("sections", {}).get("6. torch.compile", [])
    firsts = [(row["device"], re.search(r"compiled (\d+\.\d+) s", row["measured"])) for row in rows]
    seen = {device: float(found[1]) for device, found in firsts if found}
    if seen:
        costs = ", ".join(f"{seconds:.1f} s on {device}" for device, seconds in seen.items())
        return f"6. torch.compile: left out of --quick; the last full run here compiled its first call in {costs}"
    return "6. torch.compile: left out of --quick; a cold compile takes tens of seconds: `make bench` measures it"


def _all_sections(device: torch.device, quick: bool) -> list[tuple[str, Callable[[], list[Table]]]]:
    repeat, threads, cpu = 12 if quick else 40, sorted({1, os.cpu_count() or 1}), device.type == "cpu"
    stack, mlp = lesson_sizes("checkpointing", device, quick), lesson_sizes("mixed_precision", device, quick)
    loader = {"workers": (0, 2), "batch_sizes": (64,)} if quick else {"workers": (0, 1, 2), "batch_sizes": (32, 128)}
    inference_batches = (1, 64) if quick else (1, 16, 64, 256)
    deep_stack = functools.partial(deep_linear_stack, stack["width"], stack["depth"])
    models: dict[str, Callable] = {"SmallCNN": SmallCNN, f"{stack['depth']} x Linear {stack['width']}": deep_stack}
    return [
        ("1. Loop overhead (train_epoch vs the hand-written loop)", lambda: loop_overhead(device, quick=quick)),
        ("2. DataLoader on PNG files", lambda: dataloader_throughput(device, **loader)),
        ("3. Activation checkpointing", lambda: activation_checkpointing(device, repeat=max(3, repeat // 4), **stack)),
        ("4. Mixed precision", lambda: mixed_precision(device, repeat=max(3, repeat // 2), **mlp)),
        ("5. Inference", lambda: inference(device, batch_sizes=inference_batches, threads=threads, repeat=repeat)),
        ("6. torch.compile", lambda: compiled_training(device, batch=64 if cpu else 512, repeat=repeat)),
        ("7. AdamW: for-loop, foreach, fused", lambda: optimizer_implementations(device, models=models, repeat=repeat)),
        ("9. The capstone GPT's ladder", lambda: gpt_ladder(device, quick=quick, repeat=max(5, repeat // 4))),
    ]


def summary_lines(tables: dict[str, list[Table]], device: str) -> list[str]:
    """The headline ratios on `device`: checkpointing at the most segments, bf16, torch.compile, fused AdamW."""
    last = {key.split()[0]: found[-1][1] for key, found in tables.items() if key.endswith(f" {device}") and found}
    most, lines = max(last["3"].results), []
    headlines = [("3", most, f"on {device}: activation checkpointing, {most} segments"), ("4", "bf16", "bf16 autocast")]
    for section, name, label in [*headlines, ("6", "compiled", "torch.compile"), ("7", "fused", "fused AdamW")]:
        measured = last.get(section)
        if measured is not None and name in measured.results:
            memory = f"{measured.memory_ratio(name):.3f}x the saved bytes, " if measured[name].saved_bytes else ""
            lines.append(f"  {label}: {memory}{measured.time_ratio(name):.3f}x the step time")
    return lines


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the suite, print a table per measurement and a summary, write the figures as JSON."""
    parser = argparse.ArgumentParser(prog="python -m helpers.cli.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run, about a minute on a 2-core CPU or a GPU")
    parser.add_argument(
        "--json",
        default=None,
        help="where to write the figures (default: bench-results.json, or "
        "bench-results-quick.json with --quick, so that a quick run keeps the full run's file)",
    )
    parser.add_argument("--skip-notebooks", action="store_true", help="leave out section 8 (the notebook suite)")
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's malloc as the system sets it")
    args = parser.parse_args(argv)
    malloc = "as the system sets it" if args.default_malloc or not keep_freed_memory() else "keeps freed memory"
    devices = [torch.device("cpu")] + (
        [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else []
    )
    if args.quick:
        devices = devices[-1:]  # the device one would train on: the GPU where there is one
    full_run = PROJECT / "bench-results.json"
    args.json = args.json or str(full_run.with_name("bench-results-quick.json") if args.quick else full_run)
    previous = json.loads(full_run.read_text()) if args.quick and full_run.is_file() else None
    results: dict = {"quick": args.quick, "machines": {}, "sections": {}}
    tables: dict[str, list[Table]] = {}
    plan = [(device, *section) for device in devices for section in _sections(device, args.quick)]
    with progress_bar(total=len(plan), desc="bench", unit="section") as bar:
        for device, title, run in plan:
            results["machines"][device.type] = info = {**machine_info(device), "malloc": malloc}
            tables[f"{title.split('.')[0]} {device.type}"] = measured = run()
            bar.write(f"\n{title} on {device.type}")
            for caption, measurement in measured:
                bar.write(measurement.table(f"{caption}; ratios against {measurement.label(measurement.baseline)!r}"))
                rows = [{"device": device.type, "measured": caption, **row} for row in measurement.rows()]
                results["sections"].setdefault(title, []).extend(rows)
            bar.write(machine_line(info))
            bar.update(1)
    if args.quick:
        print(f"\n{cold_compile_note(previous)}")
    if args.quick or args.skip_notebooks:
        print("\n8. Notebook suite: skipped (run without --quick, or see `make test`'s durations)")
    else:
        title = "8. Notebook suite (wall time under the test run)"
        rows = results["sections"][title] = notebook_suite()
        print(f"\n{format_table(rows, ['notebook', 'seconds'], title=title)}")
    # the helpers' throughput over the hand-written loop's = the median per-round time ratio hand / helpers
    worst = min(m.time_ratio("hand-written", against="helpers") for d in devices for _, m in tables[f"1 {d.type}"])
    results["summary"] = {"loop_ratio_min": worst}
    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print("\nSummary", *summary_lines(tables, devices[-1].type), f"  figures written to {args.json}", sep="\n")
    print(f"loop throughput ratio (helpers/hand-written): {worst:.3f}")
    return results


if __name__ == "__main__":
    main()
