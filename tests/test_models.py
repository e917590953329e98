import pytest
import torch
from torch import nn

from helpers.models import (
    MLP,
    OPTIMIZERS,
    SmallCNN,
    count_parameters,
    deep_linear_stack,
    freeze,
    group_lrs,
    load_pretrained,
    make_optimizer,
    optimizer_names,
    parameter_groups,
    trainable_parameters,
    unfreeze,
)


def test_mlp_shapes_and_options():
    model = MLP(64, (32, 16), 10, dropout=0.2, batch_norm=True)
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    kinds = [type(m).__name__ for m in model]
    assert kinds.count("BatchNorm1d") == 2 and kinds.count("Dropout") == 2
    assert "Dropout" not in [type(m).__name__ for m in MLP()]


@pytest.mark.parametrize("size", [8, 28])
def test_cnn_takes_small_and_large_images(size):
    assert SmallCNN()(torch.randn(3, 1, size, size)).shape == (3, 10)


def test_deep_linear_stack_is_sequential_of_linear_relu():
    stack = deep_linear_stack(16, 3)
    assert len(stack) == 6
    assert stack(torch.randn(2, 16)).shape == (2, 16)
    assert count_parameters(stack) == 3 * (16 * 16 + 16)
    stack[0].weight.requires_grad_(False)
    assert count_parameters(stack, trainable_only=True) == 3 * (16 * 16 + 16) - 256


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: MLP(0), "in_features"),
        (lambda: MLP(hidden=(4, -1)), "hidden"),
        (lambda: MLP(dropout=1.0), "dropout"),
        (lambda: SmallCNN(num_classes=0), "num_classes"),
        (lambda: SmallCNN(dropout=-0.1), "dropout"),
        (lambda: deep_linear_stack(0, 2), "width"),
        (lambda: deep_linear_stack(4, 0), "depth"),
    ],
)
def test_models_reject_bad_sizes(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_make_optimizer_builds_each_named_optimizer(name):
    model = nn.Linear(3, 2)
    optimizer = make_optimizer(name, model.parameters(), lr=0.01)
    assert type(optimizer) is OPTIMIZERS[name]
    assert group_lrs(optimizer) == [0.01]
    model(torch.randn(4, 3)).sum().backward()
    before = model.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model.weight)


def test_make_optimizer_passes_options_and_ignores_case():
    optimizer = make_optimizer("SGD", nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9, nesterov=True)
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["momentum"] == 0.9 and optimizer.param_groups[0]["nesterov"]


def test_make_optimizer_unknown_name_lists_the_choices():
    with pytest.raises(ValueError) as error:
        make_optimizer("adamm", nn.Linear(2, 2).parameters(), lr=0.1)
    message = str(error.value)
    assert "'adamm'" in message and all(name in message for name in optimizer_names())
    with pytest.raises(ValueError, match="optimizer name"):
        make_optimizer(None, nn.Linear(2, 2).parameters(), lr=0.1)


@pytest.mark.parametrize("lr", [0, -0.1, "0.1", True, float("nan")])
def test_make_optimizer_bad_learning_rate(lr):
    with pytest.raises(ValueError, match="lr must be a positive number"):
        make_optimizer("sgd", nn.Linear(2, 2).parameters(), lr=lr)


def test_make_optimizer_with_nothing_to_train():
    model = nn.Linear(2, 2)
    freeze(model)
    with pytest.raises(ValueError, match="frozen"):
        make_optimizer("adam", trainable_parameters(model), lr=0.1)


def test_freeze_and_unfreeze():
    model = MLP(in_features=4, hidden=(3,), num_classes=2)
    assert freeze(model[1]) == 2
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]
    assert trainable_parameters(model) == [model[3].weight, model[3].bias]
    assert unfreeze(model) == 4
    assert len(trainable_parameters(model)) == 4
    for function in (freeze, unfreeze, trainable_parameters):
        with pytest.raises(TypeError, match="nn.Module"):
            function([torch.zeros(1)])


def test_a_frozen_layer_stays_put_while_the_rest_trains():
    torch.manual_seed(0)
    model = MLP(in_features=4, hidden=(8,), num_classes=3)
    freeze(model[1])
    optimizer = make_optimizer("sgd", trainable_parameters(model), lr=0.5)
    frozen_before, head_before = model[1].weight.clone(), model[3].weight.clone()
    nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.tensor([0, 1, 2, 0, 1])).backward()
    optimizer.step()
    assert model[1].weight.grad is None
    assert torch.equal(model[1].weight, frozen_before)
    assert not torch.equal(model[3].weight, head_before)


def test_parameter_groups_give_each_prefix_its_learning_rate():
    model = MLP(in_features=4, hidden=(8, 6), num_classes=3, batch_norm=True)
    groups = parameter_groups(model, {"1": 0.001, "7": 0.1})
    assert [g["param_names"] for g in groups] == [
        ["1.weight", "1.bias"],
        ["7.weight", "7.bias"],
        ["2.weight", "2.bias", "4.weight", "4.bias", "5.weight", "5.bias"],
    ]
    optimizer = make_optimizer("sgd", groups, lr=0.01)
    assert group_lrs(optimizer) == [0.001, 0.1, 0.01]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    grads = {}
    for param in model.parameters():
        param.grad = torch.ones_like(param)
        grads[param] = param.detach().clone()
    optimizer.step()
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert torch.allclose(grads[param] - param.detach(), torch.full_like(param, group["lr"]))


