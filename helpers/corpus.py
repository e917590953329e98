"""A real text corpus on every machine, offline: Python's own source as byte tokens, cached as memory-mapped files,
cut into windows for a byte-level GPT and served in a resumable, rank-aware order."""

from __future__ import annotations

import hashlib
import json
import mmap
import operator
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .checks import check_choice, check_int

VOCAB_SIZE = 256
SPLITS = ("train", "validation", "test")
# Bump when the way files are assigned to splits changes: every cache is then rebuilt.
SPLIT_RULE_VERSION = 1
# A corpus whose smallest split holds fewer bytes than this is too small to train or evaluate on.
MIN_SPLIT_BYTES = 1024
# Below this many bytes of standard-library source, the Python is taken as stripped and the packages are read.
MIN_STDLIB_BYTES = 1_000_000
# A build folder left this long (a killed build) is removed by the next build.
STALE_BUILD_SECONDS = 3600


def _check_path(name: str, value: Any, *, allow_none: bool = True) -> None:
    """Raise a TypeError naming `name` unless `value` is a str or a path (or None, if allowed)."""
    if (value is None and allow_none) or isinstance(value, (str, os.PathLike)):
        return
    allowed = "None, a str or a Path" if allow_none else "a str or a Path"
    raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}")


def _python_files(root: Path, skipped_folders: tuple[str, ...]) -> list[Path]:
    """The .py files under `root`, sorted, skipping folders with any of the names in `skipped_folders`."""
    found: list[Path] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in skipped_folders]
        found.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(found)


def stdlib_sources(stdlib: str | Path | None = None) -> list[Path]:
    """The Python standard library's own .py files, sorted: under sysconfig.get_paths()["stdlib"] (or `stdlib`),
    leaving out any path with a site-packages or dist-packages folder and __pycache__."""
    _check_path("stdlib", stdlib)
    if stdlib is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        if not root.is_dir():  # a frozen or embedded Python
            return []
    else:
        root = Path(stdlib)
        if not root.is_dir():
            raise FileNotFoundError(f"stdlib must be an existing folder, got {str(stdlib)!r}")
    return _python_files(root, ("site-packages", "dist-packages", "__pycache__"))


def _package_roots(roots: Sequence[str | Path] | None) -> list[Path]:
    """`roots` as Paths, or sysconfig's purelib and platlib folders that exist, without repeats."""
    if roots is None:
        paths = sysconfig.get_paths()
        candidates = [Path(paths["purelib"]), Path(paths["platlib"])]
        return [root for i, root in enumerate(candidates) if root.is_dir() and root not in candidates[:i]]
    if isinstance(roots, (str, os.PathLike)) or not isinstance(roots, Sequence):
        raise TypeError(f"roots must be None or a sequence of folders (str or Path), got {type(roots).__name__}")
    for root in roots:
        _check_path("roots", root, allow_none=False)
        if not Path(root).is_dir():
            raise FileNotFoundError(f"roots must hold existing folders, got {str(root)!r}")
    return list(dict.fromkeys(Path(root) for root in roots))


def package_sources(roots: Sequence[str | Path] | None = None) -> list[Path]:
    """The installed packages' own .py files, sorted (sysconfig's purelib and platlib, or `roots`): the corpus
    where a stripped Python ships no standard-library sources."""
    found: set[Path] = set()
    for root in _package_roots(roots):
        found.update(_python_files(root, ("__pycache__",)))
    return sorted(found)


def split_of(relative_path: str) -> str:
    """'train', 'validation' or 'test' for a file, from a stable hash of its relative POSIX path (hashlib, not
    hash()): about 90% / 5% / 5%, the same on every machine and in every process."""
    if not isinstance(relative_path, str):
        raise TypeError(f"relative_path must be a str (a POSIX path such as 'json/decoder.py'), got {relative_path!r}")
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode("utf-8")).digest()[:8], "big") % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


@dataclass(frozen=True)
class Corpus:
    """A corpus cached as one file of byte tokens per split, with its name and a one-line description."""

    name: str
    description: str
    folder: Path
    files: int

    def tokens(self, split: str) -> np.ndarray:
        """The split's bytes as a read-only np.memmap of uint8 (opened on each call, cheap)."""
        check_choice("split", split, SPLITS)
        return np.memmap(self.folder / f"{split}.bin", dtype=np.uint8, mode="r")

    def sizes(self) -> dict[str, int]:
        """Tokens (bytes) per split."""
        return {split: (self.folder / f"{split}.bin").stat().st_size for split in SPLITS}


