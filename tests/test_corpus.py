import math
import pickle
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.corpus import (
    SPLITS,
    VOCAB_SIZE,
    Corpus,
    TokenWindows,
    WindowBatches,
    decode,
    encode,
    load_corpus,
    package_sources,
    split_of,
    stdlib_sources,
    unigram_loss,
    window_loader,
)


def _write_folder(folder: Path, files: int = 200, size: int = 1000) -> list[Path]:
    """`files` text files of `size` bytes each (plus a hidden file and a __pycache__ that must be skipped)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        path = folder / f"part{i // 10}" / f"file{i:03d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(bytes((i + j) % 251 for j in range(size)))
        paths.append(path)
    (folder / ".hidden").write_bytes(b"h" * 5000)
    (folder / "__pycache__").mkdir(exist_ok=True)
    (folder / "__pycache__" / "x.pyc").write_bytes(b"p" * 5000)
    return paths


def _concatenated(paths: list[Path], split: str, root: Path) -> bytes:
    """The bytes of `split` as load_corpus writes them for files split by file: each file then a newline."""
    chosen = sorted(path for path in paths if split_of(path.relative_to(root).as_posix()) == split)
    return b"".join(path.read_bytes() + b"\n" for path in chosen)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(256)) * 100)  # 25,600 bytes
    return path


def test_stdlib_sources_are_sorted_python_files_without_site_packages():
    files = stdlib_sources()
    assert files, "this Python ships its standard library's source"
    assert files == sorted(files)
    assert all(path.suffix == ".py" for path in files)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = {part for path in files for part in path.relative_to(stdlib).parts}
    assert not parts & {"site-packages", "dist-packages", "__pycache__"}


def test_stdlib_sources_of_a_given_folder(tmp_path: Path):
    for name in ("a.py", "sub/b.py", "site-packages/c.py", "x/dist-packages/d.py", "__pycache__/e.py", "f.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("pass\n")
    assert stdlib_sources(tmp_path) == [tmp_path / "a.py", tmp_path / "sub" / "b.py"]
    with pytest.raises(FileNotFoundError, match="stdlib"):
        stdlib_sources(tmp_path / "missing")
    with pytest.raises(TypeError, match="stdlib"):
        stdlib_sources(3)  # type: ignore[arg-type]


def test_package_sources_of_given_roots(tmp_path: Path):
    for name in ("one/pkg/a.py", "one/pkg/__pycache__/a.py", "two/b.py", "two/c.so"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("pass\n")
    roots: list[str | Path] = [tmp_path / "two", str(tmp_path / "one")]
    assert package_sources(roots) == [tmp_path / "one" / "pkg" / "a.py", tmp_path / "two" / "b.py"]
    with pytest.raises(TypeError, match="roots"):
        package_sources(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="roots"):
        package_sources([tmp_path / "missing"])


def test_split_of_is_deterministic_and_about_90_5_5_on_the_stdlib():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    relative = [path.relative_to(stdlib).as_posix() for path in stdlib_sources()]
    splits = [split_of(path) for path in relative]
    assert splits == [split_of(path) for path in relative]
    shares = {split: splits.count(split) / len(splits) for split in SPLITS}
    print(shares)
    assert set(splits) <= set(SPLITS)
    assert shares["train"] == pytest.approx(0.90, abs=0.03)
    assert shares["validation"] == pytest.approx(0.05, abs=0.03)
    assert shares["test"] == pytest.approx(0.05, abs=0.03)
    assert min(shares.values()) > 0
    with pytest.raises(TypeError, match="relative_path"):
        split_of(Path("a.py"))


def test_a_text_file_splits_90_5_5_by_position(tmp_path: Path, text_file: Path):
    corpus = load_corpus(text_file, root=tmp_path / "cache")
    data = text_file.read_bytes()
    assert corpus.name == "text" and corpus.files == 1
    assert corpus.sizes() == {"train": 23_040, "validation": 1_280, "test": 1_280}
    assert (
        corpus.tokens("train").tobytes() + corpus.tokens("validation").tobytes() + corpus.tokens("test").tobytes()
        == data
    )
    assert corpus.tokens("validation").tobytes() == data[23_040:24_320]
    assert "text.txt" in corpus.description and "1 file" in corpus.description
    tokens = corpus.tokens("train")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint8 and not tokens.flags.writeable


def test_a_folder_splits_by_file_with_a_newline_after_each(tmp_path: Path):
    source = tmp_path / "texts"
    paths = _write_folder(source, files=200)
    corpus = load_corpus(source, root=tmp_path / "cache")
    assert corpus.files == 200 and corpus.name == "text"
    for split in SPLITS:
        assert corpus.tokens(split).tobytes() == _concatenated(paths, split, source)
    assert sum(corpus.sizes().values()) == 200 * 1001


def test_a_folder_with_an_empty_split_by_file_is_split_by_position(tmp_path: Path):
    source = tmp_path / "texts"
    paths = _write_folder(source, files=3, size=10_000)
    corpus = load_corpus(source, root=tmp_path / "cache")
    data = b"".join(path.read_bytes() + b"\n" for path in sorted(paths))
    assert corpus.tokens("train").tobytes() == data[: len(data) * 90 // 100]
    assert corpus.tokens("test").tobytes() == data[len(data) * 95 // 100 :]


def test_a_cache_inside_the_source_folder_is_not_read_as_source(tmp_path: Path):
    _write_folder(tmp_path, files=200)
    first = load_corpus(tmp_path, root=tmp_path / "cache")
    assert load_corpus(tmp_path, root=tmp_path / "cache").folder == first.folder


def test_load_corpus_reuses_its_cache_and_rebuilds_when_a_file_is_added(tmp_path: Path):
    source = tmp_path / "texts"
    _write_folder(source, files=200)
    root = tmp_path / "cache"
    first = load_corpus(source, root=root)
    written = {path.name: path.stat().st_mtime_ns for path in first.folder.iterdir()}
    again = load_corpus(str(source), root=str(root))
    assert again == first
    assert {path.name: path.stat().st_mtime_ns for path in again.folder.iterdir()} == written
    assert set(written) == {"train.bin", "validation.bin", "test.bin", "manifest.json"}
    assert [path.name for path in root.iterdir()] == [first.folder.name]  # no build folder left behind
    (source / "new.txt").write_bytes(b"more text\n" * 50)
    rebuilt = load_corpus(source, root=root)
    assert rebuilt.folder != first.folder and rebuilt.files == 201
    assert sum(rebuilt.sizes().values()) == sum(first.sizes().values()) + 501


def test_a_finished_folder_of_another_process_is_used(tmp_path: Path, text_file: Path, monkeypatch):
    """Two processes build at once: the one whose rename loses uses the winner's folder and removes its own."""
    first = load_corpus(text_file, root=tmp_path / "cache")
    manifest = first.folder / "manifest.json"
    built = manifest.read_text()
    manifest.unlink()  # as if the first build had not finished when the second began
    exists = Path.exists

    def finished_meanwhile(path: Path) -> bool:
        if path == manifest and not exists(path):
            manifest.write_text(built)  # the other process finishes now: the rename below loses
            return False
        return exists(path)

    monkeypatch.setattr(Path, "exists", finished_meanwhile)
    second = load_corpus(text_file, root=tmp_path / "cache")
    assert second == first
    assert sorted(path.name for path in (tmp_path / "cache").iterdir()) == [first.folder.name]


