"""A training run you can kill at any moment and start again: it continues from its newest checkpoint.

    python -m helpers.cli.resume --folder checkpoints/demo --steps 120 --save-every 10

Kill it (Ctrl-C, `kill -9`) and run the same command again: it resumes in the middle of an epoch if it
must, and ends with the same weights, bit for bit, as a run that was never interrupted. It prints
`saved step N <file> (validation loss L)` after each checkpoint. A newest checkpoint that cannot be read
(a bad copy, a disk error) is set aside as `<name>.corrupt`, with a `skipped ...` line saying why, and the
run resumes from the newest one that loads. Notebook 11 writes the same run out by hand.

A checkpoint records the settings that shape its run (seed, total steps, dropout, batch size, model and
optimizer). Resuming with other settings is refused, naming each one and both values, because the run would
silently be a different one (another seed changes nothing once the random state is restored; another total keeps
the old learning-rate schedule). `--as-saved` continues with the checkpoint's settings instead; `--extend`
lengthens a run to a larger `--steps`, the cosine schedule re-planned over the new total (from the step reached,
the learning rate follows the longer run's curve, so it rises again if the old run had decayed it).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, random_split

from helpers.checkpoint import (
    CheckpointManager,
    ResumableSampler,
    SkippedCheckpointWarning,
    UnreadableCheckpointError,
    read_checkpoint,
)
from helpers.checks import check_choice, check_int
from helpers.data import DigitsDataset
from helpers.devices import seed_everything
from helpers.loop import evaluate
from helpers.models import MLP

LR, WEIGHT_DECAY, HIDDEN = 3e-3, 1e-4, (64, 64)  # AdamW's and the model's, the same in every run
MISMATCH = ("refuse", "as-saved", "extend")  # what a resume with other settings than its checkpoint's does


class RunSettingsError(ValueError):
    """A resume asked for other settings than the checkpoint's run."""


def run_settings(*, steps: int, seed: int, dropout: float, batch_size: int) -> dict:
    """The settings that shape a run, as its checkpoints record them (`save_every` only says where they land)."""
    model = f"MLP(64, {HIDDEN}, 10)"
    return {"seed": seed, "steps": steps, "dropout": dropout, "batch_size": batch_size, "model": model,
            "optimizer": f"AdamW(lr={LR}, weight_decay={WEIGHT_DECAY}), cosine to 0 over the steps"}  # fmt: skip


def saved_settings(manager: CheckpointManager) -> dict | None:
    """The settings recorded by the newest checkpoint in the folder that reads (None: none, or none recorded)."""
    for path in reversed(manager.checkpoints()):
        try:
            return read_checkpoint(path)["extra"].get("settings")
        except UnreadableCheckpointError:
            continue  # load_latest sets it aside, and says so
    return None


def reconcile(asked: dict, saved: dict | None, on_mismatch: str = "refuse") -> dict:
    """The settings to run with: `asked` when they match `saved` (or nothing was saved); otherwise, by `on_mismatch`,
    a RunSettingsError naming each differing setting and both values ('refuse'), the checkpoint's ('as-saved'), or
    `asked` where only `steps` grew ('extend')."""
    check_choice("on_mismatch", on_mismatch, MISMATCH)
    differing = {name: (saved[name], value) for name, value in asked.items() if saved and saved.get(name) != value}
    if not differing:
        return asked
    if on_mismatch == "as-saved":
        return dict(saved or asked)
    if on_mismatch == "extend" and set(differing) == {"steps"} and asked["steps"] > differing["steps"][0]:
        return asked
    listed = "; ".join(f"{name}: the checkpoint's {was!r}, asked {now!r}" for name, (was, now) in differing.items())
    why = "only steps may grow with --extend" if on_mismatch == "extend" else "resuming would run another run"
    raise RunSettingsError(
        f"the checkpoint holds a run with other settings ({listed}): {why}. Run with the checkpoint's settings, "
        "or pass --as-saved to continue with them, --extend to lengthen the run (steps only), or use a new --folder"
    )


