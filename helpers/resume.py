"""A step-based training run that checkpoints as it goes and resumes exactly where it stopped,
and the experiment of the checkpointing lesson (06), called by its Run button.

    python -m helpers.resume --folder checkpoints/demo --steps 120 --save-every 10

Run it, kill it at any moment, run the same command again: it continues from the newest checkpoint in
`--folder` and ends with the same weights as a run that was never interrupted. What makes that work:
model, optimizer, scheduler and every RNG state are saved (`helpers.checkpoint`), and the data order
comes from a `ResumableSampler`, which can restart an epoch in the middle with the same shuffle.
"""
from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from .checkpoint import CheckpointManager, load_checkpoint
from .knobs import check_values, float_range, int_range


class ResumableSampler(Sampler[int]):
    """Shuffled indices drawn from `generator` once per epoch; `state_dict(consumed)` lets an epoch restart mid-way.

    The sampler cannot know how many indices the training loop has used (DataLoader workers prefetch), so
    the loop passes the number of samples it consumed in the current epoch to `state_dict`.
    """

    def __init__(self, num_samples: int, *, generator: torch.Generator, shuffle: bool = True) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.num_samples, self.generator, self.shuffle = num_samples, generator, shuffle
        self.epoch = -1                     # index of the epoch being iterated (-1: none started yet)
        self._epoch_start_state: torch.Tensor | None = None
        self._pending: dict | None = None   # a loaded state, applied when the next epoch starts

    def __len__(self) -> int:
        return self.num_samples - (self._pending["offset"] if self._pending else 0)

    def __iter__(self) -> Iterator[int]:
        offset = 0
        if self._pending is not None:
            self.generator.set_state(self._pending["generator"])
            offset, self.epoch = self._pending["offset"], self._pending["epoch"]
            self._pending = None
        else:
            self.epoch += 1
        self._epoch_start_state = self.generator.get_state()
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=self.generator)
        else:
            order = torch.arange(self.num_samples)
        return iter(order[offset:].tolist())

    def state_dict(self, consumed: int) -> dict:
        """Where to restart: the generator state this epoch's order came from, and `consumed` samples in."""
        if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= self.num_samples:
            raise ValueError(f"consumed must be an int in [0, {self.num_samples}], got {consumed!r}")
        if self._epoch_start_state is None:
            return {"generator": self.generator.get_state(), "offset": 0, "epoch": self.epoch + 1}
        if consumed == self.num_samples:  # epoch finished: the next one is drawn from the current state
            return {"generator": self.generator.get_state(), "offset": 0, "epoch": self.epoch + 1}
        return {"generator": self._epoch_start_state.clone(), "offset": consumed, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        """Make the next epoch start where `state` says (same order, `offset` samples skipped)."""
        if not isinstance(state, dict) or not {"generator", "offset", "epoch"} <= set(state):
            raise ValueError("state must be a dict from ResumableSampler.state_dict with generator, offset, epoch")
        if not 0 <= state["offset"] < self.num_samples:
            raise ValueError(f"state offset must be in [0, {self.num_samples}), got {state['offset']!r}")
        self._pending = {"generator": state["generator"].cpu(), "offset": int(state["offset"]),
                         "epoch": int(state["epoch"])}


def build_run(*, seed: int, hidden: int, dropout: float, lr: float, steps: int, batch_size: int):
    """Model, optimizer, scheduler, dataset, sampler and loader for the digits run, all seeded by `seed`."""
    from .data import DigitsDataset
    from .devices import seed_everything
    from .models import MLP

    seed_everything(seed)
    dataset = DigitsDataset("train")
    model = MLP(64, (hidden, hidden), 10, dropout=dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    order_generator = torch.Generator().manual_seed(seed)
    sampler = ResumableSampler(len(dataset), generator=order_generator)
    # The loader gets its own generator: otherwise each new iterator draws a seed from the global RNG,
    # and a resumed run would draw one more time than a run that never stopped (different dropout masks).
    loader_generator = torch.Generator().manual_seed(seed + 1)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=loader_generator)
    return model, optimizer, scheduler, sampler, loader, loader_generator


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def train(folder: str | Path, *, steps: int = 120, save_every: int = 10, seed: int = 0, hidden: int = 64,
          dropout: float = 0.1, lr: float = 3e-3, batch_size: int = 32, stop_after: int | None = None,
          keep_last: int = 2, on_save: Callable[[int, Path], None] | None = None,
          weights_only_resume: bool = False) -> dict:
    """Train the digits MLP for `steps` optimizer steps, checkpointing into `folder`; resume if it holds one.

    Saves every `save_every` steps, at `stop_after` (then returns early, as if the run had been stopped)
    and at the end. Returns the model, the per-step losses of the whole run (restored from the checkpoint
    when resuming), the step it resumed from and the latest checkpoint path. `weights_only_resume=True`
    restores only the model's weights and the step count (a fresh optimizer, schedule, data order and
    random streams): the common shortcut, kept here to show what it costs.
    """
    _check_positive_int("steps", steps)
    _check_positive_int("save_every", save_every)
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("hidden", hidden)
    if stop_after is not None:
        _check_positive_int("stop_after", stop_after)
        if stop_after > steps:
            raise ValueError(f"stop_after must be at most steps={steps}, got {stop_after}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")

    from .loop import evaluate

    model, optimizer, scheduler, sampler, loader, loader_generator = build_run(
        seed=seed, hidden=hidden, dropout=dropout, lr=lr, steps=steps, batch_size=batch_size)
    manager = CheckpointManager(folder, keep_last=keep_last, mode="min")
    loss_fn = nn.CrossEntropyLoss()
    losses: list[torch.Tensor] = []
    step, consumed, resumed_from = 0, 0, None
    if weights_only_resume:
        state = None
        if manager.latest() is not None:
            state = load_checkpoint(manager.latest(), model, restore_rng=False)
    else:
        state = manager.load_latest(model, optimizer, scheduler, generator=loader_generator)
    if state is not None:
        step = resumed_from = state["step"]
        losses = list(state["extra"]["losses"].unbind()) if step else []
        if not weights_only_resume:
            sampler.load_state_dict(state["extra"]["sampler"])
            consumed = state["extra"]["sampler"]["offset"]
    val_loader = None
    saved_sampler_state: dict = {"last": None}  # the sampler state in the newest checkpoint written

    def save() -> Path:
        nonlocal val_loader
        if val_loader is None:
            from .data import DigitsDataset
            # Its own generator: a DataLoader without one draws a seed from the global RNG each time it is
            # iterated, so an extra evaluation (an extra save) would change the dropout masks that follow.
            val_loader = DataLoader(DigitsDataset("test"), batch_size=256, generator=torch.Generator())
        val_loss = evaluate(model, val_loader, loss_fn, device="cpu")["loss"]  # eval mode: consumes no RNG
        saved_sampler_state["last"] = sampler.state_dict(consumed)
        path = manager.save(model, optimizer, scheduler, step=step, epoch=saved_sampler_state["last"]["epoch"],
                            metric=val_loss,
                            generator=loader_generator,
                            extra={"sampler": saved_sampler_state["last"],
                                   "losses": torch.stack(losses) if losses else torch.zeros(0)})
        if on_save is not None:
            on_save(step, path)
        return path

    model.train()
    stop = stop_after if stop_after is not None else steps
    while step < stop:
        for inputs, targets in loader:
            loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.detach())
            step += 1
            consumed += len(targets)
            if step % save_every == 0 or step == stop:
                save()
            if consumed == sampler.num_samples:  # the epoch is over; the next one starts at 0
                consumed = 0
            if step == stop:
                break
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "losses": [float(v) for v in losses],
            "steps_done": step, "resumed_from": resumed_from, "latest": manager.latest(),
            "sampler_state": saved_sampler_state["last"],
            "best": manager.best(), "steps_per_epoch": math.ceil(sampler.num_samples / batch_size)}