def test_load_corpus_errors_name_text(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"text .*missing\.txt"):
        load_corpus(tmp_path / "missing.txt", root=tmp_path)
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 10_000)
    with pytest.raises(ValueError, match=r"text .*small\.txt.* validation split of 500 bytes.*at least 1,024"):
        load_corpus(small, root=tmp_path / "cache")
    with pytest.raises(TypeError, match="text"):
        load_corpus(3, root=tmp_path)  # type: ignore[arg-type]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"text .*empty.* split of 0 bytes"):
        load_corpus(tmp_path / "empty", root=tmp_path / "cache")
    with pytest.raises(ValueError, match="split"):
        Corpus("text", "", tmp_path, 1).tokens("valid")


def test_load_corpus_default_root_honours_course_data_dir(tmp_path: Path, text_file: Path, monkeypatch):
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path / "data"))
    assert load_corpus(text_file).folder.parent == tmp_path / "data" / "corpus"


@pytest.mark.slow
def test_the_stdlib_corpus(tmp_path: Path):
    corpus = load_corpus(root=tmp_path)
    assert corpus.name == "python-stdlib" and "standard library" in corpus.description
    files = stdlib_sources()
    assert corpus.files == len(files)
    sizes = corpus.sizes()
    assert sum(sizes.values()) == sum(path.stat().st_size + 1 for path in files)
    assert sizes["train"] > 10 * sizes["validation"] and min(sizes.values()) > 100_000
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    first_train = next(path for path in files if split_of(path.relative_to(stdlib).as_posix()) == "train")
    head = first_train.read_bytes() + b"\n"
    assert corpus.tokens("train")[: len(head)].tobytes() == head
    assert load_corpus(root=tmp_path) == corpus
    loss = unigram_loss(corpus.tokens("train"), corpus.tokens("validation"))
    assert 2.0 < loss < math.log(VOCAB_SIZE)


