"""Train a small GPT on real text, with every technique of the course a switch; tokens/s and MFU at every log step.

    python -m helpers.cli.train_gpt                                   # the Python standard library's source, CPU-sized
    python -m helpers.cli.train_gpt --precision bf16 --compile --fused-adamw --out runs/gpt
    python -m helpers.cli.train_gpt --text my_corpus.txt              # your own text, read as bytes
    torchrun --standalone --nproc_per_node=2 -m helpers.cli.train_gpt --strategy ddp

Read it top to bottom: the config (each switch names the lesson that teaches it), the run's parts (`build`), one
optimizer step (`train_step`), evaluation (`estimate_loss`), then the loop (`train`). The model is helpers.gpt, the
data helpers.corpus, the throughput figures helpers.mfu. With --out, rank 0 writes a checkpoint every --save-every
steps (helpers.checkpoint), TensorBoard logs and history.json; the same command run again resumes from the newest
checkpoint and ends bit-identical to a run that never stopped. SIGTERM (a scheduler taking the machine back) ends
the run after the step it came in, with a checkpoint, and exit code 75 (helpers.preemption). Only one live run may
write to an --out folder (helpers.run_folder). torchrun --max-restarts starts a group again after a rank dies, and
it resumes from the newest checkpoint; with --global-batch the accumulation is worked out for the number of ranks,
so a run resumed on more or fewer ranks (torchrun --nnodes=1:2 taking a second node) takes the same windows at every
step. Notebook 16 runs these functions in its cells.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import compat, mfu
from helpers.checkpoint import CheckpointManager
from helpers.checks import check_choice, check_int, check_positive_number, check_range
from helpers.cli.options import parse_settings
from helpers.corpus import Corpus, TokenWindows, decode, encode, load_corpus, unigram_loss, window_loader
from helpers.devices import pick_device, seed_everything
from helpers.distributed import (
    all_reduce_metrics,
    default_backend,
    finish_run,
    setup_process_group,
    teardown_process_group,
)
from helpers.gpt import GPT, GPTConfig, flops_per_token, generate, optimizer_groups
from helpers.loop import autocast_context, make_grad_scaler, precisions_for
from helpers.preemption import PREEMPTED_EXIT_CODE, StopRequest
from helpers.progress import progress_bar
from helpers.run_folder import claim_run_folder
from helpers.workers.fsdp import WholeModel, WholeOptimizer, shard_blocks

STRATEGIES = ("single", "ddp", "fsdp")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
# What a run's result does not depend on: it may differ between a run and its resume.
NOT_SHAPING = [
    "out",
    "save_every",
    "log_every",
    "progress",
    "workers",
    "pin_memory",
    "threads",
    "sample_tokens",
    "device",
]


@dataclass(frozen=True)
class Config:
    """Every switch of a run, with its default. The lesson that teaches it is named beside it."""

    # the model: helpers.gpt.GPTConfig (lesson 16)
    block_size: int = 128  # context, in bytes
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block; n_embd must be a multiple
    n_embd: int = 128  # the width: each token's vector
    dropout: float = 0.0  # in [0, 1)
    # the data (lesson 02): the Python standard library's source, or --text PATH (a file or a folder)
    text: str | None = None  # a file or folder of your own text, read as bytes; None: the standard library
    batch_size: int = 16  # sequences per micro-batch, per rank
    accumulation: int = 1  # micro-batches per optimizer step (lesson 05)
    global_batch: int = 0  # sequences per step on all ranks; the accumulation set per world size (lesson 17)
    workers: int = 0  # DataLoader worker processes (lesson 02)
    pin_memory: bool = False  # page-locked batches, copied to a GPU asynchronously (lesson 02)
    # the update (lessons 03 and 04)
    steps: int = 300  # optimizer steps
    lr: float = 3e-3  # the peak learning rate, after the warm-up
    min_lr: float = 3e-4  # where the cosine ends
    warmup: int = 30  # steps of linear warm-up
    weight_decay: float = 0.1  # AdamW's, on the matrices only
    grad_clip: float = 1.0  # the gradients' largest total norm; 0: no clipping
    fused_adamw: bool = False  # one kernel per update (lesson 13)
    # speed and memory
    precision: str = "fp32"  # fp32, tf32 (CUDA, Ampere+), bf16 or fp16 with a GradScaler (lesson 06)
    checkpointing: bool = False  # recompute each block's activations in backward (lesson 10)
    compile: bool = False  # torch.compile (lesson 13)
    strategy: str = "single"  # single, ddp (lesson 08) or fsdp (lesson 09): ddp and fsdp under torchrun
    device: str = "auto"  # auto (cuda > mps > cpu), or cpu, cuda, mps
    threads: int | None = None  # torch's CPU threads; None: the cores shared among the local ranks
    # evaluation, checkpoints and logs (lessons 11 and 12)
    eval_every: int = 100  # steps between validation losses (and at the end)
    eval_batches: int = 8  # global batches of validation windows per evaluation: the same windows on any world size
    log_every: int = 10  # steps between log lines with tokens/s and MFU
    save_every: int = 0  # steps between checkpoints in --out; 0: none
    out: str | None = None  # folder for checkpoints, TensorBoard logs and history.json (rank 0 writes)
    sample_tokens: int = 200  # bytes of text generated at the end
    seed: int = 0  # weights, data order and dropout: an int in [0, 2**32 - 1]
    progress: bool = True  # a progress bar, where someone watches

    def __post_init__(self) -> None:
        self.model_config()  # refuses a shape the GPT cannot take, naming the field
        for name in ("batch_size", "accumulation", "steps", "eval_every", "eval_batches", "log_every"):
            check_int(name, getattr(self, name))
        for name in ("workers", "warmup", "save_every", "sample_tokens", "global_batch"):
            check_int(name, getattr(self, name), minimum=0)
        check_int("threads", self.threads, allow_none=True)
        check_int("seed", self.seed, minimum=0, maximum=2**32 - 1)
        for name in ("lr", "min_lr"):
            check_positive_number(name, getattr(self, name))
        check_range("weight_decay", self.weight_decay, 0, math.inf)
        check_range("grad_clip", self.grad_clip, 0, math.inf)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("strategy", self.strategy, STRATEGIES)
        if self.global_batch and self.accumulation != 1:
            raise ValueError(
                f"accumulation={self.accumulation} with global_batch={self.global_batch}: give one of them "
                "(global_batch works the accumulation out for the number of ranks)"
            )
        if self.save_every and self.out is None:
            raise ValueError(f"save_every={self.save_every} needs out, the folder the checkpoints go to")

    def model_config(self) -> GPTConfig:
        """The GPT's shape."""
        shape = ("block_size", "n_layer", "n_head", "n_embd", "dropout")
        return GPTConfig(**{name: getattr(self, name) for name in shape})

    def shaping(self) -> dict:
        """The settings a run's result depends on, as its checkpoints record them."""
        return {key: value for key, value in dataclasses.asdict(self).items() if key not in NOT_SHAPING}

    def accumulation_on(self, world_size: int) -> int:
        """Micro-batches per optimizer step on `world_size` ranks: `accumulation`, or what makes up the global_batch."""
        if not self.global_batch:
            return self.accumulation
        per_micro_batch = self.batch_size * world_size
        if self.global_batch % per_micro_batch:
            raise ValueError(
                f"global_batch={self.global_batch} is not a whole number of micro-batches of batch_size="
                f"{self.batch_size} on {world_size} rank(s): make it a multiple of {per_micro_batch}"
            )
        return self.global_batch // per_micro_batch

    def recorded(self, world_size: int) -> dict:
        """What a checkpoint records, and a resume must match: the shaping settings, and the world size unless a
        global_batch makes the run's steps the same on any number of ranks."""
        return self.shaping() | ({} if self.global_batch else {"world_size": world_size})


