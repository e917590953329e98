"""Optimizers: one chosen by name, parameter groups with their own learning rates, frozen layers."""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
from torch import nn

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}


def optimizer_names() -> list[str]:
    """The names `make_optimizer` accepts, sorted."""
    return sorted(OPTIMIZERS)


def _check_lr(name: str, lr) -> float:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"{name} must be a positive number, got {lr!r}")
    return float(lr)


def make_optimizer(name: str, params: Iterable, lr: float, **kwargs) -> torch.optim.Optimizer:
    """The torch.optim optimizer called `name` ('sgd', 'adam', ...) over `params` (tensors or param-group dicts)."""
    if not isinstance(name, str) or name.lower() not in OPTIMIZERS:
        raise ValueError(f"optimizer name must be one of {optimizer_names()}, got {name!r}")
    lr = _check_lr("lr", lr)
    params = list(params)
    if not params:
        raise ValueError("params must hold at least one tensor or parameter group, got none "
                         "(are all parameters frozen?)")
    return OPTIMIZERS[name.lower()](params, lr=lr, **kwargs)


def _set_trainable(module: nn.Module, trainable: bool) -> int:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    params = list(module.parameters())
    for param in params:
        param.requires_grad_(trainable)
    return len(params)


def freeze(module: nn.Module) -> int:
    """Stop training `module`: requires_grad=False on its parameters; return how many tensors were frozen."""
    return _set_trainable(module, False)


def unfreeze(module: nn.Module) -> int:
    """Train `module` again: requires_grad=True on its parameters; return how many tensors were unfrozen."""
    return _set_trainable(module, True)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that require gradients (what an optimizer should get after freezing)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return [param for param in model.parameters() if param.requires_grad]


def _belongs(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def parameter_groups(model: nn.Module, lrs: Mapping[str, float], *, trainable_only: bool = True) -> list[dict]:
    """Param groups for an optimizer: one per module-name prefix in `lrs` with that lr, then one with the rest.

    Prefixes are names from `model.named_parameters()` cut at a dot ('features', 'head.2', '1'). The last
    group has no 'lr' key, so it gets the optimizer's default; each group lists its `param_names`.
    Frozen parameters are left out unless `trainable_only=False`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(lrs, Mapping) or not lrs:
        raise ValueError(f"lrs must map at least one module-name prefix to a learning rate, got {lrs!r}")
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad or not trainable_only]
    groups: list[dict] = []
    claimed: set[str] = set()
    for prefix, lr in lrs.items():
        lr = _check_lr(f"lrs[{prefix!r}]", lr)
        matched = [(name, param) for name, param in named if _belongs(name, prefix)]
        if not matched:
            raise ValueError(f"prefix {prefix!r} in lrs matches no {'trainable ' if trainable_only else ''}parameter; "
                             f"names start with {sorted({name.split('.')[0] for name, _ in named})}")
        overlap = [name for name, _ in matched if name in claimed]
        if overlap:
            raise ValueError(f"prefix {prefix!r} in lrs claims parameters already in another group: {overlap}")
        claimed.update(name for name, _ in matched)
        groups.append({"params": [param for _, param in matched], "lr": lr,
                       "param_names": [name for name, _ in matched]})
    rest = [(name, param) for name, param in named if name not in claimed]
    if rest:
        groups.append({"params": [param for _, param in rest], "param_names": [name for name, _ in rest]})
    return groups


def group_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """The current learning rate of each parameter group."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return [group["lr"] for group in optimizer.param_groups]
