"""A training run you can kill at any moment and start again: it continues from its newest checkpoint.

    python -m helpers.cli.resume --folder checkpoints/demo --steps 120 --save-every 10

Kill it (Ctrl-C, `kill -9`) and run the same command again: it resumes in the middle of an epoch if it
must, and ends with the same weights, bit for bit, as a run that was never interrupted. It prints
`saved step N <file> (validation loss L)` after each checkpoint. A newest checkpoint that cannot be read
(a bad copy, a disk error) is set aside as `<name>.corrupt`, with a `skipped ...` line saying why, and the
run resumes from the newest one that loads. Notebook 09 writes the same run out by hand.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, random_split

from helpers.checkpoint import CheckpointManager, ResumableSampler, SkippedCheckpointWarning
from helpers.checks import check_int
from helpers.data import DigitsDataset
from helpers.devices import seed_everything
from helpers.loop import evaluate
from helpers.models import MLP


def train(
    folder: str | Path,
    *,
    steps: int = 120,
    save_every: int = 10,
    seed: int = 0,
    dropout: float = 0.1,
    batch_size: int = 32,
    stop_after: int | None = None,
) -> dict:
    """Train the digits MLP for `steps` AdamW steps on CPU, checkpointing into `folder`; resume if it holds one.

    It trains on 85% of the training digits and scores every checkpoint on the other 15% (validation).

    Saves every `save_every` steps and at the end (or at `stop_after`, then returns, as if stopped there).
    """
    for name, value in (
        ("steps", steps),
        ("save_every", save_every),
        ("batch_size", batch_size),
        ("stop_after", steps if stop_after is None else stop_after),
    ):
        check_int(name, value)
    if stop_after is not None and stop_after > steps:
        raise ValueError(f"stop_after must be at most steps={steps}, got {stop_after}")
    # The training digits, split once by the seed: a part to train on and a validation part that scores each
    # checkpoint (and picks the best). The test split is never looked at here.
    dataset, val_part = random_split(
        DigitsDataset("train"), [0.85, 0.15], generator=torch.Generator().manual_seed(seed)
    )
    seed_everything(seed)  # python, numpy and torch: the weights below, then the dropout masks
    model = MLP(64, (64, 64), 10, dropout=dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    scaler = torch.amp.GradScaler("cpu")  # a float16 run needs one; in float32 it scales by 2**16 and back
    sampler = ResumableSampler(len(dataset), seed=seed)
    # A DataLoader without its own generator draws a seed from the global RNG each time it is iterated:
    # a resumed run would then get other dropout masks than one that never stopped.
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=generator)
    val_loader = DataLoader(val_part, batch_size=256, generator=torch.Generator())
    manager = CheckpointManager(folder, keep_last=2, mode="min")
    step, consumed, resumed_from = 0, 0, None
    # The newest checkpoint that reads: an unreadable newer one (a bad copy, a disk error) is set aside.
    state = manager.load_latest(model, optimizer, scheduler, scaler, generator=generator)
    for skipped in manager.skipped:
        print(f"skipped {skipped['path']} (set aside as {skipped['moved_to'].name}): {skipped['reason']}", flush=True)
    if state is not None:
        step = resumed_from = state["step"]
        sampler.load_state_dict(state["extra"]["sampler"])
        consumed = state["extra"]["sampler"]["offset"]
    loss_fn = nn.CrossEntropyLoss()
    stop = steps if stop_after is None else stop_after
    model.train()
    while step < stop:
        for inputs, targets in loader:
            loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step, consumed = step + 1, consumed + len(targets)
            if step % save_every == 0 or step == stop:
                val_loss = evaluate(model, val_loader, loss_fn, device="cpu").loss  # eval mode: no RNG drawn
                path = manager.save(
                    model,
                    optimizer,
                    scheduler,
                    scaler,
                    step=step,
                    epoch=sampler.epoch,
                    metric=val_loss,
                    generator=generator,
                    extra={"sampler": sampler.state_dict(consumed)},
                )
                print(f"saved step {step} {path} (validation loss {val_loss:.6f})", flush=True)
            consumed %= len(dataset)  # 0 when the epoch is over
            if step == stop:
                break
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": scaler,
        "steps_done": step,
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", SkippedCheckpointWarning)  # train() prints one line per skipped file
    result = train(args.folder, steps=args.steps, save_every=args.save_every, seed=args.seed, dropout=args.dropout)
    print(f"done: step {result['steps_done']} (resumed from {result['resumed_from']})", flush=True)


if __name__ == "__main__":
    main()