def _megabytes(size: int) -> str:
    """A byte count for a reader: '34.1 MB', or '20.5 kB' below 0.1 MB."""
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"


def _describe(what: str, files: int, sizes: dict[str, int]) -> str:
    """One line: what was read, how many files, and the bytes per split."""
    per_split = ", ".join(f"{split} {_megabytes(size)}" for split, size in sizes.items())
    count = "1 file" if files == 1 else f"{files:,} files"
    return f"{what}: {count}, {_megabytes(sum(sizes.values()))} ({per_split})"


def _short(value: Any) -> str:
    """repr(value), cut to 100 characters (a learner may pass a whole text where a path is expected)."""
    text = repr(str(value))
    return text if len(text) <= 100 else text[:97] + "..."


def _text_files(folder: Path, skipped: Path) -> list[Path]:
    """The regular files under `folder`, sorted by relative path, without hidden ones, __pycache__ and `skipped`."""
    skipped = skipped.resolve()
    found: list[Path] = []
    for parent, subfolders, names in os.walk(folder):
        subfolders[:] = [
            name
            for name in subfolders
            if not name.startswith(".") and name != "__pycache__" and Path(parent, name).resolve() != skipped
        ]
        found.extend(Path(parent, name) for name in names if not name.startswith(".") and Path(parent, name).is_file())
    return sorted(found, key=lambda path: path.relative_to(folder).as_posix())


@dataclass(frozen=True)
class _Plan:
    """What to read and how: the files with their paths relative to a source root, and the split rule."""

    name: str
    what: str  # the start of the description
    sources: list[tuple[Path, str]]  # (file, relative POSIX path), in reading order
    source_roots: list[Path]
    by_file: bool  # split by split_of of each file, else by position in the concatenation
    separator: bytes  # written after each file


def _relative_to_any(path: Path, roots: list[Path]) -> str:
    """`path` relative to the first of `roots` that holds it, as a POSIX path."""
    for root in roots:
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return path.as_posix()


def _plan(text: str | Path | None, root: Path) -> _Plan:
    """Which files `load_corpus(text)` reads, how they are split and what the corpus is called."""
    if text is None:
        stdlib_root = Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_sources()
        if sum(path.stat().st_size for path in files) >= MIN_STDLIB_BYTES:
            version = f"{sys.version_info.major}.{sys.version_info.minor}"
            sources = [(path, path.relative_to(stdlib_root).as_posix()) for path in files]
            return _Plan(
                "python-stdlib", f"the Python {version} standard library's source", sources, [stdlib_root], True, b"\n"
            )
        roots = _package_roots(None)
        sources = [(path, _relative_to_any(path, roots)) for path in package_sources(roots)]
        what = "the installed packages' Python source (this Python ships no standard-library source)"
        return _Plan("site-packages", what, sources, roots, True, b"\n")
    path = Path(text)
    if path.is_file():
        return _Plan("text", f"the text file {path.name}", [(path, path.name)], [path.parent], False, b"")
    if path.is_dir():
        sources = [(file, file.relative_to(path).as_posix()) for file in _text_files(path, root)]
        splits = {split_of(relative) for _, relative in sources}
        return _Plan(
            "text", f"the text files under {path.resolve().name}/", sources, [path], splits == set(SPLITS), b"\n"
        )
    raise FileNotFoundError(
        f"text must be None or an existing file or folder, got {_short(text)} ({path} does not exist)"
    )


def _fingerprint(plan: _Plan) -> str:
    """sha256 over the split rule, the source roots and each file's relative path and size."""
    digest = hashlib.sha256(f"split rule {SPLIT_RULE_VERSION}, by file {plan.by_file}\n".encode())
    for source_root in plan.source_roots:
        digest.update(f"root {source_root.resolve().as_posix()}\n".encode())
    for path, relative in plan.sources:
        digest.update(f"{relative}\0{path.stat().st_size}\n".encode())
    return digest.hexdigest()


def _planned_sizes(plan: _Plan) -> dict[str, int]:
    """The bytes each split will hold, from the files' sizes."""
    sizes = dict.fromkeys(SPLITS, 0)
    if plan.by_file:
        for path, relative in plan.sources:
            sizes[split_of(relative)] += path.stat().st_size + len(plan.separator)
        return sizes
    total = sum(path.stat().st_size + len(plan.separator) for path, _ in plan.sources)
    ends = _position_ends(total)
    return {"train": ends[0], "validation": ends[1] - ends[0], "test": total - ends[1]}


