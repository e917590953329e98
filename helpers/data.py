"""Datasets and DataLoaders: the offline digits data, PNG export, FashionMNIST, a validated loader factory."""
from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class SizedDataset(Protocol):
    """What the helpers here need of a dataset: a length and indexing (a map-style torch Dataset)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...

SPLITS = ("train", "test")
DIGIT_CLASSES = tuple(str(digit) for digit in range(10))
FASHION_URL_HELP = "https://github.com/zalandoresearch/fashion-mnist#get-the-data"


def data_dir() -> Path:
    """Where datasets live: $COURSE_DATA_DIR, else the project's `data/` folder, else ./data."""
    if os.environ.get("COURSE_DATA_DIR"):
        return Path(os.environ["COURSE_DATA_DIR"])
    project = Path(__file__).resolve().parent.parent
    if (project / "pyproject.toml").exists():
        return project / "data"
    return Path.cwd() / "data"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


class DigitsDataset(Dataset):
    """scikit-learn's 1,797 handwritten 8x8 digits as (image[1, size, size] in [0, 1], label) pairs.

    The train/test split is stratified and fixed by `split_seed`, independent of any training seed.
    `size` other than 8 upsamples once, bilinearly (28 makes the images MNIST-sized).
    """

    classes = DIGIT_CLASSES

    def __init__(self, split: str = "train", *, size: int = 8, transform: Callable | None = None,
                 test_fraction: float = 0.25, split_seed: int = 0) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        _check_split(split)
        if isinstance(size, bool) or not isinstance(size, int) or size < 8:
            raise ValueError(f"size must be an int >= 8, got {size!r}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
        digits = load_digits()
        indices = np.arange(len(digits.target))
        train_idx, test_idx = train_test_split(
            indices, test_size=test_fraction, random_state=split_seed, stratify=digits.target)
        chosen = np.sort(train_idx if split == "train" else test_idx)
        images = torch.from_numpy(digits.images[chosen]).float().div_(16.0).unsqueeze(1)
        if size != 8:
            images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
        self.images = images.clamp_(0.0, 1.0).contiguous()
        self.targets = torch.from_numpy(digits.target[chosen]).long()
        self.transform = transform
        self.split = split

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


def export_png_folders(dataset: SizedDataset, root: str | Path, *, classes: Sequence[str] | None = None,
                       overwrite: bool = False) -> Path:
    """Write each (image, label) of `dataset` as root/<class>/<index>.png, the layout ImageFolder reads.

    Images may be tensors [C, H, W] or [H, W] with values in [0, 1], or PIL images. Skips the work when
    root already holds exactly len(dataset) PNGs, unless `overwrite`.
    """
    from PIL import Image

    root = Path(root)
    classes = list(classes if classes is not None else getattr(dataset, "classes", []))
    if not classes:
        raise ValueError("classes must be given when the dataset has no `classes` attribute")
    if root.exists():
        existing = len(list(root.glob("*/*.png")))
        if existing == len(dataset) and not overwrite:
            return root
        if not overwrite:
            raise ValueError(f"{root} already holds {existing} PNGs, expected {len(dataset)}; "
                             "pass overwrite=True to rewrite it")
    # Write into a private folder, then rename: a concurrent reader never sees a half-written export.
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        for name in classes:
            (staging / name).mkdir()
        for index in range(len(dataset)):
            image, label = dataset[index]
            if isinstance(image, torch.Tensor):
                array = (image.detach().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
                if array.ndim == 3:
                    array = array.squeeze(0) if array.shape[0] == 1 else array.permute(1, 2, 0)
                image = Image.fromarray(array.numpy())
            image.save(staging / classes[int(label)] / f"{index:05d}.png")
        if root.exists():
            shutil.rmtree(root)
        try:
            staging.rename(root)
        except OSError:  # another process finished the same export first
            if len(list(root.glob("*/*.png"))) != len(dataset):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def export_digits_png(root: str | Path | None = None, *, size: int = 28) -> Path:
    """Export the digits (train and test) as PNG class folders under data/digits_png; return that folder."""
    root = Path(root) if root is not None else data_dir() / f"digits_png_{size}"
    for split in SPLITS:
        export_png_folders(DigitsDataset(split, size=size), root / split)
    return root


class PngFolderDataset(Dataset):
    """A file-backed dataset: reads root/<class>/*.png on every access, like torchvision's ImageFolder."""

    def __init__(self, root: str | Path, transform: Callable | None = None) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"root must be a folder of class sub-folders, {self.root} does not exist")
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.samples = [(path, label) for label, name in enumerate(self.classes)
                        for path in sorted((self.root / name).glob("*.png"))]
        if not self.samples:
            raise ValueError(f"root {self.root} holds no PNG files in class sub-folders")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image
        from torchvision.transforms.functional import pil_to_tensor

        path, label = self.samples[index]
        with Image.open(path) as image:
            tensor = pil_to_tensor(image.convert("L")).float().div_(255.0)
        if self.transform is not None:
            tensor = self.transform(tensor)
        return tensor, label


def fashion_mnist(split: str = "train", *, root: str | Path | None = None, download: bool = True,
                  transform: Callable | None = None) -> SizedDataset:
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
            f"({type(error).__name__}: {error}). Connect to the internet and run "
            f"`python -m helpers.data fashion`, or copy the four *-ubyte.gz files from {FASHION_URL_HELP} "
            f"into that folder by hand. Until then, the default DigitsDataset works offline."
        ) from error