@dataclass
class Run:
    """What one training run is made of: the model and everything whose state a checkpoint keeps."""

    settings: dict
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.CosineAnnealingLR
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    generator: torch.Generator  # the DataLoader's: its state is part of the data order
    loader: DataLoader
    val_loader: DataLoader


def build_run(settings: dict) -> Run:
    """The run of `settings` (run_settings) from its first step: data split, seeded model, optimizer, schedule."""
    steps, seed, dropout, batch_size = (settings[name] for name in ("steps", "seed", "dropout", "batch_size"))
    # The training digits, split once by the seed: a part to train on and a validation part that scores each
    # checkpoint (and picks the best). The test split is never looked at here.
    dataset, val_part = random_split(
        DigitsDataset("train"), [0.85, 0.15], generator=torch.Generator().manual_seed(seed)
    )
    seed_everything(seed)  # python, numpy and torch: the weights below, then the dropout masks
    model = MLP(64, HIDDEN, 10, dropout=dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    scaler = torch.amp.GradScaler("cpu")  # a float16 run needs one; in float32 it scales by 2**16 and back
    sampler = ResumableSampler(len(dataset), seed=seed)
    # A DataLoader without its own generator draws a seed from the global RNG each time it is iterated:
    # a resumed run would then get other dropout masks than one that never stopped.
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=generator)
    val_loader = DataLoader(val_part, batch_size=256, generator=torch.Generator())
    return Run(settings, model, optimizer, scheduler, scaler, sampler, generator, loader, val_loader)


def replan_schedule(run: Run, step: int) -> None:
    """Lengthen the cosine to run.settings['steps']: from `step` on, the learning rate follows the longer curve."""
    steps = run.settings["steps"]
    run.scheduler.T_max = steps
    for group, base in zip(run.optimizer.param_groups, run.scheduler.base_lrs):
        group["lr"] = base * (1 + math.cos(math.pi * step / steps)) / 2


def train_from_latest(run: Run, manager: CheckpointManager, *, stop: int, save_every: int, extended: bool) -> tuple:
    """Resume `run` from the newest checkpoint in `manager`'s folder that reads (if any), train it to step `stop`,
    saving every `save_every` steps and at `stop`. Returns (steps done, the step it resumed from or None)."""
    step, consumed, resumed_from = 0, 0, None
    # The newest checkpoint that reads: an unreadable newer one (a bad copy, a disk error) is set aside.
    state = manager.load_latest(run.model, run.optimizer, run.scheduler, run.scaler, generator=run.generator)
    for skipped in manager.skipped:
        print(f"skipped {skipped['path']} (set aside as {skipped['moved_to'].name}): {skipped['reason']}", flush=True)
    if state is not None:
        step = resumed_from = state["step"]
        run.sampler.load_state_dict(state["extra"]["sampler"])  # the epoch's order, and how far into it
        consumed = state["extra"]["sampler"]["offset"]
        if extended:
            replan_schedule(run, step)
    loss_fn = nn.CrossEntropyLoss()
    run.model.train()
    while step < stop:
        for inputs, targets in run.loader:
            loss = loss_fn(run.model(inputs), targets)
            run.optimizer.zero_grad(set_to_none=True)
            run.scaler.scale(loss).backward()
            run.scaler.step(run.optimizer)
            run.scaler.update()
            run.scheduler.step()  # after the optimizer: step k ran at the schedule's k-th rate
            step, consumed = step + 1, consumed + len(targets)
            if step % save_every == 0 or step == stop:
                val_loss = evaluate(run.model, run.val_loader, loss_fn, device="cpu").loss  # eval mode: no RNG drawn
                path = manager.save(
                    run.model,
                    run.optimizer,
                    run.scheduler,
                    run.scaler,
                    step=step,
                    epoch=run.sampler.epoch,
                    metric=val_loss,
                    generator=run.generator,
                    extra={"sampler": run.sampler.state_dict(consumed), "settings": run.settings},
                )
                print(f"saved step {step} {path} (validation loss {val_loss:.6f})", flush=True)
            consumed %= run.sampler.num_samples  # 0 when the epoch is over
            if step == stop:
                break
    return step, resumed_from