def _position_ends(total: int) -> tuple[int, int]:
    """Where train and validation end when `total` bytes are split 90% / 5% / 5% by position."""
    return total * 90 // 100, total * 95 // 100


def _write_splits(plan: _Plan, folder: Path) -> dict[str, int]:
    """Write train.bin, validation.bin and test.bin into `folder`; the bytes written per split."""
    if plan.by_file:
        sizes = dict.fromkeys(SPLITS, 0)
        outputs = {split: open(folder / f"{split}.bin", "wb") for split in SPLITS}  # noqa: SIM115 (closed below)
        try:
            for path, relative in plan.sources:
                split = split_of(relative)
                sizes[split] += outputs[split].write(path.read_bytes() + plan.separator)
        finally:
            for output in outputs.values():
                output.close()
        return sizes
    data = b"".join(path.read_bytes() + plan.separator for path, _ in plan.sources)
    train_end, validation_end = _position_ends(len(data))
    parts = {"train": data[:train_end], "validation": data[train_end:validation_end], "test": data[validation_end:]}
    for split, part in parts.items():
        (folder / f"{split}.bin").write_bytes(part)
    return {split: len(part) for split, part in parts.items()}


def _remove_stale_builds(root: Path) -> None:
    """Remove build folders that a killed build left behind over an hour ago."""
    for leftover in root.glob(".building-*"):
        try:
            if time.time() - leftover.stat().st_mtime > STALE_BUILD_SECONDS:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:  # another process removed it first
            pass