def seed_worker(worker_id: int) -> None:
    """worker_init_fn: seed python and numpy in each worker from its torch seed (which differs per worker)."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def make_loader(dataset: Dataset, *, batch_size: int = 64, shuffle: bool = False, seed: int | None = None,
                num_workers: int = 0, pin_memory: bool = False, drop_last: bool = False,
                persistent_workers: bool = False, prefetch_factor: int | None = None,
                sampler=None, collate_fn: Callable | None = None, multiprocessing_context=None,
                timeout: float = 0) -> DataLoader:
    """A DataLoader with checked arguments, a seeded generator and seeded workers."""
    if not isinstance(dataset, Dataset):
        raise TypeError(f"dataset must be a torch.utils.data.Dataset, got {type(dataset).__name__}")
    _check_int("batch_size", batch_size, 1)
    _check_int("num_workers", num_workers, 0)
    if sampler is not None and shuffle:
        raise ValueError("sampler and shuffle=True are mutually exclusive: the sampler decides the order")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers=True needs num_workers >= 1, got num_workers=0")
    if prefetch_factor is not None:
        _check_int("prefetch_factor", prefetch_factor, 1)
        if num_workers == 0:
            raise ValueError("prefetch_factor needs num_workers >= 1, got num_workers=0")
    if not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout must be a number >= 0, got {timeout!r}")
    generator = None
    if seed is not None:
        _check_int("seed", seed, 0)
        generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, num_workers=num_workers,
        collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
        worker_init_fn=seed_worker if num_workers > 0 else None, generator=generator,
        multiprocessing_context=multiprocessing_context, prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
    )


class VariableLengthSequences(Dataset):
    """Token sequences of random length (1-D int64 tensors; 0 is left free for padding) with a 0/1 label.

    The label says whether a sequence is longer than the middle of [min_length, max_length], so a model
    has to look at the length. Fixed by `seed`, so the same arguments always give the same data.
    """

    def __init__(self, size: int = 100, *, min_length: int = 2, max_length: int = 12, vocab_size: int = 20,
                 seed: int = 0) -> None:
        _check_int("size", size, 1)
        _check_int("min_length", min_length, 1)
        _check_int("vocab_size", vocab_size, 2)
        _check_int("seed", seed, 0)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < min_length:
            raise ValueError(f"max_length must be an int >= min_length={min_length}, got {max_length!r}")
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_length, max_length + 1, (size,), generator=generator)
        self.sequences = [torch.randint(1, vocab_size, (int(n),), generator=generator) for n in lengths]
        self.labels = (lengths > (min_length + max_length) / 2).long()

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.sequences[index], int(self.labels[index])


def pad_collate(batch: Sequence[tuple[torch.Tensor, int]], padding_value: float = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """collate_fn for (sequence, label) samples of different lengths: (padded [B, max_len, ...], lengths [B], labels [B]).

    Pass a different `padding_value` with functools.partial(pad_collate, padding_value=...), which
    also pickles for spawn-started workers.
    """
    from torch.nn.utils.rnn import pad_sequence

    if len(batch) == 0:
        raise ValueError("batch must hold at least one (sequence, label) sample, got an empty batch")
    for position, sample in enumerate(batch):
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
            raise TypeError(f"each sample must be a (sequence, label) pair, got {type(sample).__name__} "
                            f"at position {position}")
        if not isinstance(sample[0], torch.Tensor) or sample[0].ndim == 0:
            raise TypeError(f"each sequence must be a tensor with a length dimension, got "
                            f"{type(sample[0]).__name__} at position {position}")
    sequences = [sample[0] for sample in batch]
    lengths = torch.tensor([len(sequence) for sequence in sequences])
    padded = pad_sequence(sequences, batch_first=True, padding_value=padding_value)
    labels = torch.as_tensor([sample[1] for sample in batch])
    return padded, lengths, labels


RNG_SOURCES = ("torch", "numpy", "random", "generator")


def shift_image(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """Move an image [..., H, W] by dy rows and dx columns, filling the uncovered border with zeros."""
    height, width = image.shape[-2:]
    if abs(dy) >= height or abs(dx) >= width:
        raise ValueError(f"shift (dy={dy}, dx={dx}) must be smaller than the image ({height}x{width})")
    shifted = torch.zeros_like(image)
    shifted[..., max(dy, 0):height + min(dy, 0), max(dx, 0):width + min(dx, 0)] = \
        image[..., max(-dy, 0):height + min(-dy, 0), max(-dx, 0):width + min(-dx, 0)]
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
        if not isinstance(base, Dataset):
            raise TypeError(f"base must be a torch.utils.data.Dataset, got {type(base).__name__}")
        _check_int("max_shift", max_shift, 0)
        if rng not in RNG_SOURCES:
            raise ValueError(f"rng must be one of {RNG_SOURCES}, got {rng!r}")
        _check_int("seed", seed, 0)
        self.base, self.max_shift, self.rng = base, max_shift, rng
        self.generator = np.random.default_rng(seed) if rng == "generator" else None

    def __len__(self) -> int:
        return len(self.base)

    def _draw(self) -> tuple[int, int]:
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
        return dy, dx

    def __getitem__(self, index: int) -> dict:
        from torch.utils.data import get_worker_info

        image, label = self.base[index]
        dy, dx = self._draw()
        info = get_worker_info()
        return {"image": shift_image(image, dy, dx), "label": label, "shift": torch.tensor([dy, dx]),
                "worker": -1 if info is None else info.id, "pid": os.getpid()}


def reseed_dataset_generator(worker_id: int) -> None:
    """worker_init_fn: give this worker's copy of the dataset its own numpy Generator, seeded with the worker's seed."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        raise RuntimeError("reseed_dataset_generator runs inside a DataLoader worker; pass it as worker_init_fn")
    if getattr(info.dataset, "generator", None) is None:
        raise TypeError(f"the worker's dataset ({type(info.dataset).__name__}) has no numpy `generator` to reseed")
    setattr(info.dataset, "generator", np.random.default_rng(info.seed))  # this worker's copy only


class SlowDataset(Dataset):
    """Wraps a dataset and sleeps `delay_s` seconds on each access: slow storage, or a reader that got stuck."""

    def __init__(self, base: SizedDataset, delay_s: float) -> None:
        if not isinstance(base, Dataset):
            raise TypeError(f"base must be a torch.utils.data.Dataset, got {type(base).__name__}")
        if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not delay_s >= 0:
            raise ValueError(f"delay_s must be a number >= 0, got {delay_s!r}")
        self.base, self.delay_s = base, float(delay_s)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        import time

        time.sleep(self.delay_s)
        return self.base[index]


def _main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m helpers.data", description="Prepare datasets under data/.")
    parser.add_argument("what", choices=["digits-png", "fashion"], help="export the digits as PNGs, or download FashionMNIST")
    args = parser.parse_args(argv)
    if args.what == "digits-png":
        print(f"digits written to {export_digits_png()}")
    else:
        for split in SPLITS:
            dataset = fashion_mnist(split)
            print(f"FashionMNIST {split}: {len(dataset)} images in {data_dir()}")


if __name__ == "__main__":
    _main()