def test_encode_decode_round_trip():
    text = "def f(x):  # naïve → ✓ 🐍\n"
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and tokens.shape == (len(text.encode()),)
    assert tokens[:3].tolist() == [100, 101, 102]
    assert decode(tokens) == text
    assert decode(tokens.tolist()) == text
    assert decode([]) == "" and encode("").shape == (0,)
    assert decode([104, 105, 0xE2, 0x82]) == "hi\ufffd"  # a cut multi-byte sequence
    with pytest.raises(ValueError, match="tokens"):
        decode([300])
    with pytest.raises(ValueError, match="1-D"):
        decode(tokens[None])
    with pytest.raises(TypeError, match="text"):
        encode(b"bytes")


def test_unigram_loss_by_hand_and_for_uniform_bytes():
    train = np.array([0, 0, 1], dtype=np.uint8)  # add-one counts: 3, 2 and 1 for each of the other 254 bytes
    evaluated = np.array([0, 1, 2], dtype=np.uint8)
    total = 3 + 2 + 254
    expected = -(math.log(3 / total) + math.log(2 / total) + math.log(1 / total)) / 3
    assert unigram_loss(train, evaluated) == pytest.approx(expected)
    uniform = np.arange(256, dtype=np.uint8)
    assert unigram_loss(uniform, np.array([7, 7, 200], dtype=np.uint8)) == pytest.approx(math.log(256))
    assert unigram_loss(np.arange(256), np.arange(256)) == pytest.approx(math.log(256))
    with pytest.raises(ValueError, match="evaluated"):
        unigram_loss(uniform, np.array([], dtype=np.uint8))
    with pytest.raises(ValueError, match="train"):
        unigram_loss(np.array([256]), uniform)
    with pytest.raises(TypeError, match="train"):
        unigram_loss(np.array([0.5]), uniform)


def test_token_windows_shift_by_one_and_cover_the_split():
    tokens = np.arange(23, dtype=np.uint8)
    windows = TokenWindows(tokens, 5)
    assert len(windows) == 4  # (23 - 1) // 5
    inputs, targets = windows[0]
    assert inputs.dtype == torch.int64 and inputs.shape == (5,) and targets.shape == (5,)
    assert inputs.tolist() == [0, 1, 2, 3, 4] and targets.tolist() == [1, 2, 3, 4, 5]
    assert windows[1][0].tolist() == [5, 6, 7, 8, 9]
    last_inputs, last_targets = windows[3]
    assert last_inputs.tolist() == [15, 16, 17, 18, 19] and last_targets.tolist() == [16, 17, 18, 19, 20]
    assert windows[-1][0].tolist() == last_inputs.tolist()
    for index in (4, -5):
        with pytest.raises(IndexError):
            windows[index]


def test_token_windows_boundaries_and_errors():
    assert len(TokenWindows(np.zeros(9, dtype=np.uint8), 8)) == 1  # block_size + 1 tokens: one window
    with pytest.raises(ValueError, match=r"block_size must be at most 7 for a split of 8 tokens"):
        TokenWindows(np.zeros(8, dtype=np.uint8), 8)
    with pytest.raises(ValueError, match="block_size"):
        TokenWindows(np.zeros(8, dtype=np.uint8), 0)
    with pytest.raises(TypeError, match="tokens"):
        TokenWindows(torch.zeros(8), 2)
    with pytest.raises(TypeError, match="tokens"):
        TokenWindows(np.zeros((2, 8), dtype=np.uint8), 2)


def test_token_windows_over_a_memmap_pickle_small(tmp_path: Path):
    path = tmp_path / "tokens.bin"
    data = np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    tokens = np.memmap(path, dtype=np.uint8, mode="r")
    for source in (tokens, tokens[12_345:150_000]):  # the whole file, and a slice of it
        windows = TokenWindows(source, 64)
        pickled = pickle.dumps(windows)
        assert len(pickled) < 10_000
        copy = pickle.loads(pickled)
        assert len(copy) == len(windows)
        for index in (0, 1, len(windows) - 1):
            assert all(torch.equal(a, b) for a, b in zip(copy[index], windows[index]))
    plain = TokenWindows(data[:1000], 64)
    assert torch.equal(pickle.loads(pickle.dumps(plain))[3][0], plain[3][0])


def _epoch_windows(batches: WindowBatches, steps: int) -> list[list[int]]:
    """The first `steps` batches of `batches`."""
    iterator = iter(batches)
    return [next(iterator) for _ in range(steps)]


