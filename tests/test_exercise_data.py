"""The to_model_input exercise gives each kind of mistake its own hint."""

import numpy as np
import pytest
import torch

from helpers.data import LUMA
from helpers.exercises.data import check_to_model_input, digit_pictures, expected_batch, reference_to_model_input

WEIGHTS = torch.tensor(LUMA).view(1, 3, 1, 1)


def reshaped_instead_of_permuted(images_bgr):
    rgb = torch.from_numpy(images_bgr[..., ::-1].copy()).float() / 255
    return (WEIGHTS * rgb.reshape(len(rgb), 3, *rgb.shape[1:3])).sum(1, keepdim=True)


def channels_left_in_bgr_order(images_bgr):
    bgr = torch.from_numpy(images_bgr).permute(0, 3, 1, 2).float() / 255
    return (WEIGHTS * bgr).sum(1, keepdim=True)


def not_divided_by_255(images_bgr):
    rgb = torch.from_numpy(images_bgr[..., ::-1].copy()).permute(0, 3, 1, 2).float()
    return (WEIGHTS * rgb).sum(1, keepdim=True)


def float64_from_numpy(images_bgr):
    rgb = torch.from_numpy(images_bgr[..., ::-1] / 255.0).permute(0, 3, 1, 2)  # NumPy's division: float64
    return (WEIGHTS.double() * rgb).sum(1, keepdim=True)


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (reshaped_instead_of_permuted, "right shape, wrong pixels"),
        (channels_left_in_bgr_order, "gray images match but coloured ones"),
        (not_divided_by_255, "divide by 255"),
        (float64_from_numpy, "dtype torch.float64"),
    ],
)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_to_model_input(wrong)


def test_the_pictures_tell_the_mistakes_apart():
    """Not square (an H/W swap shows in the shape) and coloured (a BGR/RGB swap shows in the gray values)."""
    gray, tinted = digit_pictures()
    assert gray.shape == tinted.shape == (4, 28, 20, 3) and gray.dtype == tinted.dtype == np.uint8
    assert (gray[..., 0] == gray[..., 2]).all() and (tinted[..., 0] != tinted[..., 2]).any()
    wrong_order = expected_batch(tinted[..., ::-1].copy())
    assert (wrong_order - expected_batch(tinted)).abs().max() > 10 / 255
    bgr = np.ascontiguousarray(tinted[..., ::-1])
    assert (reference_to_model_input(bgr) - expected_batch(tinted)).abs().max() <= 1 / 255