def train(
    folder: str | Path,
    *,
    steps: int = 120,
    save_every: int = 10,
    seed: int = 0,
    dropout: float = 0.1,
    batch_size: int = 32,
    stop_after: int | None = None,
    on_mismatch: str = "refuse",
) -> dict:
    """Train the digits MLP for `steps` AdamW steps on CPU, checkpointing into `folder`; resume if it holds one.

    It trains on 85% of the training digits and scores every checkpoint on the other 15% (validation).
    Saves every `save_every` steps and at the end (or at `stop_after`, then returns, as if stopped there).
    A folder holding a run with other settings: `on_mismatch` (see `reconcile`).
    """
    for name, value in (
        ("steps", steps),
        ("save_every", save_every),
        ("batch_size", batch_size),
        ("stop_after", steps if stop_after is None else stop_after),
    ):
        check_int(name, value)
    manager = CheckpointManager(folder, keep_last=2, mode="min")
    saved = saved_settings(manager)
    settings = reconcile(
        run_settings(steps=steps, seed=seed, dropout=dropout, batch_size=batch_size), saved, on_mismatch
    )
    if stop_after is not None and stop_after > settings["steps"]:
        raise ValueError(f"stop_after must be at most steps={settings['steps']}, got {stop_after}")
    run = build_run(settings)
    extended = saved is not None and settings["steps"] != saved["steps"]
    stop = settings["steps"] if stop_after is None else stop_after
    steps_done, resumed_from = train_from_latest(run, manager, stop=stop, save_every=save_every, extended=extended)
    return {
        "settings": settings,
        "model": run.model,
        "optimizer": run.optimizer,
        "scheduler": run.scheduler,
        "scaler": run.scaler,
        "steps_done": steps_done,
        "resumed_from": resumed_from,
        "manager": manager,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: train (or resume) the run in --folder."""
    parser = argparse.ArgumentParser(prog="python -m helpers.cli.resume", description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, help="checkpoint folder (resumes from its newest file)")
    parser.add_argument("--steps", type=int, default=120, help="total optimizer steps of the run")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every this many steps")
    parser.add_argument("--seed", type=int, default=0, help="any int in [0, 2**32 - 1]")
    parser.add_argument("--dropout", type=float, default=0.1, help="in [0, 1)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads: the same in every run compared")
    mismatch = parser.add_mutually_exclusive_group()
    mismatch.add_argument("--as-saved", action="store_true", help="continue with the checkpoint's settings")
    mismatch.add_argument("--extend", action="store_true", help="lengthen the run to --steps, schedule re-planned")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", SkippedCheckpointWarning)  # train() prints one line per skipped file
    on_mismatch = "as-saved" if args.as_saved else "extend" if args.extend else "refuse"
    try:
        result = train(
            args.folder,
            steps=args.steps,
            save_every=args.save_every,
            seed=args.seed,
            dropout=args.dropout,
            on_mismatch=on_mismatch,
        )
    except RunSettingsError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"done: step {result['steps_done']} (resumed from {result['resumed_from']})", flush=True)


def command_line(
    folder: str | Path,
    *,
    steps: int = 120,
    save_every: int = 10,
    seed: int = 0,
    dropout: float = 0.1,
    threads: int = 1,
) -> list[str]:
    """The command that runs `train(folder, ...)` in a fresh Python process, as `subprocess` takes it."""
    options = {"folder": folder, "steps": steps, "save-every": save_every, "seed": seed, "dropout": dropout}
    options["threads"] = threads  # a bit-identical resume needs the thread count of the run it is compared with
    return [sys.executable, "-m", "helpers.cli.resume", *(f"--{name}={value}" for name, value in options.items())]


def validation_losses(log: str) -> dict[int, float]:
    """Every save's validation loss, by step, from the `saved step N <file> (validation loss L)` lines of a log."""
    saves = re.findall(r"^saved step (\d+) .*\(validation loss ([-+\d.eE]+|nan|inf)\)$", log, re.MULTILINE)
    return {int(step): float(loss) for step, loss in saves}


if __name__ == "__main__":
    main()
