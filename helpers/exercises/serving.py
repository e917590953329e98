"""Serving: turn images as OpenCV reads them (N x H x W x 3 uint8, BGR) into the model's batch
(N x 1 x H x W float32 gray in [0, 1]), as the lesson's dataset transform does for the same pictures."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from helpers.data import LUMA, DigitsDataset

from . import exercise

TINTS = ((1.0, 0.6, 0.2), (0.2, 0.6, 1.0), (0.9, 0.2, 0.7), (0.3, 1.0, 0.3))  # R, G, B factors: colours, not grays


def reference_to_model_input(images_bgr: np.ndarray) -> torch.Tensor:
    """N x H x W x 3 uint8 BGR images -> N x 1 x H x W float32 gray batch in [0, 1]."""
    rgb = torch.from_numpy(images_bgr[..., ::-1].copy()).permute(0, 3, 1, 2).float() / 255
    return (torch.tensor(LUMA).view(1, 3, 1, 1) * rgb).sum(1, keepdim=True)


def dataset_transform() -> Callable:
    """The lesson's transform for a PIL image: gray (PIL's luma), then a [1, H, W] float32 tensor in [0, 1]."""
    from torchvision.transforms import v2

    return v2.Compose([v2.Grayscale(num_output_channels=1), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])


def digit_pictures(*, seed: int = 0, count: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """`count` test digits, 28 high and 20 wide, as RGB uint8 arrays [count, 28, 20, 3]: gray ones, and tinted copies."""
    digits = DigitsDataset("test", size=28).images[:, 0, :, 4:24]  # not square: a swap of H and W shows in the shape
    chosen = torch.randperm(len(digits), generator=torch.Generator().manual_seed(seed))[:count]
    gray = (digits[chosen] * 255).round().to(torch.uint8).numpy()
    rgb = np.repeat(gray[..., None], 3, axis=-1)
    tinted = (rgb * np.array(TINTS)[np.arange(count) % len(TINTS), None, None, :]).astype(np.uint8)
    return rgb, tinted


def expected_batch(rgb: np.ndarray) -> torch.Tensor:
    """The dataset transform of each RGB picture, stacked: what to_model_input must return for the BGR arrays."""
    from PIL import Image

    transform = dataset_transform()
    return torch.stack([transform(Image.fromarray(picture)) for picture in rgb])


def _gray(rgb: torch.Tensor) -> torch.Tensor:
    """N x 3 x H x W float RGB -> N x 1 x H x W gray with LUMA's weights."""
    return (torch.tensor(LUMA).view(1, 3, 1, 1) * rgb).sum(1, keepdim=True)