def check_device(config: Config, device: torch.device) -> None:
    """Refuse at once a setting this device cannot do, naming it and what the device offers."""
    offered = precisions_for(device, tf32=True)
    if config.precision not in offered:
        raise ValueError(f"precision={config.precision!r} is not available on {device}; this device offers {offered}")
    compiles, why = compat.compiled_gpt_gradients_right(device.type)
    if config.compile and not compiles:
        raise ValueError(f"compile=True: {why}")
    if config.pin_memory and device.type != "cuda":
        raise ValueError(f"pin_memory=True speeds up copies to a CUDA GPU; this run is on {device}")


@dataclass
class Run:
    """One rank's part of a run: the model as trained (wrapped) and its bare module, what updates it, the data."""

    config: Config
    device: torch.device
    rank: int
    world_size: int
    corpus: Corpus
    module: GPT  # the bare model: checkpoints, generation
    model: nn.Module  # what the step calls: the model compiled and wrapped by DDP or sharded by FSDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    train_windows: TokenWindows
    val_windows: TokenWindows
    accumulation: int  # micro-batches per optimizer step on this world size (Config.accumulation_on)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks."""
        config = self.config
        return config.batch_size * self.accumulation * self.world_size * config.block_size

    def batches(self, start_step: int = 0) -> Iterator:
        """This rank's training batches from optimizer step `start_step` on, forever (helpers.corpus.WindowBatches)."""
        config = self.config
        ranks: dict[str, Any] = {"rank": self.rank, "world_size": self.world_size}
        reading: dict[str, Any] = {"workers": config.workers, "pin_memory": config.pin_memory}
        start = start_step * self.accumulation
        return iter(
            window_loader(self.train_windows, config.batch_size, seed=config.seed, start=start, **ranks, **reading)
        )


