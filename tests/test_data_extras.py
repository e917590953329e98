import contextlib
import functools
import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from helpers.data import (
    RNG_SOURCES,
    DigitsDataset,
    RandomShiftDataset,
    SlowDataset,
    VariableLengthSequences,
    pad_collate,
    reseed_dataset_generator,
    shift_image,
)


@contextlib.contextmanager
def _iterate(loader: DataLoader):
    """An iterator over `loader` whose worker processes are stopped on leaving the block.

    Left to the garbage collector (an iterator left after a `break`, or held by a caught exception's
    traceback), the workers are stopped later, in whichever test happens to collect them, and may stall
    it for seconds.
    """
    iterator = iter(loader)
    try:
        yield iterator
    finally:
        if hasattr(iterator, "_shutdown_workers"):  # num_workers > 0
            iterator._shutdown_workers()


def test_variable_length_sequences_are_fixed_by_seed_and_in_range():
    data = VariableLengthSequences(50, min_length=3, max_length=9, vocab_size=7, seed=4)
    again = VariableLengthSequences(50, min_length=3, max_length=9, vocab_size=7, seed=4)
    other = VariableLengthSequences(50, min_length=3, max_length=9, vocab_size=7, seed=5)
    assert len(data) == 50
    lengths = [len(data[i][0]) for i in range(len(data))]
    assert min(lengths) >= 3 and max(lengths) <= 9 and len(set(lengths)) > 1
    assert all(torch.equal(data[i][0], again[i][0]) for i in range(50))
    assert any(not torch.equal(data[i][0], other[i][0]) for i in range(50))
    sequence, label = data[0]
    assert sequence.dtype == torch.int64 and sequence.min() >= 1 and sequence.max() < 7
    assert label == int(len(sequence) > 6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"size": 0}, "size"),
        ({"min_length": 0}, "min_length"),
        ({"min_length": 5, "max_length": 4}, "max_length"),
        ({"vocab_size": 1}, "vocab_size"),
        ({"seed": -1}, "seed"),
    ],
)
def test_variable_length_sequences_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VariableLengthSequences(**kwargs)


def test_pad_collate_pads_to_the_longest_and_keeps_lengths():
    batch = [(torch.tensor([5, 6, 7]), 1), (torch.tensor([8]), 0), (torch.tensor([9, 9]), 1)]
    padded, lengths, labels = pad_collate(batch)
    assert padded.tolist() == [[5, 6, 7], [8, 0, 0], [9, 9, 0]]
    assert lengths.tolist() == [3, 1, 2] and labels.tolist() == [1, 0, 1]
    padded, _, _ = functools.partial(pad_collate, padding_value=-1)(batch)
    assert padded[1].tolist() == [8, -1, -1]


def test_pad_collate_in_a_loader_where_the_default_collate_fails():
    data = VariableLengthSequences(20, min_length=1, max_length=6, seed=0)
    with pytest.raises(RuntimeError, match="equal size"):
        default_collate([data[i] for i in range(20)])
    seen = 0
    for padded, lengths, labels in DataLoader(data, batch_size=8, collate_fn=pad_collate):
        assert padded.shape == (len(labels), int(lengths.max()))
        for row, length in zip(padded, lengths):
            assert torch.all(row[length:] == 0) and torch.all(row[:length] > 0)
        seen += len(labels)
    assert seen == 20


def test_pad_collate_empty_batch():
    with pytest.raises(ValueError, match="empty"):
        pad_collate([])


def test_shift_image_moves_content_and_fills_with_zeros():
    image = torch.arange(1, 17, dtype=torch.float32).reshape(1, 4, 4)
    down_right = shift_image(image, 1, 2)
    assert torch.equal(down_right[0, 1:, 2:], image[0, :3, :2])
    assert down_right[0, 0].abs().sum() == 0 and down_right[0, :, :2].abs().sum() == 0
    assert torch.equal(shift_image(image, 0, 0), image)
    assert torch.equal(shift_image(shift_image(image, -1, 1), 1, -1)[0, 1:, :3], image[0, 1:, :3])
    with pytest.raises(ValueError, match="smaller than the image"):
        shift_image(image, 4, 0)


