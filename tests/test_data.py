import random

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset
from torchvision import datasets

from helpers import data
from helpers.data import DigitsDataset, PngFolderDataset, export_digits_png, fashion_mnist, make_loader, seed_worker


def test_digits_split_is_fixed_disjoint_and_complete():
    train, test = DigitsDataset("train"), DigitsDataset("test")
    assert len(train) + len(test) == 1797
    assert len(test) == pytest.approx(0.25 * 1797, abs=1)
    assert torch.equal(DigitsDataset("train").images, train.images)
    image, label = train[0]
    assert image.shape == (1, 8, 8) and image.dtype == torch.float32
    assert image.min() >= 0.0 and image.max() <= 1.0
    assert isinstance(label, int) and 0 <= label <= 9
    assert set(train.targets.tolist()) == set(range(10)) == set(test.targets.tolist())


def test_digits_upscale():
    image, _ = DigitsDataset("test", size=28)[3]
    assert image.shape == (1, 28, 28)
    assert image.min() >= 0.0 and image.max() <= 1.0


@pytest.mark.parametrize(
    "kwargs, message", [({"split": "valid"}, "split"), ({"size": 4}, "size"), ({"size": 8.5}, "size")]
)
def test_digits_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DigitsDataset(**kwargs)


def test_export_digits_png_roundtrip_with_imagefolder(tmp_path):
    root = export_digits_png(tmp_path / "digits", size=8)
    for split in ("train", "test"):
        source = DigitsDataset(split)
        assert len(list((root / split).glob("*/*.png"))) == len(source)
        folder = datasets.ImageFolder(root / split)
        assert folder.classes == list(source.classes)
        mine = PngFolderDataset(root / split)
        assert len(mine) == len(source)
        image, label = mine[0]
        index = int(mine.samples[0][0].stem)
        assert label == source[index][1]
        assert torch.allclose(image, source[index][0], atol=1 / 255)
    # a second call finds the export complete and leaves it alone
    stamp = mine.samples[0][0].stat().st_mtime_ns
    export_digits_png(root, size=8)
    assert mine.samples[0][0].stat().st_mtime_ns == stamp
    assert not any(path.name.startswith(".") for path in root.iterdir())  # no staging folder left


def test_export_digits_png_refuses_a_mismatched_folder(tmp_path):
    (tmp_path / "train" / "0").mkdir(parents=True)
    (tmp_path / "train" / "0" / "00000.png").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 1 PNGs"):
        export_digits_png(tmp_path, size=8)


def test_png_folder_dataset_rejects_missing_or_empty_folders(tmp_path):
    with pytest.raises(ValueError, match="root"):
        PngFolderDataset(tmp_path / "nope")
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="no PNG"):
        PngFolderDataset(tmp_path / "empty")


def test_fashion_mnist_offline_fails_with_instructions(tmp_path, monkeypatch):
    def offline(self):
        raise OSError("network is unreachable")

    monkeypatch.setattr(datasets.FashionMNIST, "download", offline)
    with pytest.raises(RuntimeError, match="could not be downloaded.*DigitsDataset"):
        fashion_mnist("train", root=tmp_path)
    with pytest.raises(RuntimeError, match="helpers.data fashion"):
        fashion_mnist("test", root=tmp_path, download=False)


def test_data_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path))
    assert data.data_dir() == tmp_path
    monkeypatch.delenv("COURSE_DATA_DIR")
    assert data.data_dir().name == "data"


def test_make_loader_seeded_order_repeats_and_differs():
    dataset = TensorDataset(torch.arange(100))

    def order(seed):
        return torch.cat([b[0] for b in make_loader(dataset, batch_size=10, shuffle=True, seed=seed)])

    assert torch.equal(order(1), order(1))
    assert not torch.equal(order(1), order(2))
    assert sorted(order(3).tolist()) == list(range(100))


def test_make_loader_seeds_workers_distinctly():
    import numpy as np

    seeds = []
    for worker_id in range(2):
        torch.manual_seed(1000 + worker_id)  # a worker's torch seed: base_seed + worker_id
        seed_worker(0)  # the numbers follow the torch seed, not the worker id
        seeds.append(np.random.randint(0, 2**31))
    assert seeds[0] != seeds[1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"persistent_workers": True}, "persistent_workers"),
        ({"prefetch_factor": 2}, "prefetch_factor"),
        ({"seed": -3}, "seed"),
        ({"timeout": -1}, "timeout"),
    ],
)
def test_make_loader_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_loader(TensorDataset(torch.zeros(4)), **kwargs)


