"""Serving: write `predict(model, image)`, one image through a batch model, ready to serve."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset, random_split

from helpers.data import DigitsDataset, make_loader
from helpers.loop import evaluate, train_epoch
from helpers.models import SmallCNN

from . import exercise


def reference_predict(model, image):
    """The class of one image [C, H, W] and its softmax probability; the model's mode is left as it was."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            logits = model(image.unsqueeze(0).to(next(model.parameters()).device))  # a batch of one: [1, classes]
    finally:
        model.train(was_training)
    probabilities = logits.softmax(dim=1)[0]
    return int(probabilities.argmax()), float(probabilities.max())


@functools.cache
def _trained() -> tuple[SmallCNN, torch.Tensor, torch.Tensor]:
    """A SmallCNN with BatchNorm and dropout 0.5, trained 2 epochs on 80% of the digits' training split (seed 0),
    and the other 20%, its validation images and labels. Built once; the global RNG is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        digits = DigitsDataset("train")
        train, val = random_split(digits, [0.8, 0.2], generator=torch.Generator().manual_seed(0))
        model = SmallCNN(channels=8, dropout=0.5)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        loader = make_loader(train, batch_size=64, shuffle=True, seed=0)
        for _ in range(2):
            train_epoch(model, loader, optimizer, F.cross_entropy, device="cpu", progress=False)
    return model.eval(), digits.images[val.indices], digits.targets[val.indices]


def _answers(predict: Callable, model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """predict on each image: the classes and the probabilities, as tensors."""
    answers = []
    for image in images:
        try:
            answer = predict(model, image)
        except NotImplementedError:
            raise
        except (RuntimeError, ValueError) as error:  # what a model raises on a [C, H, W] image
            raise AssertionError(
                f"hint: predict raised {type(error).__name__}: {error}. The model takes a batch [N, C, H, W]: give it "
                "image.unsqueeze(0), a batch of one"
            ) from error
        assert isinstance(answer, tuple | list) and len(answer) == 2, (
            f"hint: return a pair (class, probability), got {answer!r}"
        )
        answers.append((int(answer[0]), float(answer[1])))
    return torch.tensor([a[0] for a in answers]), torch.tensor([a[1] for a in answers])


def _check_moves_the_image(predict: Callable, trained: torch.nn.Module, image: torch.Tensor) -> None:
    """With the model's weights on another device than the image (meta: shapes without data, on any machine),
    the model must receive the image on its own device. Answers cannot be read off meta, so only that is checked."""
    model = copy.deepcopy(trained).to("meta")
    given: list[torch.device] = []
    model.register_forward_pre_hook(lambda module, args: given.append(args[0].device))
    with contextlib.suppress(Exception):  # reading a class out of a meta tensor fails, as it should
        predict(model, image)
    assert given, "hint: with the model on another device, predict never called the model"
    assert given[0] == torch.device("meta"), (
        f"hint: with the model's weights on meta and the image on {image.device}, predict gave the model an image "
        f"on {given[0]} (with the model on a GPU: an error): move the image to the model's own device, "
        "image.to(next(model.parameters()).device), not to a device fixed elsewhere"
    )


@exercise("predict", reference=reference_predict)
def check_predict(predict: Callable) -> str:
    """predict on every validation image, with the model in eval and then in train mode, must give one batched
    eval-mode pass's argmax and top softmax probability, leave the mode as it was and record no graph."""
    trained, images, labels = _trained()
    model = copy.deepcopy(trained)  # fresh for each check: a wrong predict may change its BatchNorm statistics
    with torch.inference_mode():
        logits = model.eval()(images)  # the answer: one batch, eval mode
    top, classes = logits.softmax(dim=1).max(dim=1)
    grad_enabled: list[bool] = []
    model.register_forward_pre_hook(lambda *_: grad_enabled.append(torch.is_grad_enabled()))

    got_classes, got_probs = _answers(predict, model, images)  # the model in eval mode
    assert not (got_probs > 1).any() or not torch.equal(got_probs, got_probs.round()), (
        "hint: the probabilities are whole numbers above 1, class numbers: return (class, probability), in that order"
    )
    assert not model.training, (
        "hint: the model was in eval mode and predict left it in train mode: remember was_training = model.training "
        "and put it back with model.train(was_training), not model.train()"
    )
    assert not torch.allclose(got_probs, logits.max(dim=1).values, atol=1e-4), (
        "hint: that is the largest logit, not a probability: apply softmax to the logits first"
    )
    assert not (got_probs <= 0).all(), (
        "hint: every probability is 0 or below: those are log-probabilities (log_softmax); softmax gives the "
        "probabilities, between 0 and 1"
    )
    assert not torch.allclose(got_probs, torch.ones_like(got_probs)), (
        "hint: every probability is 1: softmax ran over the batch dimension of the [1, 10] logits; use dim=1 "
        "(the classes), or dim=0 after taking the one row"
    )
    assert torch.allclose(got_probs, top, atol=1e-5), (
        "hint: the probability is the largest softmax value of the eval-mode logits: model(image.unsqueeze(0)), "
        "softmax over the classes, then its max"
    )
    assert torch.equal(got_classes, classes), "hint: the class is the argmax of the probabilities (or of the logits)"
    assert not any(grad_enabled), "hint: the forward pass recorded a graph: run it under torch.inference_mode()"

    model.train()  # the model in train mode: predict must switch it to eval and back
    got_classes, got_probs = _answers(predict, model, images)
    assert model.training, (
        "hint: the model was in train mode and predict left it in eval mode: remember was_training = model.training "
        "and put it back with model.train(was_training) after the forward pass (in a finally block)"
    )
    assert torch.allclose(got_probs, top, atol=1e-5) and torch.equal(got_classes, classes), (
        "hint: with the model in train mode the answers changed (dropout and BatchNorm acted as in training): "
        "call model.eval() before the forward pass"
    )
    _check_moves_the_image(predict, trained, images[0])
    accuracy = (got_classes == labels).double().mean().item()
    loader = make_loader(TensorDataset(images, labels), batch_size=128, seed=0)  # seed: its own generator
    helper = evaluate(model, loader, F.cross_entropy, device="cpu")
    assert math.isclose(accuracy, helper.accuracy), (
        "hint: one class per image, in order, as helpers.loop.evaluate counts them"
    )
    return (
        f"✓ predict gave one batched eval-mode pass's answers on {len(images)} images (accuracy {accuracy:.3f}, as "
        "evaluate), mode kept"
    )
