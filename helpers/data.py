"""Datasets and DataLoaders: the offline digits data and their PNG export, FashionMNIST, a seeded loader factory."""

from __future__ import annotations

import functools
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, get_worker_info

from .checks import check_choice, check_dataset, check_int, check_range

if TYPE_CHECKING:
    from .rig import Measurement

SPLITS = ("train", "test")
RNG_SOURCES = ("torch", "numpy", "random", "generator")
# ITU-R BT.601 luma: the weights of R, G and B in one gray value, as PIL's convert("L") and torchvision's
# Grayscale use them (the lesson on images and its exercise share them)
LUMA = (0.299, 0.587, 0.114)


class SizedDataset(Protocol):
    """A map-style dataset: a length and indexing."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def _check_split(split: str) -> None:
    check_choice("split", split, SPLITS)


def data_dir() -> Path:
    """Where datasets live: $COURSE_DATA_DIR, else the project's `data/` folder, else ./data."""
    if os.environ.get("COURSE_DATA_DIR"):
        return Path(os.environ["COURSE_DATA_DIR"])
    project = Path(__file__).resolve().parent.parent
    return (project if (project / "pyproject.toml").exists() else Path.cwd()) / "data"


class DigitsDataset(Dataset):
    """scikit-learn's 1,797 handwritten 8x8 digits as (image[1, size, size] in [0, 1], label) pairs.

    A fixed, stratified 75/25 train/test split, independent of any training seed. `size` other than 8
    upsamples once, bilinearly (28 makes the images MNIST-sized).
    """

    classes = tuple(str(digit) for digit in range(10))

    def __init__(self, split: str = "train", *, size: int = 8) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        _check_split(split)
        check_int("size", size, minimum=8)
        digits = load_digits()
        indices = np.arange(len(digits.target))
        train, test = train_test_split(indices, test_size=0.25, random_state=0, stratify=digits.target)
        chosen = np.sort(train if split == "train" else test)
        images = torch.from_numpy(digits.images[chosen]).float().div_(16.0).unsqueeze(1)
        if size != 8:
            images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
        self.images = images.clamp_(0.0, 1.0).contiguous()
        self.targets = torch.from_numpy(digits.target[chosen]).long()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.targets[index])


def export_digits_png(root: str | Path | None = None, *, size: int = 28) -> Path:
    """Write the digits as root/<split>/<class>/<index>.png (the layout ImageFolder reads) once; return root.

    `root` defaults to data/digits_png_<size>. Each split is written into a private folder and then renamed,
    so a concurrent reader never sees half an export.
    """
    from PIL import Image

    root = Path(root) if root is not None else data_dir() / f"digits_png_{size}"
    for split in SPLITS:
        dataset, target = DigitsDataset(split, size=size), root / split
        if target.exists():
            if (found := len(list(target.glob("*/*.png")))) != len(dataset):
                raise ValueError(f"{target} holds {found} PNGs, expected {len(dataset)}; delete it to export again")
            continue
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{split}-", dir=root))
        try:
            pixels = (dataset.images.squeeze(1) * 255).round().to(torch.uint8).numpy()
            for name in dataset.classes:
                (staging / name).mkdir()
            for index, (image, label) in enumerate(zip(pixels, dataset.targets.tolist())):
                Image.fromarray(image).save(staging / dataset.classes[label] / f"{index:05d}.png")
            try:
                staging.rename(target)
            except OSError:  # another process finished the same export first
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return root


class PngFolderDataset(Dataset):
    """A file-backed dataset: reads root/<class>/*.png on every access, like torchvision's ImageFolder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"root must be a folder of class sub-folders, {self.root} does not exist")
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.samples = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((self.root / name).glob("*.png"))
        ]
        if not self.samples:
            raise ValueError(f"root {self.root} holds no PNG files in class sub-folders")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image
        from torchvision.transforms.functional import pil_to_tensor

        path, label = self.samples[index]
        with Image.open(path) as image:
            return pil_to_tensor(image.convert("L")).float().div_(255.0), label


def fashion_mnist(
    split: str = "train", *, root: str | Path | None = None, download: bool = True, transform: Callable | None = None
) -> SizedDataset:
    """The full FashionMNIST (60k/10k 28x28 images) through torchvision, stored under data/.

    Offline, fails with a RuntimeError saying how to get the files by hand.
    """
    from torchvision import datasets, transforms

    _check_split(split)
    root = Path(root) if root is not None else data_dir()
    transform = transform if transform is not None else transforms.ToTensor()
    try:
        return datasets.FashionMNIST(root, train=(split == "train"), download=download, transform=transform)
    except (OSError, RuntimeError) as error:  # URLError is an OSError; a missing file a RuntimeError
        raise RuntimeError(
            f"FashionMNIST is not in {root / 'FashionMNIST' / 'raw'} and could not be downloaded "
            f"({type(error).__name__}: {error}). Connect to the internet and run `python -m helpers.data fashion`, "
            "or copy the four *-ubyte.gz files from https://github.com/zalandoresearch/fashion-mnist#get-the-data "
            "into that folder by hand. Until then, the default DigitsDataset works offline."
        ) from error


def seed_worker(worker_id: int) -> None:
    """worker_init_fn: seed python and numpy in each worker from its torch seed (which differs per worker)."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def make_loader(
    dataset: Dataset,
    *,
    batch_size: int = 64,
    shuffle: bool = False,
    seed: int | None = None,
    num_workers: int = 0,
    **options: Any,
) -> DataLoader:
    """A DataLoader whose order comes from `seed` (a generator of its own) and whose workers run `seed_worker`.

    `options` (pin_memory, persistent_workers, prefetch_factor, collate_fn, ...) go to the DataLoader as they are.
    """
    check_dataset("dataset", dataset)
    check_int("seed", seed, minimum=0, allow_none=True)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    worker_init_fn = seed_worker if num_workers > 0 else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        worker_init_fn=worker_init_fn,
        generator=generator,
        **options,
    )