def lr_factor(step: int, config: Config) -> float:
    """The learning rate's share of its peak at `step`: a linear warm-up, then a cosine down to min_lr (lesson 04)."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    floor = config.min_lr / config.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build(config: Config, device: torch.device, *, rank: int = 0, world_size: int = 1) -> Run:
    """The run of `config` from its first step: corpus, seeded model, its wrapping, AdamW, schedule and scaler."""
    check_device(config, device)
    accumulation = config.accumulation_on(world_size)
    if config.strategy == "single" and world_size > 1:
        raise ValueError(f"strategy='single' runs in one process, but this is rank {rank} of {world_size}")
    corpus = load_corpus(config.text)
    windows = [TokenWindows(corpus.tokens(split), config.block_size) for split in ("train", "validation")]
    seed_everything(config.seed)  # the same weights, and dropout masks, on every rank
    module = GPT(config.model_config(), checkpointing=config.checkpointing).to(device)
    model: nn.Module = module
    if config.strategy == "fsdp":  # each block a unit; the root keeps the tied embedding and output matrix together
        model = shard_blocks(module, module.blocks)
    if config.compile:
        model = torch.compile(model)  # type: ignore[assignment]
    if config.strategy == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    fused = {"fused": True} if config.fused_adamw else {}
    groups = optimizer_groups(module, config.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), **fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    scaler = make_grad_scaler(device, config.precision if config.precision != "tf32" else "fp32")
    train_windows, val_windows = windows
    return Run(
        config, device, rank, world_size, corpus, module, model, optimizer, scheduler, scaler,
        train_windows, val_windows, accumulation,
    )  # fmt: skip


def precision_context(run: Run) -> contextlib.AbstractContextManager:
    """Autocast for bf16 and fp16; for fp32 and tf32 how CUDA multiplies float32 (helpers.compat)."""
    precision, cuda = run.config.precision, run.device.type == "cuda"
    if precision in ("fp32", "tf32"):
        return compat.fp32_precision_as("tf32" if precision == "tf32" else "ieee") if cuda else contextlib.nullcontext()
    return autocast_context(run.device, precision)


def gradient_sync(run: Run, sync: bool) -> contextlib.AbstractContextManager:
    """DDP and FSDP average gradients in backward; between micro-batches that is wasted, so skip it but on the last."""
    if run.config.strategy == "ddp" and not sync:
        return run.model.no_sync()  # type: ignore[operator]
    if run.config.strategy == "fsdp":
        run.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
    return contextlib.nullcontext()


def train_step(run: Run, batches: Iterator) -> torch.Tensor:
    """One optimizer step: each micro-batch forward under its precision and backward (scaled for fp16), gradients
    synced on the last; then unscale, clip, step, update, zero; the schedule moves on. Returns the mean loss."""
    config, device = run.config, run.device
    total = torch.zeros((), device=device)
    for micro in range(run.accumulation):
        inputs, targets = (tensor.to(device, non_blocking=True) for tensor in next(batches))
        with gradient_sync(run, sync=micro == run.accumulation - 1):
            with precision_context(run):
                logits = run.model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / run.accumulation
            run.scaler.scale(loss).backward()
        total += loss.detach()
    if config.grad_clip:
        run.scaler.unscale_(run.optimizer)  # clip the true gradients, not the scaled ones
        nn.utils.clip_grad_norm_(run.model.parameters(), config.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return total


@torch.no_grad()
def estimate_loss(run: Run) -> float:
    """The mean loss on the same eval_batches global batches of validation windows every time: each rank takes its
    micro-batches of them (accumulation per global batch), so the windows are the same on any number of ranks."""
    run.model.eval()
    loader = window_loader(run.val_windows, run.config.batch_size, rank=run.rank, world_size=run.world_size)
    batches, losses = iter(loader), []
    for _ in range(run.config.eval_batches * run.accumulation):
        inputs, targets = (tensor.to(run.device) for tensor in next(batches))
        with precision_context(run):
            losses.append(F.cross_entropy(run.model(inputs).flatten(0, 1).float(), targets.flatten()))
    run.model.train()
    return all_reduce_metrics({"loss": torch.stack(losses).mean().item()}, average=True)["loss"]


def checkpoint_parts(run: Run) -> tuple[nn.Module, Any]:
    """What a checkpoint holds of the model and the optimizer: the bare model and the optimizer, or under FSDP views
    of them whole (helpers.workers.fsdp.WholeModel), gathered from the shards by every rank: one file either way."""
    if run.config.strategy != "fsdp":
        return run.module, run.optimizer
    model, optimizer = WholeModel(run.module), WholeOptimizer(run.module, run.optimizer)
    model.gather()
    optimizer.gather()
    return model, optimizer


def save(run: Run, manager: CheckpointManager, step: int) -> Path | None:
    """Every rank: the run's state after `step` into a checkpoint, which rank 0 writes; its path there, else None."""
    model, optimizer = checkpoint_parts(run)  # under FSDP a collective: every rank takes part
    if run.rank != 0:
        return None
    extra = {"settings": run.config.recorded(run.world_size)}
    return manager.save(model, optimizer, run.scheduler, run.scaler, step=step, extra=extra)