def _mistakes(bgr: np.ndarray) -> dict[str, torch.Tensor]:
    """What typical wrong answers give for these BGR images, each with its hint."""
    rgb = torch.from_numpy(bgr[..., ::-1].copy())  # N x H x W x 3 uint8, R, G, B
    count, height, width, _ = rgb.shape
    planes = rgb.permute(0, 3, 1, 2).float()  # N x 3 x H x W, 0-255
    right = _gray(planes) / 255
    return {
        "reshape or view re-cuts the pixels in memory order: permute(0, 3, 1, 2) moves whole axes": _gray(
            rgb.reshape(count, 3, height, width).float() / 255
        ),
        "the pictures came out upside down: [:, ::-1] flipped the rows; OpenCV's B, G, R are the last axis, so "
        "flip that one, [..., ::-1]": right.flip(2),
        "the pictures came out mirrored: [:, :, ::-1] flipped the columns; OpenCV's B, G, R are the last axis, so "
        "flip that one, [..., ::-1]": right.flip(3),
        "// 255 is integer division (every pixel short of 255 becomes 0): .float() first, then / 255": _gray(
            (planes // 255).float()
        ),
        "divide by 255, the largest uint8 value, not by 256": right * 255 / 256,
        "OpenCV's channels are B, G, R: flip them ([..., ::-1]) before weighting with LUMA, whose order is "
        "R, G, B": _gray(planes.flip(1)) / 255,
        "a plain mean of the three channels is not the dataset's gray: weight R, G, B with LUMA and sum": (
            planes.mean(1, keepdim=True) / 255
        ),
        **{
            f"one channel alone ({name}, channel {2 - index} of OpenCV's array) is not the dataset's gray: weight "
            "all three with LUMA and sum": planes[:, index : index + 1] / 255
            for index, name in enumerate("RGB")
        },
    }


def _truncated(mine: torch.Tensor, bgr: np.ndarray) -> bool:
    """Whole steps of 1/255, each at most one step below the exact gray: the weighted sum cut to uint8."""
    steps = mine.double() * 255
    below = reference_to_model_input(bgr).double() - mine.double()
    return bool((steps - steps.round()).abs().max() < 1e-3 and below.min() > -1e-4 and below.max() < 1.01 / 255)


def _call(to_model_input: Callable, bgr: np.ndarray) -> torch.Tensor:
    """to_model_input on a copy of bgr; refused with a hint when it raises on a flipped view or changes its input."""
    given = bgr.copy()
    try:
        mine = to_model_input(given)
    except ValueError as error:
        if "negative" not in str(error):
            raise
        raise AssertionError(
            "hint: torch.from_numpy refused the view [..., ::-1] makes (negative strides): copy it first, "
            "images_bgr[..., ::-1].copy()"
        ) from None
    assert np.array_equal(given, bgr), (
        "hint: to_model_input changed the caller's images_bgr in place (torch.from_numpy shares the array's "
        "memory, and so does a NumPy view): leave the input as it is and work on a copy"
    )
    return mine


@exercise("to_model_input", reference=reference_to_model_input)
def check_to_model_input(to_model_input: Callable) -> str:
    """to_model_input on gray and on tinted BGR digits must give the dataset transform's batch, to 1/255."""
    gray_rgb, tinted_rgb = digit_pictures()
    count, height, width, _ = gray_rgb.shape
    results = {}
    for name, rgb in (("gray", gray_rgb), ("coloured", tinted_rgb)):
        bgr = np.ascontiguousarray(rgb[..., ::-1])  # as cv2.imread gives it: B, G, R, in memory order
        mine, want = _call(to_model_input, bgr), expected_batch(rgb)
        assert isinstance(mine, torch.Tensor), (
            f"hint: return a torch.Tensor, got {type(mine).__name__}: torch.from_numpy(...) turns the array into one"
        )
        assert tuple(mine.shape) == (count, 1, height, width), (
            f"hint: expected shape {(count, 1, height, width)} (N x 1 x H x W), got {tuple(mine.shape)}: "
            "permute(0, 3, 1, 2) moves the channel axis in front of H and W, and sum(1, keepdim=True) over the "
            "LUMA-weighted channels keeps one gray channel"
        )
        assert mine.dtype == torch.float32, (
            f"hint: dtype {mine.dtype}, the model's weights are float32: .float() before dividing "
            "(a NumPy division gives float64)"
        )
        low, high = mine.min().item(), mine.max().item()
        assert high <= 10, f"hint: values up to {high:.1f}: divide by 255 for the 0-1 range the dataset gives"
        assert low >= 0 and high <= 1 + 1e-6, (
            f"hint: values from {low:.2f} to {high:.2f}, normalised ((x - mean) / std): the dataset's transform "
            "gives 0-1, so no normalisation here, only / 255"
        )
        results[name] = (mine - want).abs().max().item()
        if results[name] <= 1 / 255:
            continue
        off = f"off by up to {results[name] * 255:.0f}/255"
        where = f"gray images are {off}" if name == "gray" else f"gray images match but coloured ones are {off}"
        for hint, wrong in _mistakes(bgr).items():
            assert not torch.allclose(mine, wrong, atol=1e-4), f"hint: {where}: {hint}"
        assert not _truncated(mine, bgr), (
            f"hint: {where}, in whole steps of 1/255: converting the weighted sum to uint8 "
            "(astype(np.uint8), .to(torch.uint8)) cuts 199.99998 down to 199; keep it float and divide by 255"
        )
        assert name == "coloured", (
            f"hint: right shape, wrong pixels even for gray images ({off}): flip the channels ([..., ::-1]), "
            "permute(0, 3, 1, 2) (never reshape or view), .float() / 255, weight with LUMA, sum(1, keepdim=True)"
        )
        raise AssertionError(
            f"hint: {where}: the gray is LUMA[0] * R + LUMA[1] * G + "
            "LUMA[2] * B, where R, G, B are channels 2, 1, 0 of OpenCV's array"
        )
    worst = max(results.values()) * 255
    return (
        f"✓ to_model_input gave the dataset transform's batch for {count} gray and {count} coloured {height}x{width} "
        f"BGR images (within {worst:.2f}/255)"
    )