class VariableLengthSequences(Dataset):
    """Token sequences of random length (1-D int64 tensors; 0 is left free for padding) with a 0/1 label.

    The label says whether a sequence is longer than the middle of [min_length, max_length], so a model
    has to look at the length. Fixed by `seed`, so the same arguments always give the same data.
    """

    def __init__(
        self, size: int = 100, *, min_length: int = 2, max_length: int = 12, vocab_size: int = 20, seed: int = 0
    ) -> None:
        for name, value, minimum in (
            ("size", size, 1),
            ("min_length", min_length, 1),
            ("vocab_size", vocab_size, 2),
            ("seed", seed, 0),
            ("max_length", max_length, min_length),
        ):
            check_int(name, value, minimum=minimum)
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_length, max_length + 1, (size,), generator=generator)
        self.sequences = [torch.randint(1, vocab_size, (int(n),), generator=generator) for n in lengths]
        self.labels = (lengths > (min_length + max_length) / 2).long()

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.sequences[index], int(self.labels[index])


def pad_collate(
    batch: Sequence[tuple[torch.Tensor, int]], padding_value: float = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """collate_fn for (sequence, label) samples of different lengths: (padded [B, max_len], lengths [B], labels [B]).

    For another `padding_value`, pass functools.partial(pad_collate, padding_value=...) (it pickles for workers).
    """
    from torch.nn.utils.rnn import pad_sequence

    if len(batch) == 0:
        raise ValueError("batch must hold at least one (sequence, label) sample, got an empty batch")
    sequences = [sample[0] for sample in batch]
    lengths = torch.tensor([len(sequence) for sequence in sequences])
    padded = pad_sequence(sequences, batch_first=True, padding_value=padding_value)
    return padded, lengths, torch.as_tensor([sample[1] for sample in batch])


def shift_image(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """Move an image [..., H, W] by dy rows and dx columns, filling the uncovered border with zeros."""
    height, width = image.shape[-2:]
    if abs(dy) >= height or abs(dx) >= width:
        raise ValueError(f"shift (dy={dy}, dx={dx}) must be smaller than the image ({height}x{width})")
    shifted = torch.zeros_like(image)
    shifted[..., max(dy, 0) : height + min(dy, 0), max(dx, 0) : width + min(dx, 0)] = image[
        ..., max(-dy, 0) : height + min(-dy, 0), max(-dx, 0) : width + min(-dx, 0)
    ]
    return shifted


class RandomShiftDataset(Dataset):
    """Wraps an (image, label) dataset: each access shifts the image by a random (dy, dx) in [-max_shift, max_shift].

    Samples are dicts with the image, the label, the `shift` drawn, the `worker` that drew it (-1 in the
    main process) and that process's `pid`, so a notebook can see which worker made which augmentation.
    `rng` says where the random numbers come from: the global 'torch', 'numpy' or 'random' generators
    (the DataLoader seeds all three in each worker), or 'generator': a numpy Generator made here in
    __init__ from `seed`, which every worker inherits as an identical copy unless a worker_init_fn such
    as `reseed_dataset_generator` gives each worker its own.
    """

    def __init__(self, base: SizedDataset, *, max_shift: int = 2, rng: str = "torch", seed: int = 0) -> None:
        check_dataset("base", base)
        check_int("max_shift", max_shift, minimum=0)
        check_int("seed", seed, minimum=0)
        check_choice("rng", rng, RNG_SOURCES)
        self.base, self.max_shift, self.rng = base, max_shift, rng
        self.generator = np.random.default_rng(seed) if rng == "generator" else None

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict:
        image, label = self.base[index]
        low, high = -self.max_shift, self.max_shift
        if self.rng == "torch":
            dy, dx = torch.randint(low, high + 1, (2,)).tolist()
        elif self.rng == "numpy":
            dy, dx = np.random.randint(low, high + 1, size=2).tolist()
        elif self.rng == "random":
            dy, dx = random.randint(low, high), random.randint(low, high)
        else:
            assert self.generator is not None  # made in __init__ for rng="generator"
            dy, dx = self.generator.integers(low, high + 1, size=2).tolist()
        info = get_worker_info()
        return {
            "image": shift_image(image, dy, dx),
            "label": label,
            "shift": torch.tensor([dy, dx]),
            "worker": -1 if info is None else info.id,
            "pid": os.getpid(),
        }


def reseed_dataset_generator(worker_id: int) -> None:
    """worker_init_fn: give this worker's copy of the dataset its own numpy Generator, seeded with the worker's seed."""
    info = get_worker_info()
    if info is None:
        raise RuntimeError("reseed_dataset_generator runs inside a DataLoader worker; pass it as worker_init_fn")
    if getattr(info.dataset, "generator", None) is None:
        raise TypeError(f"the worker's dataset ({type(info.dataset).__name__}) has no numpy `generator` to reseed")
    info.dataset.generator = np.random.default_rng(info.seed)  # type: ignore[attr-defined]  # this worker's copy


class SlowDataset(Dataset):
    """Wraps a dataset and sleeps `delay_s` seconds on each access: slow storage, or a reader that got stuck."""

    def __init__(self, base: SizedDataset, delay_s: float) -> None:
        check_dataset("base", base)
        if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not delay_s >= 0:
            raise ValueError(f"delay_s must be a number >= 0, got {delay_s!r}")
        self.base, self.delay_s = base, float(delay_s)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.delay_s)
        return self.base[index]


class CountingLoader:
    """Wraps a loader (any iterable) and counts the passes made over it: `passes` grows by one per `iter()`."""

    def __init__(self, loader: Iterable) -> None:
        if not isinstance(loader, Iterable):
            raise TypeError(f"loader must be an iterable such as a DataLoader, got {type(loader).__name__}")
        self.loader, self.passes = loader, 0

    def __iter__(self) -> Iterator:
        self.passes += 1
        return iter(self.loader)


def padding_share(loader: Iterable) -> float:
    """The fraction of all elements of a pad_collate loader's (padded, lengths, ...) batches that is padding."""
    cells = real = 0
    for padded, lengths, *_ in loader:
        cells, real = cells + padded.numel(), real + int(lengths.sum())
    if cells == 0:
        raise ValueError("loader must deliver at least one (padded, lengths, ...) batch, got none")
    return 1 - real / cells


def epoch(loader: Iterable, *, busy_s: float = 0.0) -> tuple[int, int]:
    """One pass over `loader` with no model attached: the (samples, batches) it delivered.

    With `busy_s`, the main process is busy that long once the pass has started (a model's step), while the
    workers already prepare batches; then it takes every batch.
    """
    check_range("busy_s", busy_s, 0, float("inf"))
    batches = iter(loader)
    time.sleep(busy_s)
    samples = count = 0
    for batch in batches:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        samples, count = samples + len(first), count + 1
    return samples, count


def time_epochs(
    loaders: Mapping[Hashable, Iterable],
    *,
    repeat: int,
    busy_s: float = 0.0,
    per: int = 1,
    unit: str = "epoch",
    labels: Mapping[Hashable, str] | None = None,
) -> tuple[Measurement, dict[Hashable, list[tuple[int, int]]]]:
    """Time one `epoch` of each loader in `repeat` interleaved rounds after an untimed one (`rig.measure`).

    Returns the Measurement (per `per` samples of each epoch, named `unit`) and, per loader, the
    (samples, batches) of every epoch it ran, the untimed one first.
    """
    from .rig import measure

    if not isinstance(loaders, Mapping) or not loaders:
        raise TypeError(f"loaders must be a non-empty mapping of names to loaders, got {loaders!r}")
    check_range("busy_s", busy_s, 0, float("inf"))
    delivered: dict[Hashable, list[tuple[int, int]]] = {name: [] for name in loaders}

    def step(name: Hashable) -> None:
        delivered[name].append(epoch(loaders[name], busy_s=busy_s))

    steps = {name: functools.partial(step, name) for name in loaders}
    timing = measure(steps, device="cpu", repeat=repeat, warmup=1, per=per, unit=unit, labels=labels)
    return timing, delivered


def _main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m helpers.data", description="Prepare datasets under data/.")
    parser.add_argument(
        "what", choices=["digits-png", "fashion"], help="export the digits as PNGs, or get FashionMNIST"
    )
    if parser.parse_args(argv).what == "digits-png":
        print(f"digits written to {export_digits_png()}")
    else:
        for split in SPLITS:
            print(f"FashionMNIST {split}: {len(fashion_mnist(split))} images in {data_dir()}")


if __name__ == "__main__":
    _main()
