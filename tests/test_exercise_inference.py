"""The predict exercise gives each kind of mistake its own hint."""

import pytest
import torch

from helpers.exercises.inference import check_predict


def forgets_eval(model, image):
    with torch.inference_mode():
        probabilities = model(image.unsqueeze(0)).softmax(dim=1)[0]
    return int(probabilities.argmax()), float(probabilities.max())


def leaves_eval_mode_on(model, image):
    model.eval()
    with torch.inference_mode():
        probabilities = model(image.unsqueeze(0)).softmax(dim=1)[0]
    return int(probabilities.argmax()), float(probabilities.max())


def always_back_to_train_mode(model, image):
    model.eval()
    with torch.inference_mode():
        probabilities = model(image.unsqueeze(0)).softmax(dim=1)[0]
    model.train()  # the caller's model may have been in eval mode
    return int(probabilities.argmax()), float(probabilities.max())


def returns_the_logit(model, image):
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        logits = model(image.unsqueeze(0))[0]
    model.train(was_training)
    return int(logits.argmax()), float(logits.max())


def softmax_over_the_batch(model, image):
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        probabilities = model(image.unsqueeze(0)).softmax(dim=0)  # [1, 10]: over the batch of one
    model.train(was_training)
    return int(probabilities.argmax()), float(probabilities.max())


def without_a_batch_dimension(model, image):
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            probabilities = model(image).softmax(dim=-1)
    finally:
        model.train(was_training)
    return int(probabilities.argmax()), float(probabilities.max())


def records_a_graph(model, image):
    was_training = model.training
    model.eval()
    probabilities = model(image.unsqueeze(0)).softmax(dim=1)[0].detach()  # detached after the graph was built
    model.train(was_training)
    return int(probabilities.argmax()), float(probabilities.max())


def returns_log_probabilities(model, image):
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        log_probabilities = model(image.unsqueeze(0)).log_softmax(dim=1)[0]  # as cross_entropy computes them
    model.train(was_training)
    return int(log_probabilities.argmax()), float(log_probabilities.max())


def probability_first(model, image):
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        probabilities = model(image.unsqueeze(0)).softmax(dim=1)[0]
    model.train(was_training)
    return float(probabilities.max()), int(probabilities.argmax())  # the pair in the wrong order


def never_moves_the_image(model, image):  # right while model and image share a device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            probabilities = model(image.unsqueeze(0)).softmax(dim=1)[0]
    finally:
        model.train(was_training)
    return int(probabilities.argmax()), float(probabilities.max())


def to_a_fixed_device(model, image):  # the notebook's device, not the model's
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            probabilities = model(image.unsqueeze(0).to("cpu")).softmax(dim=1)[0]
    finally:
        model.train(was_training)
    return int(probabilities.argmax()), float(probabilities.max())


WRONG = [  # (wrong answer, the hint it must get); counted by tests/test_exercises.py
    (forgets_eval, "call model.eval"),
    (leaves_eval_mode_on, "left it in eval mode"),
    (always_back_to_train_mode, "left it in train mode"),
    (returns_the_logit, "largest logit, not a probability"),
    (softmax_over_the_batch, "softmax ran over the batch dimension"),
    (without_a_batch_dimension, "image.unsqueeze.0."),
    (records_a_graph, "recorded a graph"),
    (returns_log_probabilities, "log-probabilities .log_softmax."),
    (probability_first, r"return \(class, probability\), in that order"),
    (never_moves_the_image, "with the model's weights on meta and the image on cpu, predict gave the model an image"),
    (to_a_fixed_device, "move the image to the model's own device"),
]


@pytest.mark.parametrize("wrong, hint", WRONG)
def test_each_mistake_gets_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=f"hint: .*{hint}"):
        check_predict(wrong)


def under_no_grad_returning_tensors(model, image):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            weights = next(model.parameters())
            probability, label = model(image[None].to(weights.device)).softmax(dim=-1).max(dim=-1)
    finally:
        model.train(was_training)
    return label[0], probability[0]  # 0-dim tensors: int() and float() read them


RIGHT = [under_no_grad_returning_tensors]


@pytest.mark.parametrize("right", RIGHT)
def test_other_right_answers_pass(right):
    assert check_predict.check(right).startswith("✓ predict gave one batched eval-mode pass's answers")


def test_the_check_leaves_the_global_random_state_alone():
    from helpers.exercises.inference import reference_predict

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    check_predict.check(reference_predict)
    assert torch.equal(torch.rand(3), expected)