@pytest.mark.parametrize("num_windows", [24, 29])  # divisible by world_size * batch_size = 6, and not
def test_window_batches_visit_every_window_once_per_epoch_over_ranks(num_windows: int):
    world_size, batch_size, epochs = 3, 2, 4
    steps = math.ceil(epochs * num_windows / (world_size * batch_size)) + 1
    per_rank = [
        _epoch_windows(WindowBatches(num_windows, batch_size, seed=5, rank=rank, world_size=world_size), steps)
        for rank in range(world_size)
    ]
    assert all(len(batch) == batch_size for batches in per_rank for batch in batches)
    stream = [index for step in range(steps) for rank in range(world_size) for index in per_rank[rank][step]]
    for epoch in range(epochs):
        assert sorted(stream[epoch * num_windows : (epoch + 1) * num_windows]) == list(range(num_windows))
    first = stream[:num_windows]
    order = torch.randperm(num_windows, generator=torch.Generator().manual_seed(5)).tolist()
    assert first == order
    assert stream[num_windows : 2 * num_windows] != first  # the next epoch is reshuffled


def test_window_batches_seed_and_start():
    same = _epoch_windows(WindowBatches(50, 4, seed=1), 30)
    assert same == _epoch_windows(WindowBatches(50, 4, seed=1), 30)
    assert same != _epoch_windows(WindowBatches(50, 4, seed=2), 30)
    assert _epoch_windows(WindowBatches(50, 4, seed=1, start=17), 13) == same[17:]
    ranks = [_epoch_windows(WindowBatches(50, 4, seed=1, rank=rank, world_size=2), 30) for rank in range(2)]
    resumed = _epoch_windows(WindowBatches(50, 4, seed=1, rank=1, world_size=2, start=9), 21)
    assert resumed == ranks[1][9:]
    big = WindowBatches(3, 8)  # batches larger than an epoch
    stream = [index for batch in _epoch_windows(big, 3) for index in batch]  # 24 windows: 8 epochs
    assert all(sorted(stream[epoch * 3 : epoch * 3 + 3]) == [0, 1, 2] for epoch in range(8))


def test_window_batches_epoch_of():
    batches = WindowBatches(10, 2, world_size=2)  # 4 windows per global batch
    assert [batches.epoch_of(g) for g in range(6)] == [0, 0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="global_batch"):
        batches.epoch_of(-1)
    assert not hasattr(batches, "__len__")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, 1\], got 2"),
        ({"seed": 2**32}, r"seed must be an int in \[0, 4294967295\], got 4294967296"),
        ({"batch_size": 0}, "batch_size must be a positive int, got 0"),
        ({"num_windows": 0}, "num_windows"),
        ({"start": -1}, "start"),
        ({"world_size": 0}, "world_size"),
    ],
)
def test_window_batches_bad_arguments(kwargs: dict, message: str):
    arguments = {"num_windows": 10, "batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        WindowBatches(**arguments)


def test_window_loader_batches_in_window_batches_order():
    windows = TokenWindows(np.arange(200, dtype=np.uint8), 8)  # 24 windows
    loader = window_loader(windows, 5, seed=3, rank=1, world_size=2, start=2)
    batches = iter(loader)
    expected = iter(WindowBatches(len(windows), 5, seed=3, rank=1, world_size=2, start=2))
    for _ in range(6):
        inputs, targets = next(batches)
        assert inputs.shape == (5, 8) and targets.shape == (5, 8) and inputs.dtype == torch.int64
        assert inputs[:, 0].tolist() == [8 * index for index in next(expected)]
    with pytest.raises(TypeError):
        len(loader)
    with pytest.raises(TypeError, match="windows"):
        window_loader(np.arange(10), 2)
    with pytest.raises(ValueError, match="workers"):
        window_loader(windows, 2, workers=-1)


def test_iterating_a_window_loader_draws_nothing_from_the_global_rng():
    """A resumed run starts a new loader mid-run: were its base seed drawn from torch's global generator, the
    dropout masks after the resume would differ from those of a run that never stopped."""
    windows = TokenWindows(np.arange(200, dtype=np.uint8), 8)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    next(iter(window_loader(windows, 4, seed=1)))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.slow
def test_window_loader_workers_change_nothing(tmp_path: Path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 5_000, dtype=np.uint8).tobytes())
    windows = TokenWindows(np.memmap(path, dtype=np.uint8, mode="r"), 16)
    alone = window_loader(windows, 4, seed=7)
    with_workers = window_loader(windows, 4, seed=7, workers=2)
    plain, read_ahead = iter(alone), iter(with_workers)
    try:
        for _ in range(25):
            expected, got = next(plain), next(read_ahead)
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
    finally:
        read_ahead._shutdown_workers()  # type: ignore[attr-defined]


@pytest.mark.slow
def test_processes_building_at_once_share_one_cache(tmp_path: Path):
    import functools
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    source = tmp_path / "texts"
    _write_folder(source, files=400)
    with ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn")) as pool:
        built = list(pool.map(functools.partial(load_corpus, root=tmp_path / "cache"), [source] * 3))
    assert all(corpus == built[0] for corpus in built)
    assert [path.name for path in (tmp_path / "cache").iterdir()] == [built[0].folder.name]
    assert sum(built[0].sizes().values()) == 400 * 1001