def _build(plan: _Plan, folder: Path, fingerprint: str) -> None:
    """Build the cache in a temporary folder next to `folder` and rename it into place (or use a finished one)."""
    _remove_stale_builds(folder.parent)
    building = Path(tempfile.mkdtemp(prefix=f".building-{folder.name}-", dir=folder.parent))
    try:
        sizes = _write_splits(plan, building)
        manifest = {
            "name": plan.name,
            "description": _describe(plan.what, len(plan.sources), sizes),
            "files": len(plan.sources),
            "bytes": sizes,
            "fingerprint": fingerprint,
            "source": [str(source_root) for source_root in plan.source_roots],
            "separator": plan.separator.decode(),
            "split_rule_version": SPLIT_RULE_VERSION,
        }
        (building / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        for attempt in range(2):
            try:
                os.rename(building, folder)
                return
            except OSError:
                if (folder / "manifest.json").exists():  # another process finished first: use its folder
                    return
                if attempt == 1:
                    raise
                shutil.rmtree(folder, ignore_errors=True)  # a folder without a manifest was not built here
    finally:
        shutil.rmtree(building, ignore_errors=True)  # left only when another process finished first


def load_corpus(text: str | Path | None = None, *, root: str | Path | None = None) -> Corpus:
    """The corpus as byte tokens, cached under `root` (default: helpers.data.data_dir() / "corpus", which honours
    COURSE_DATA_DIR) as memory-mapped files, built on first use and rebuilt when the source list changes.

    `text` None reads the standard library's .py files (the installed packages' where a stripped Python has under
    1 MB of them), split by file with `split_of`. A path to a file splits its bytes by position: the first 90% train,
    the next 5% validation, the last 5% test. A folder reads its regular files (recursively, sorted, hidden files and
    __pycache__ skipped), split by file, or by position over their concatenation when a split would get no file.
    Each file of a folder (or the standard library) is followed by one newline byte. The cache folder is named by a
    fingerprint of the files' relative paths and sizes: an edit that keeps a file's size is not noticed. Several
    processes may call this at once (DDP ranks, DataLoader workers): each builds aside and renames into place.
    """
    _check_path("text", text)
    _check_path("root", root)
    from .data import data_dir

    cache_root = Path(root) if root is not None else data_dir() / "corpus"
    plan = _plan(text, cache_root)
    fingerprint = _fingerprint(plan)
    sizes = _planned_sizes(plan)
    smallest = min(SPLITS, key=lambda split: sizes[split])
    if sizes[smallest] < MIN_SPLIT_BYTES:
        raise ValueError(
            f"text {_short(text) if text is not None else 'None'} gives a {smallest} split of {sizes[smallest]:,} "
            f"bytes; every split needs at least {MIN_SPLIT_BYTES:,} bytes (for one text file, about "
            f"{MIN_SPLIT_BYTES * 20:,} bytes in all)"
        )
    folder = cache_root / f"{plan.name}-{fingerprint[:12]}"
    if not (folder / "manifest.json").exists():
        cache_root.mkdir(parents=True, exist_ok=True)
        _build(plan, folder, fingerprint)
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    return Corpus(name=manifest["name"], description=manifest["description"], folder=folder, files=manifest["files"])


def encode(text: str) -> torch.Tensor:
    """`text`'s UTF-8 bytes as a 1-D int64 tensor of tokens."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return torch.from_numpy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64))


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """Byte tokens back to text; a broken UTF-8 sequence (a model may emit one) becomes '�'."""
    values = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    if values.size == 0:
        return ""
    if values.dtype.kind not in "iu":
        raise TypeError(f"tokens must hold ints (byte values), got dtype {values.dtype}")
    if values.ndim != 1:
        raise ValueError(f"tokens must be 1-D (one sequence), got shape {list(values.shape)}; decode each row")
    if values.min() < 0 or values.max() >= VOCAB_SIZE:
        raise ValueError(f"tokens must be byte values in [0, 255], got values in [{values.min()}, {values.max()}]")
    return values.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _byte_counts(name: str, tokens: Any) -> np.ndarray:
    """How often each of the 256 byte values occurs in `tokens`, checked to be byte tokens."""
    values = np.asarray(tokens)
    if values.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an array of byte tokens (ints in [0, 255]), got dtype {values.dtype}")
    if values.size == 0:
        raise ValueError(f"{name} must hold at least one token, got an empty array")
    if values.dtype != np.uint8 and (values.min() < 0 or values.max() >= VOCAB_SIZE):
        raise ValueError(f"{name} must hold byte tokens in [0, 255], got values in [{values.min()}, {values.max()}]")
    flat, chunk = values.reshape(-1), 1 << 24  # torch.bincount of uint8 is ~10x numpy's, in chunks of 16 MB
    counts = torch.zeros(VOCAB_SIZE, dtype=torch.int64)
    for start in range(0, flat.size, chunk):
        counts += torch.bincount(torch.from_numpy(flat[start : start + chunk].astype(np.uint8)), minlength=VOCAB_SIZE)
    return counts.numpy()


def unigram_loss(train: np.ndarray, evaluated: np.ndarray) -> float:
    """The cross-entropy in nats of predicting every byte of `evaluated` by the byte frequencies of `train`
    (add-one smoothed): the baseline a model that ignores context reaches, which a trained GPT must beat."""
    train_counts = _byte_counts("train", train) + 1
    evaluated_counts = _byte_counts("evaluated", evaluated)
    log_probabilities = np.log(train_counts) - np.log(train_counts.sum())
    return float(-(evaluated_counts * log_probabilities).sum() / evaluated_counts.sum())


def _memmap_source(tokens: np.ndarray) -> tuple[str, int, int, str] | None:
    """(file, byte offset, length, dtype) to reopen `tokens` if it is a contiguous 1-D view of a file, else None."""
    if not isinstance(tokens, np.memmap) or tokens.filename is None or not tokens.flags.c_contiguous:
        return None
    mapped: Any = tokens
    while isinstance(mapped, np.ndarray) and not isinstance(mapped.base, mmap.mmap):
        mapped = mapped.base  # a slice of a memmap: walk back to the array over the whole mapping
    if not isinstance(mapped, np.memmap):
        return None
    start = tokens.__array_interface__["data"][0] - mapped.__array_interface__["data"][0]
    return str(tokens.filename), int(mapped.offset) + start, len(tokens), tokens.dtype.str


class TokenWindows(Dataset):
    """Non-overlapping windows of block_size + 1 tokens: window i is tokens[i*block_size : i*block_size + block_size + 1],
    returned as (inputs, targets) = (window[:-1], window[1:]) as int64 tensors.

    Negative indices count from the end, as for a list. Given a np.memmap (Corpus.tokens, or a slice of it), a
    pickled copy (a DataLoader worker's, under spawn) holds only the file's name and the slice's place, and reopens
    the file on first use; a plain array is pickled as is.
    """

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            described = f"shape {list(tokens.shape)}, dtype {tokens.dtype}" if isinstance(tokens, np.ndarray) else ""
            raise TypeError(
                f"tokens must be a 1-D np.ndarray of ints (e.g. Corpus.tokens('train')), got "
                f"{type(tokens).__name__} {described}".rstrip()
            )
        check_int("block_size", block_size)
        if block_size > len(tokens) - 1:
            raise ValueError(
                f"block_size must be at most {max(len(tokens) - 1, 0):,} for a split of {len(tokens):,} tokens "
                f"(a window holds block_size + 1 tokens), got {block_size:,}"
            )
        self.block_size = block_size
        self._source = _memmap_source(tokens)
        self._tokens: np.ndarray | None = tokens

    @property
    def tokens(self) -> np.ndarray:
        """The tokens the windows are cut from (reopened from the file after unpickling)."""
        if self._tokens is None:
            assert self._source is not None
            filename, offset, length, dtype = self._source
            self._tokens = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))
        return self._tokens

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = operator.index(index)
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"window index {index} is out of range for {count:,} windows")
        start = (index % count) * self.block_size
        window = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._source is not None:
            state["_tokens"] = None  # reopened from the file where it is unpickled
        return state


class WindowBatches(Sampler[list[int]]):
    """One rank's batches of window indices, forever: epoch e visits every window once in the order
    torch.randperm draws from a generator seeded with seed + e; that stream is cut into global batches of
    world_size * batch_size windows, and rank r takes the r-th slice of batch_size of each. Every window is
    visited exactly once per epoch over all ranks (an epoch's end may fall inside a global batch), and DataLoader
    workers receive whole batches in order, so workers change nothing. The position is one int: `start`, the
    global batch to begin at (a run resumed after step s with accumulation A starts at s * A).

    Each iteration begins at `start`. There is no len(): the stream is infinite, so a DataLoader built on it
    must not be asked for its len(); draw a number of steps with next() instead.
    """

    def __init__(
        self, num_windows: int, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1, start: int = 0
    ) -> None:
        check_int("num_windows", num_windows)
        check_int("batch_size", batch_size)
        check_int("seed", seed, minimum=0, maximum=2**32 - 1)
        check_int("world_size", world_size)
        check_int("rank", rank, minimum=0, maximum=world_size - 1)
        check_int("start", start, minimum=0)
        super().__init__()
        self.num_windows = num_windows
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start = start

    def _order(self, epoch: int, cached: dict[int, torch.Tensor]) -> torch.Tensor:
        """Epoch `epoch`'s permutation of the windows, keeping only the latest one in `cached`."""
        if epoch not in cached:
            cached.clear()
            generator = torch.Generator().manual_seed(self.seed + epoch)
            cached[epoch] = torch.randperm(self.num_windows, generator=generator)
        return cached[epoch]

    def __iter__(self) -> Iterator[list[int]]:
        cached: dict[int, torch.Tensor] = {}
        global_batch = self.start
        while True:
            position = (global_batch * self.world_size + self.rank) * self.batch_size
            batch: list[int] = []
            while len(batch) < self.batch_size:
                epoch, offset = divmod(position, self.num_windows)
                taken = self._order(epoch, cached)[offset : offset + self.batch_size - len(batch)]
                batch.extend(taken.tolist())
                position += len(taken)
            yield batch
            global_batch += 1

    def epoch_of(self, global_batch: int) -> int:
        """The epoch that global batch `global_batch`'s first window belongs to."""
        check_int("global_batch", global_batch, minimum=0)
        return global_batch * self.world_size * self.batch_size // self.num_windows


def window_loader(
    windows: TokenWindows,
    batch_size: int,
    *,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    start: int = 0,
    workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader of (inputs, targets) batches of shape [batch_size, block_size] over `windows`, in WindowBatches'
    order; `workers` processes read ahead (kept alive: persistent_workers), pinned memory for a GPU's asynchronous copy.

    Infinite: draw batches with next(); len() of it raises a TypeError. The loader has a generator of its own, so
    starting to iterate it draws nothing from the global RNG (a resumed run's dropout masks stay those of the run
    that never stopped).
    """
    if not isinstance(windows, TokenWindows):
        raise TypeError(f"windows must be a TokenWindows, got {type(windows).__name__}")
    check_int("workers", workers, minimum=0)
    if not isinstance(pin_memory, bool):
        raise TypeError(f"pin_memory must be a bool, got {pin_memory!r}")
    sampler = WindowBatches(len(windows), batch_size, seed=seed, rank=rank, world_size=world_size, start=start)
    generator = torch.Generator().manual_seed(seed)  # the workers' base seed; the windows need no randomness
    return DataLoader(
        windows,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        generator=generator,
    )
