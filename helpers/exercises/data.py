"""Dataset & DataLoader: turn images as OpenCV reads them (N x H x W x 3 uint8, BGR) into the model's batch
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


@exercise("to_model_input", reference=reference_to_model_input)
def check_to_model_input(to_model_input: Callable) -> str:
    """to_model_input on gray and on tinted BGR digits must give the dataset transform's batch, to 1/255."""
    gray_rgb, tinted_rgb = digit_pictures()
    count, height, width, _ = gray_rgb.shape
    results = {}
    for name, rgb in (("gray", gray_rgb), ("coloured", tinted_rgb)):
        bgr = np.ascontiguousarray(rgb[..., ::-1])  # as cv2.imread gives it: B, G, R, in memory order
        mine, want = to_model_input(bgr.copy()), expected_batch(rgb)
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
        assert mine.max() <= 1, (
            f"hint: values up to {mine.max().item():.1f}: divide by 255 for the 0-1 range the dataset gives "
            "(and no normalisation here)"
        )
        results[name] = (mine - want).abs().max().item()
        if name == "gray":
            assert results[name] <= 1 / 255, (
                f"hint: right shape, wrong pixels even for gray images (off by up to {results[name] * 255:.0f}/255): "
                "reshape or view re-cuts the pixels in memory order; permute moves whole axes"
            )
    assert results["coloured"] <= 1 / 255, (
        f"hint: gray images match but coloured ones are off by up to {results['coloured'] * 255:.0f}/255: OpenCV's "
        "channels are B, G, R: flip them ([..., ::-1]) before weighting with LUMA, whose order is R, G, B"
    )
    worst = max(results.values()) * 255
    return (
        f"✓ to_model_input gave the dataset transform's batch for {count} gray and {count} coloured {height}x{width} "
        f"BGR images (within {worst:.2f}/255)"
    )