def test_make_loader_with_a_worker_delivers_everything():
    dataset = DigitsDataset("test")
    loader = make_loader(dataset, batch_size=100, num_workers=1, seed=0, shuffle=True)
    labels = torch.cat([y for _, y in loader])
    assert sorted(labels.tolist()) == sorted(dataset.targets.tolist())


def test_luma_weights_are_the_gray_of_pil_and_torchvision():
    import numpy as np
    from PIL import Image
    from torchvision.transforms import v2

    from helpers.data import LUMA

    colours = np.random.default_rng(0).integers(0, 256, size=(1, 64, 3), dtype=np.uint8)
    ours = colours.astype(np.float64) @ np.array(LUMA)
    pil = np.asarray(Image.fromarray(colours).convert("L"), dtype=np.float64)
    torchvision = v2.Grayscale()(torch.from_numpy(colours).permute(2, 0, 1)).double()[0]
    assert sum(LUMA) == pytest.approx(1.0)
    assert np.abs(ours - pil).max() <= 1 and (torch.from_numpy(ours) - torchvision).abs().max() <= 1  # 8-bit rounding


def test_seed_worker_seeds_numpy_and_random_from_the_workers_torch_seed():
    """Mistake: seeding with the worker id, so every run (any seed) draws the same numbers in worker 0."""
    draws = {}
    for torch_seed in (1000, 2000, 1000):
        torch.manual_seed(torch_seed)  # a worker's torch seed is base_seed + worker_id
        seed_worker(0)
        draws.setdefault(torch_seed, []).append((np.random.randint(2**31), random.randrange(2**31)))
    assert draws[1000][0] == draws[1000][1]  # the same torch seed: the same numbers
    assert draws[1000][0][0] != draws[2000][0][0] and draws[1000][0][1] != draws[2000][0][1]


def test_counting_loader_counts_each_pass_and_yields_the_loaders_batches():
    from helpers.data import CountingLoader

    counted = CountingLoader([[1, 2], [3]])
    assert counted.passes == 0
    assert list(counted) == [[1, 2], [3]]
    assert sum(len(batch) for batch in counted) == 3
    assert counted.passes == 2


def test_counting_loader_refuses_what_cannot_be_iterated():
    from helpers.data import CountingLoader

    with pytest.raises(TypeError, match="loader must be an iterable"):
        CountingLoader(3)


def test_padding_share_counts_the_padded_elements():
    from helpers.data import VariableLengthSequences, pad_collate, padding_share

    batches = [pad_collate([(torch.ones(3), 0), (torch.ones(1), 1)]), pad_collate([(torch.ones(2), 0)])]
    assert padding_share(batches) == pytest.approx(2 / 8)  # 3 + 1 + 2 real of 2 * 3 + 1 * 2 cells
    sequences = VariableLengthSequences(20, seed=1)
    loader = torch.utils.data.DataLoader(sequences, batch_size=1, collate_fn=pad_collate)
    assert padding_share(loader) == 0  # a batch of one needs no padding


def test_padding_share_refuses_a_loader_without_batches():
    from helpers.data import padding_share

    with pytest.raises(ValueError, match="loader must deliver at least one"):
        padding_share([])


def test_epoch_counts_samples_and_batches_and_waits_while_busy():
    import time

    from helpers.data import epoch

    loader = torch.utils.data.DataLoader(TensorDataset(torch.arange(10)), batch_size=4)
    assert epoch(loader) == (10, 3)
    assert epoch([torch.zeros(2, 5), torch.zeros(3, 5)]) == (5, 2)  # a batch that is one tensor
    start = time.perf_counter()
    assert epoch(loader, busy_s=0.05) == (10, 3)
    assert time.perf_counter() - start >= 0.05
    with pytest.raises(ValueError, match="busy_s"):
        epoch(loader, busy_s=-1)


def test_time_epochs_times_each_loader_and_keeps_every_epochs_delivery():
    from helpers.data import time_epochs

    loaders = {"by 4": [torch.zeros(4), torch.zeros(2)], "by 3": [torch.zeros(3)] * 2}
    timing, delivered = time_epochs(loaders, repeat=3, per=6, unit="sample", labels={"by 4": "batches of 4"})
    assert delivered == {"by 4": [(6, 2)] * 4, "by 3": [(6, 2)] * 4}  # the untimed epoch, then 3 rounds
    assert len(timing["by 3"].seconds) == 3 and timing.unit == "sample" and timing.label("by 4") == "batches of 4"
    with pytest.raises(TypeError, match="loaders must be a non-empty mapping"):
        time_epochs({}, repeat=1)
    with pytest.raises(ValueError, match="busy_s"):
        time_epochs(loaders, repeat=1, busy_s=-0.1)
    with pytest.raises(ValueError, match="repeat"):
        time_epochs(loaders, repeat=0)