def resume(run: Run, manager: CheckpointManager) -> int:
    """Load the newest readable checkpoint of this run (refusing one with other settings); the step it reached."""
    state = manager.load_latest(*checkpoint_parts(run), run.scheduler, run.scaler)
    if state is None:
        return 0
    saved, asked = state["extra"]["settings"], run.config.recorded(run.world_size)
    differing = [
        f"{key}: saved {saved.get(key)!r}, asked {value!r}" for key, value in asked.items() if saved.get(key) != value
    ]
    if differing:
        raise ValueError(
            f"{manager.folder} holds a run with other settings ({'; '.join(differing)}): "
            "use another --out, or the same settings to resume it"
        )
    return int(state["step"])


def train(
    config: Config,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | None = None,
    stop: StopRequest | None = None,
) -> dict:
    """Train `config` as rank `rank` of `world_size` (a process group already joined when more than one); log,
    evaluate, checkpoint and resume as configured. A `stop` request (SIGTERM, in main) ends the run after the step
    it came in (with several ranks, after the next log step), with a checkpoint. Returns the history and the run."""
    device = device or pick_device(config.device)
    run = build(config, device, rank=rank, world_size=world_size)
    leader, out = rank == 0, Path(config.out) if config.out else None
    # The limits of one rank's device in the run's precision, measured before resuming (its random matrices would
    # move the RNG on): a large matmul's FLOP/s here, and the datasheet's dense peak where the GPU is known
    measured = mfu.matmul_flops(device, config.precision)
    datasheet, source = mfu.datasheet_flops(device, config.precision)
    manager = CheckpointManager(out / "checkpoints", keep_last=2) if out and config.save_every else None
    start = resume(run, manager) if manager else 0
    say = print if leader else (lambda *args, **kwargs: None)
    per_token = flops_per_token(config.model_config())
    train_tokens, val_tokens = run.corpus.tokens("train"), run.corpus.tokens("validation")
    baseline = unigram_loss(train_tokens, val_tokens)
    say(
        f"{run.corpus.description}\n{device}, {world_size} rank(s), {config.precision}, strategy {config.strategy}; "
        f"{sum(p.numel() for p in run.module.parameters()):,} parameters, {per_token / 1e6:.1f} MFLOP per token; "
        f"unigram baseline {baseline:.3f}; {source}" + (f"; resumed at step {start}" if start else ""),
        flush=True,
    )
    writer = None
    if out and leader:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out / "tensorboard"), purge_step=start)
    history: dict[str, Any] = dict(config=dataclasses.asdict(config), world_size=world_size, baseline=baseline)
    history |= dict(flops_per_token=per_token, measured_flops=measured, datasheet_flops=datasheet, start=start)
    history |= dict(losses=[], log=[], evals=[])
    batches, window, since = run.batches(start), [], time.perf_counter()
    run.model.train()
    for step in progress_bar(
        range(start, config.steps), enabled=config.progress and leader, desc="steps", initial=start, total=config.steps
    ):
        window.append(train_step(run, batches))
        done = step + 1
        # Preempted: log, save, leave. Ranks agree at log steps only: a collective and a sync every step would slow it
        asks = stop is not None and (world_size == 1 or done % config.log_every == 0)
        stopping = asks and stop.agreed(device) and done < config.steps  # type: ignore[union-attr]
        if done % config.log_every == 0 or done == config.steps or stopping:
            losses = torch.stack(window)
            if world_size > 1:
                dist.all_reduce(losses)
                losses /= world_size
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds, since = time.perf_counter() - since, time.perf_counter()
            tokens_per_s = len(window) * run.tokens_per_step / seconds
            history["losses"] += losses.tolist()
            row = {
                "step": done,
                "loss": history["losses"][-1],
                "lr": run.scheduler.get_last_lr()[0],
                "tokens_per_s": tokens_per_s,
                "seconds": seconds,
                "mfu": mfu.mfu(tokens_per_s, per_token, world_size * measured),
                "mfu_datasheet": mfu.mfu(tokens_per_s, per_token, world_size * datasheet) if datasheet else None,
            }
            history["log"].append(row)
            line = mfu.utilization_line(
                tokens_per_s / world_size, per_token, measured=measured, datasheet=datasheet, precision=config.precision
            )
            say(f"step {done}: loss {row['loss']:.4f}, lr {row['lr']:.2e}; per rank {line}", flush=True)
            if writer:
                for name in ("loss", "lr", "tokens_per_s", "mfu"):
                    writer.add_scalar(f"train/{name}", row[name], done)
            window = []
        paused = time.perf_counter()  # evaluation and saving are left out of tokens/s
        if done % config.eval_every == 0 or done == config.steps:
            val_loss = estimate_loss(run)
            history["evals"].append({"step": done, "tokens": done * run.tokens_per_step, "val_loss": val_loss})
            say(f"step {done}: validation loss {val_loss:.4f} (unigram baseline {baseline:.4f})", flush=True)
            if writer:
                writer.add_scalar("validation/loss", val_loss, done)
        if manager and (done % config.save_every == 0 or done == config.steps):
            say(f"saved step {done} {save(run, manager, done)}", flush=True)
        if stopping:
            history["preempted_at"] = done
            if manager:
                saved = save(run, manager, done)
                say(f"stopped on request after step {done}; saved {saved}: run the same command to resume", flush=True)
            else:
                say(f"stopped on request after step {done}, with no checkpoint (give --out and --save-every)")
            break
        since += time.perf_counter() - paused
    if writer:
        writer.close()
    if leader and config.sample_tokens and "preempted_at" not in history:
        prompt, seeded = encode("def ").to(device), torch.Generator(device).manual_seed(config.seed)
        sample = generate(run.module, prompt, config.sample_tokens, temperature=0.8, top_k=40, generator=seeded)
        history["sample"] = decode(sample)
        say(f"--- {config.sample_tokens} bytes generated after 'def ':\n{history['sample']}\n---", flush=True)
    if out and leader:
        (out / "history.json").write_text(json.dumps(history, indent=1, default=str))
    return {"history": history, "run": run}


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """The command line to a Config: an option per field, with its default and its comment above as help."""
    choices = {"precision": PRECISIONS, "strategy": STRATEGIES}
    return parse_settings(
        Config, argv, prog="python -m helpers.cli.train_gpt", description=__doc__.splitlines()[0], choices=choices
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: a world of one, or the rank torchrun describes, trains; a rank of several leaves with finish_run.
    Returns the exit code: 0, or PREEMPTED_EXIT_CODE when SIGTERM stopped the run after a checkpoint."""
    config = parse_args(argv)
    distributed = "RANK" in os.environ and config.strategy != "single"
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1 and config.strategy == "single":
        sys.exit("train_gpt: error: started by torchrun with several ranks: pass --strategy ddp or fsdp")
    rank, world_size = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if distributed else (0, 1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // local_world))
    device, stop = None, StopRequest()
    try:
        if distributed:
            backend = default_backend(local_world) if config.device in ("auto", "cuda") else "gloo"
            device = setup_process_group(rank, world_size, backend=backend, timeout_s=300)
        elif config.strategy != "single":  # ddp or fsdp in one process: a world of one
            from helpers.distributed import find_free_port

            device, port = pick_device(config.device), find_free_port()
            backend = "nccl" if device.type == "cuda" else "gloo"
            setup_process_group(0, 1, backend=backend, init_method=f"tcp://127.0.0.1:{port}")
        owns = claim_run_folder(config.out) if config.out and rank == 0 else contextlib.nullcontext()
        with stop.installed(), owns:  # SIGTERM: finish the step, save, leave; --out: one live run per folder
            history = train(config, rank=rank, world_size=world_size, device=device, stop=stop)["history"]
    except ValueError as error:  # a setting this device cannot do, a folder holding another run or used by one
        teardown_process_group()
        sys.exit(f"train_gpt: error: {error}")
    except BaseException:
        teardown_process_group()  # no barrier: a rank that failed would keep the others waiting there
        raise
    finish_run()
    return PREEMPTED_EXIT_CODE if "preempted_at" in history else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(
        code
    )  # past the final barrier: leave without the interpreter's teardown (see helpers.distributed.finish_run)