def test_parameter_groups_leave_out_frozen_parameters_and_may_have_no_rest():
    model = MLP(in_features=4, hidden=(3,), num_classes=2)
    freeze(model[1])
    groups = parameter_groups(model, {"3": 0.2})
    assert len(groups) == 1 and groups[0]["param_names"] == ["3.weight", "3.bias"]
    assert len(parameter_groups(model, {"3": 0.2}, trainable_only=False)) == 2


@pytest.mark.parametrize(
    "lrs, message",
    [
        ({}, "at least one"),
        ({"head": 0.1}, "matches no"),
        ({"1": 0.1, "1.weight": 0.2}, "already in another"),
        ({"1": 0}, "positive number"),
        ({"1": "fast"}, "positive number"),
    ],
)
def test_parameter_groups_bad_arguments(lrs, message):
    with pytest.raises(ValueError, match=message):
        parameter_groups(MLP(in_features=4, hidden=(3,), num_classes=2), lrs)


def test_prefixes_match_whole_name_parts():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(12)])
    groups = parameter_groups(model, {"1": 0.1})
    assert groups[0]["param_names"] == ["1.weight", "1.bias"]  # not 10.* or 11.*


def test_group_lrs_and_type_errors():
    with pytest.raises(TypeError, match="optimizer"):
        group_lrs("sgd")
    with pytest.raises(TypeError, match="model"):
        parameter_groups("model", {"1": 0.1})


@pytest.fixture
def hub_dir(tmp_path, monkeypatch):
    """An empty torch hub cache in tmp_path, with downloads failing as they do offline; restored afterwards."""
    from urllib.error import URLError

    def no_network(url, *args, **kwargs):
        raise URLError("no network in the unit tests")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    previous = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path))
    yield tmp_path
    torch.hub.set_dir(previous)


def test_load_pretrained_offline_says_what_failed_where_and_what_to_do(hub_dir):
    with pytest.raises(ConnectionError) as error:
        load_pretrained("resnet18")
    message = str(error.value)
    assert "resnet18-f37072fd.pth" in message and "download.pytorch.org" in message
    assert str(hub_dir / "checkpoints") in message and "Connect" in message and "copy" in message
    assert isinstance(error.value.__cause__, OSError)


def test_load_pretrained_reads_a_cached_file_without_the_network(hub_dir):
    from torchvision.models import ResNet18_Weights, resnet18

    torch.manual_seed(0)
    state = resnet18().state_dict()
    (hub_dir / "checkpoints").mkdir()
    torch.save(state, hub_dir / "checkpoints" / ResNet18_Weights.DEFAULT.url.rsplit("/", 1)[-1])
    model = load_pretrained("resnet18")
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


def test_load_pretrained_a_broken_cached_file_is_named(hub_dir):
    from torchvision.models import ResNet18_Weights

    (hub_dir / "checkpoints").mkdir()
    broken = hub_dir / "checkpoints" / ResNet18_Weights.DEFAULT.url.rsplit("/", 1)[-1]
    broken.write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="delete the file"):
        load_pretrained("resnet18")


@pytest.mark.parametrize("name", ["resnet", "", None])
def test_load_pretrained_unknown_name(name):
    with pytest.raises(ValueError, match="torchvision model name"):
        load_pretrained(name)


def _moved_trial(name, options=None, load=None, *, move=lambda net: net.to(torch.float64)):
    from helpers.models import optimizer_after_move

    torch.manual_seed(0)
    batch = (torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3]))
    source = MLP(64, (16,), 10)
    source_optimizer = make_optimizer("adam", source.parameters(), lr=0.01, foreach=False)
    nn.functional.cross_entropy(source(batch[0]), batch[1]).backward()
    source_optimizer.step()
    model = MLP(64, (16,), 10)
    return optimizer_after_move(model, move, name, options, load, batch=batch, checkpoint=source_optimizer.state_dict())


def test_optimizer_after_move_keeps_sgd_and_adam_working_and_leaves_adagrads_state_behind():
    for name, options in (("sgd", {"momentum": 0.9}), ("adam", {})):
        row = _moved_trial(name, options)
        assert row == {"same Parameters": True, "state at build": False, "first step": "ok", "state left behind": False}
    adagrad = _moved_trial("adagrad")
    assert adagrad["state at build"] and adagrad["state left behind"] and adagrad["first step"] == "ok"
    assert _moved_trial("adagrad", {"fused": True})["first step"].startswith("RuntimeError")


def test_optimizer_after_move_breaks_adam_state_loaded_before_the_move_only():
    assert _moved_trial("adam", {"foreach": False}, "before")["first step"].startswith("RuntimeError")
    assert _moved_trial("adam", {"foreach": False}, "after")["first step"] == "ok"


def test_optimizer_after_move_sees_a_move_that_replaces_the_parameters():
    def replace(net):  # not what Module.to does: a new Parameter object in place of the first
        net[1].weight = nn.Parameter(net[1].weight.detach().clone())

    assert not _moved_trial("sgd", move=replace)["same Parameters"]


def test_optimizer_after_move_refuses_an_unknown_load_and_a_load_without_checkpoint():
    from helpers.models import optimizer_after_move

    batch = (torch.randn(2, 1, 8, 8), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="load must be one of"):
        optimizer_after_move(MLP(64, (16,), 10), lambda net: net, "sgd", load="during", batch=batch)
    with pytest.raises(ValueError, match="needs a checkpoint"):
        optimizer_after_move(MLP(64, (16,), 10), lambda net: net, "sgd", load="before", batch=batch)