# ------------------------------------------------------------------------------ the lesson's experiment

ARTICLE_SEGMENTS = (0, 2, 5, 10)   # the segment counts one article measured on a GPU (1717/1283/1043/959 MB)

CHECKPOINTING_SPEC = {
    "seed": int_range(0, 10_000, description="seed"),
    "depth": int_range(80, 200, description="Linear+ReLU blocks"),
    "width": int_range(32, 1024, 32, description="width"),
    "batch_size": int_range(8, 512, 8, description="batch (stack)"),
    "dropout": float_range(0.05, 0.9, 0.05, description="dropout"),
    "steps": int_range(60, 600, 10, description="training steps"),
    "stop_after": int_range(1, 590, description="crash after step"),
    "save_every": int_range(1, 100, description="save every"),
}


def sweep_segments(depth: int) -> list[int]:
    """The article's segment counts, plus sqrt(depth), depth/2 and depth (one segment per block)."""
    _check_positive_int("depth", depth)
    return sorted({*ARTICLE_SEGMENTS, math.isqrt(depth), depth // 2, depth} - {1})


@dataclass
class CheckpointingRun:
    """What `run_checkpointing_experiment` measured: the segment sweep and four training runs."""

    settings: dict
    device: torch.device
    sweep: list[dict]
    runs: dict[str, dict]
    folder: Path
    steps_per_epoch: int = 0
    figures: list = field(default_factory=list)


def run_checkpointing_experiment(seed: int = 0, depth: int = 100, width: int = 128, batch_size: int = 32,
                                 dropout: float = 0.1, steps: int = 120, stop_after: int = 50,
                                 save_every: int = 10, *, device: torch.device | str | None = None,
                                 show: bool = True) -> CheckpointingRun:
    """Part A: memory and time of checkpoint_sequential over segment counts. Part B: train, crash, resume.

    The digits run trains on CPU (bit-identical resume is a CPU promise); it is done four ways: straight
    through, stopped at `stop_after`, resumed from that checkpoint (a fresh model, optimizer and sampler),
    and resumed from the weights alone. Checkpoints go to a fresh temporary folder.
    """
    from .checkpoint import checkpoint_segments_sweep
    from .devices import pick_device, seed_everything
    from .models import deep_linear_stack

    values = check_values(CHECKPOINTING_SPEC, {
        "seed": seed, "depth": depth, "width": width, "batch_size": batch_size, "dropout": dropout,
        "steps": steps, "stop_after": stop_after, "save_every": save_every})
    if values["stop_after"] >= values["steps"]:
        raise ValueError(f"stop_after must be smaller than steps={values['steps']}, got {values['stop_after']}")
    device = pick_device() if device is None else torch.device(device)

    seed_everything(values["seed"])
    stack = deep_linear_stack(values["width"], values["depth"]).to(device)
    inputs = torch.randn(values["batch_size"], values["width"], device=device)
    sweep = checkpoint_segments_sweep(stack, inputs, sweep_segments(values["depth"]), repeat=3, warmup=1)

    folder = Path(tempfile.mkdtemp(prefix="checkpointing-"))
    common = {"steps": values["steps"], "save_every": values["save_every"], "seed": values["seed"],
              "dropout": values["dropout"]}
    runs = {"straight": train(folder / "straight", **common),
            "stopped": train(folder / "crashed", stop_after=values["stop_after"], **common)}
    shutil.copytree(folder / "crashed", folder / "weights-only")  # the same files, resumed the short way
    runs["resumed"] = train(folder / "crashed", **common)
    runs["weights_only"] = train(folder / "weights-only", weights_only_resume=True, **common)
    result = CheckpointingRun(settings=values, device=device, sweep=sweep, runs=runs, folder=folder,
                              steps_per_epoch=runs["straight"]["steps_per_epoch"])
    if show:
        _show(result)
    return result


def _show(result: CheckpointingRun) -> None:
    import matplotlib.pyplot as plt

    from .inference import format_table
    from .memory import format_bytes

    rows = [{**row, "saved": format_bytes(row["saved_bytes"]),
             "vs none": row["saved_bytes"] / result.sweep[0]["saved_bytes"],
             "cuda peak": format_bytes(row["cuda_peak_bytes"]) if row["cuda_peak_bytes"] is not None else "-",
             "ms/step": 1e3 * row["seconds"]} for row in result.sweep]
    print(f"deep stack: {result.settings['depth']} x (Linear {result.settings['width']} + ReLU), batch "
          f"{result.settings['batch_size']}, on {result.device}")
    print(format_table(rows, ["segments", "saved", "vs none", "recomputed_modules", "cuda peak", "ms/step",
                              "time_ratio"],
                       formats={"vs none": "{:.2f}", "ms/step": "{:.1f}", "time_ratio": "{:.2f}x"}))
    segments = [row["segments"] for row in result.sweep]
    figure, (memory_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 3.5))
    memory_ax.plot(segments, [row["saved_bytes"] / 2**20 for row in result.sweep], marker="o",
                   label="kept for backward (meter)")
    if result.sweep[0]["cuda_peak_bytes"] is not None:
        memory_ax.plot(segments, [row["cuda_peak_bytes"] / 2**20 for row in result.sweep], marker="s",
                       label="CUDA peak during the step")
    memory_ax.set(xlabel="segments (0 = no checkpointing)", ylabel="MiB",
                  title="activation memory vs segments")
    memory_ax.legend()
    time_ax.plot(segments, [row["time_ratio"] for row in result.sweep], marker="o", color="tab:red")
    time_ax.axhline(1.0, color="grey", lw=0.8)
    time_ax.set(xlabel="segments", ylabel="step time / no checkpointing",
                title="the price: recomputation")
    for ax in (memory_ax, time_ax):
        ax.set_xscale("symlog", linthresh=1)   # 0 (no checkpointing) sits on the linear part
        ax.set_xticks(segments, [str(s) for s in segments])
        ax.set_xlim(-0.3, segments[-1] * 1.3)
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    figure.tight_layout()
    plt.show()

    stop = result.settings["stop_after"]
    straight = result.runs["straight"]["losses"]
    resumed = result.runs["resumed"]["losses"]
    naive = result.runs["weights_only"]["losses"]
    figure, ax = plt.subplots(figsize=(10, 3.5))
    steps = range(1, len(straight) + 1)
    ax.plot(steps, straight, color="grey", lw=3, alpha=0.5, label="never stopped")
    ax.plot(steps[:stop], resumed[:stop], color="tab:blue", lw=1, label="before the crash")
    ax.plot(steps[stop:], resumed[stop:], color="tab:green", lw=1, ls="--", label="resumed from the full checkpoint")
    ax.plot(steps[stop:], naive[stop:], color="tab:red", lw=1, label="resumed from the weights only")
    ax.axvline(stop + 0.5, color="black", lw=0.8, ls=":")
    ax.set(xlabel="optimizer step", ylabel="training loss (batch)", yscale="log",
           title=f"crash after step {stop}, resume in fresh objects")
    ax.grid(alpha=0.3)
    ax.legend()
    figure.tight_layout()
    plt.show()
    same = all(torch.equal(a, b) for a, b in zip(result.runs["straight"]["model"].state_dict().values(),
                                                 result.runs["resumed"]["model"].state_dict().values()))
    print(f"resumed run == never-stopped run, bit for bit: {same}; checkpoints in {result.folder}")


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: train (or resume) the digits run, printing one line per checkpoint saved."""
    parser = argparse.ArgumentParser(prog="python -m helpers.resume", description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, help="checkpoint folder (resumes from its newest file)")
    parser.add_argument("--steps", type=int, default=120, help="total optimizer steps of the run")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every this many steps")
    parser.add_argument("--stop-after", type=int, default=None, help="save and exit after this step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (same in every run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = train(args.folder, steps=args.steps, save_every=args.save_every, seed=args.seed, hidden=args.hidden,
                   dropout=args.dropout, stop_after=args.stop_after,
                   on_save=lambda step, path: print(f"saved step {step} {path}", flush=True))
    print(f"done: step {result['steps_done']} (resumed from {result['resumed_from']}) "
          f"in {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