@pytest.mark.parametrize("rng", RNG_SOURCES)
def test_random_shift_dataset_in_the_main_process(rng):
    base = TensorDataset(torch.rand(10, 1, 6, 6), torch.arange(10))
    data = RandomShiftDataset(base, max_shift=2, rng=rng, seed=3)
    sample = data[4]
    dy, dx = sample["shift"].tolist()
    assert sample["worker"] == -1 and sample["pid"] == os.getpid() and int(sample["label"]) == 4
    assert -2 <= dy <= 2 and -2 <= dx <= 2
    assert torch.equal(sample["image"], shift_image(base[4][0], dy, dx))
    batch = next(iter(DataLoader(data, batch_size=5)))
    assert batch["image"].shape == (5, 1, 6, 6) and batch["shift"].shape == (5, 2)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"rng": "cuda"}, ValueError, "rng"),
        ({"max_shift": -1}, ValueError, "max_shift"),
        ({"seed": 1.5}, ValueError, "seed"),
    ],
)
def test_random_shift_dataset_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        RandomShiftDataset(TensorDataset(torch.zeros(2, 1, 4, 4), torch.zeros(2)), **kwargs)


def _shifts_by_worker(rng: str, seed: int, worker_init_fn=None) -> dict[int, list]:
    data = RandomShiftDataset(DigitsDataset("test"), max_shift=3, rng=rng)
    loader = DataLoader(
        data, batch_size=4, num_workers=2, worker_init_fn=worker_init_fn, generator=torch.Generator().manual_seed(seed)
    )
    draws: dict[int, list] = {0: [], 1: []}
    with _iterate(loader) as batches:
        for index, batch in enumerate(batches):
            if index >= 16:
                break
            assert len(set(batch["worker"].tolist())) == 1, "a worker builds a whole batch"
            assert os.getpid() not in batch["pid"].tolist()
            draws[int(batch["worker"][0])].extend(batch["shift"].tolist())
    return draws


@pytest.mark.parametrize("rng", ["torch", "numpy", "random"])
def test_global_generators_differ_across_workers_and_repeat_with_the_loader_seed(rng):
    draws = _shifts_by_worker(rng, seed=11)
    assert len(draws[0]) == len(draws[1]) == 32
    assert draws[0] != draws[1]
    assert _shifts_by_worker(rng, seed=11) == draws
    assert _shifts_by_worker(rng, seed=12) != draws


def test_a_generator_made_in_init_repeats_in_every_worker_unless_reseeded():
    copied = _shifts_by_worker("generator", seed=11)
    assert copied[0] == copied[1]
    reseeded = _shifts_by_worker("generator", seed=11, worker_init_fn=reseed_dataset_generator)
    assert reseeded[0] != reseeded[1]
    assert _shifts_by_worker("generator", seed=11, worker_init_fn=reseed_dataset_generator) == reseeded


def test_reseed_dataset_generator_needs_a_worker_and_a_generator():
    with pytest.raises(RuntimeError, match="worker_init_fn"):
        reseed_dataset_generator(0)
    loader = DataLoader(
        TensorDataset(torch.zeros(4)), batch_size=2, num_workers=1, worker_init_fn=reseed_dataset_generator
    )
    with _iterate(loader) as batches, pytest.raises(Exception, match="generator"):
        list(batches)


def test_slow_dataset_delays_and_a_loader_timeout_catches_it():
    data = SlowDataset(TensorDataset(torch.arange(4)), delay_s=0.05)
    start = time.perf_counter()
    assert int(data[2][0]) == 2
    assert time.perf_counter() - start >= 0.05
    assert len(data) == 4
    stuck = DataLoader(
        SlowDataset(TensorDataset(torch.arange(2)), delay_s=1.0), batch_size=1, num_workers=1, timeout=0.2
    )
    with _iterate(stuck) as batches, pytest.raises(RuntimeError, match="timed out"):
        list(batches)


@pytest.mark.parametrize("delay", [-1, "1", True, float("nan")])
def test_slow_dataset_bad_delay(delay):
    with pytest.raises(ValueError, match="delay_s"):
        SlowDataset(TensorDataset(torch.zeros(1)), delay)
