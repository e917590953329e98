"""The to_model_input exercise gives each kind of mistake its own hint."""

import numpy as np
import pytest
import torch

from helpers.data import LUMA
from helpers.exercises.serving import check_to_model_input, digit_pictures, expected_batch, reference_to_model_input

WEIGHTS = torch.tensor(LUMA).view(1, 3, 1, 1)


def planes_of(images_bgr):
    """The right first steps: RGB, channels first, float in 0-1."""
    return torch.from_numpy(images_bgr[..., ::-1].copy()).permute(0, 3, 1, 2).float() / 255


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


def mean_of_the_channels(images_bgr):
    return planes_of(images_bgr).mean(1, keepdim=True)


def first_channel_only(images_bgr):  # OpenCV's first channel is blue
    return torch.from_numpy(images_bgr[..., :1].copy()).permute(0, 3, 1, 2).float() / 255


def normalised_as_for_mnist(images_bgr):
    return ((WEIGHTS * planes_of(images_bgr)).sum(1, keepdim=True) - 0.1307) / 0.3081


def flipped_the_rows(images_bgr):  # [:, ::-1] flips axis 1, the height, not the channels
    rgb = torch.from_numpy(images_bgr[:, ::-1].copy()).permute(0, 3, 1, 2).float() / 255
    return (WEIGHTS * rgb).sum(1, keepdim=True)


def flipped_view_without_copy(images_bgr):
    rgb = torch.from_numpy(images_bgr[..., ::-1]).permute(0, 3, 1, 2).float() / 255
    return (WEIGHTS * rgb).sum(1, keepdim=True)


def gray_cut_to_uint8(images_bgr):  # as a uint8 gray image: 199.99998 becomes 199
    gray = (images_bgr[..., ::-1] @ np.array(LUMA)).astype(np.uint8)
    return torch.from_numpy(gray).unsqueeze(1).float() / 255


def divided_by_256(images_bgr):
    return (WEIGHTS * planes_of(images_bgr) * 255 / 256).sum(1, keepdim=True)


def integer_division(images_bgr):
    rgb = torch.from_numpy(images_bgr[..., ::-1].copy()).permute(0, 3, 1, 2) // 255
    return (WEIGHTS * rgb.float()).sum(1, keepdim=True)


def channels_swapped_in_place(images_bgr):
    images_bgr[:] = images_bgr[..., ::-1]  # the caller's array now holds R, G, B
    return (WEIGHTS * torch.from_numpy(images_bgr).permute(0, 3, 1, 2).float() / 255).sum(1, keepdim=True)


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (reshaped_instead_of_permuted, "gray images are off by up to .*reshape or view re-cuts the pixels"),
    (channels_left_in_bgr_order, "gray images match but coloured ones .*OpenCV's channels are B, G, R: flip them"),
    (not_divided_by_255, "values up to 255.0: divide by 255"),
    (float64_from_numpy, "dtype torch.float64"),
    (mean_of_the_channels, "coloured ones .*a plain mean of the three channels"),
    (first_channel_only, r"one channel alone \(B, channel 0 of OpenCV's array\)"),
    (normalised_as_for_mnist, r"values from -0.42 to 2.82, normalised"),
    (flipped_the_rows, "upside down"),
    (flipped_view_without_copy, "negative strides"),
    (gray_cut_to_uint8, "in whole steps of 1/255: converting the weighted sum to uint8"),
    (divided_by_256, "not by 256"),
    (integer_division, "// 255 is integer division"),
    (channels_swapped_in_place, "changed the caller's images_bgr in place"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_to_model_input(wrong)


def weights_reversed_instead_of_flipping(images_bgr):  # LUMA in B, G, R order on the unflipped channels
    bgr = torch.from_numpy(images_bgr).permute(0, 3, 1, 2).float() / 255
    return (WEIGHTS.flip(1) * bgr).sum(1, keepdim=True)


def in_numpy_float32(images_bgr):
    gray = (images_bgr[..., ::-1].astype(np.float32) / 255) @ np.array(LUMA, dtype=np.float32)
    return torch.from_numpy(gray[:, None])


RIGHT = [weights_reversed_instead_of_flipping, in_numpy_float32]


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_to_model_input.check(right).startswith("✓ to_model_input gave the dataset transform's batch")


def test_the_pictures_tell_the_mistakes_apart():
    """Not square (an H/W swap shows in the shape) and coloured (a BGR/RGB swap shows in the gray values)."""
    gray, tinted = digit_pictures()
    assert gray.shape == tinted.shape == (4, 28, 20, 3) and gray.dtype == tinted.dtype == np.uint8
    assert (gray[..., 0] == gray[..., 2]).all() and (tinted[..., 0] != tinted[..., 2]).any()
    wrong_order = expected_batch(tinted[..., ::-1].copy())
    assert (wrong_order - expected_batch(tinted)).abs().max() > 10 / 255
    bgr = np.ascontiguousarray(tinted[..., ::-1])
    assert (reference_to_model_input(bgr) - expected_batch(tinted)).abs().max() <= 1 / 255
