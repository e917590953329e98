import contextlib
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from helpers.gpt import GPT, GPTConfig, flops_per_token, generate, optimizer_groups, parameter_count

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def tiny_model(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(TINY, **changes))


def random_tokens(config: GPTConfig, batch: int, time: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(config.vocab_size, (batch, time), generator=torch.Generator().manual_seed(seed))


def test_logits_shape_at_full_and_shorter_context():
    model = tiny_model()
    assert model(random_tokens(TINY, 3, 16)).shape == (3, 16, 64)
    assert model(random_tokens(TINY, 2, 5)).shape == (2, 5, 64)
    assert TINY.head_size == 16


def test_forward_refuses_bad_input():
    model = tiny_model()
    with pytest.raises(ValueError, match="T=17.*block_size=16"):
        model(random_tokens(TINY, 1, 17))
    with pytest.raises(TypeError, match="float32"):
        model(torch.rand(1, 4))
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        model(torch.tensor([1, 2, 3]))


def test_attention_is_causal():
    model = tiny_model().eval()
    tokens = random_tokens(TINY, 1, 16)
    changed = tokens.clone()
    changed[0, 9] = (tokens[0, 9] + 1) % TINY.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :9], before[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 9], after[:, 9])


@pytest.mark.parametrize(
    "changes, names",
    [
        ({"n_embd": 30, "n_head": 4}, ["n_embd=30", "n_head=4"]),
        ({"n_layer": 0}, ["n_layer"]),
        ({"dropout": 1.0}, ["dropout"]),
        ({"block_size": 0}, ["block_size"]),
        ({"vocab_size": -1}, ["vocab_size"]),
        ({"n_head": True}, ["n_head"]),
    ],
)
def test_bad_configs_are_refused_by_name(changes, names):
    with pytest.raises(ValueError) as error:
        GPTConfig(**changes)
    for name in names:
        assert name in str(error.value)


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=1, n_embd=4),
        GPTConfig(vocab_size=100, block_size=32, n_layer=3, n_head=3, n_embd=48),
    ],
)
def test_weights_tied_and_parameter_count_matches_module(config):
    model = GPT(config)
    assert model.head.weight is model.tok_emb.weight
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_initial_loss_is_close_to_uniform_guess():
    model = tiny_model()
    tokens = random_tokens(TINY, 8, 16)
    targets = random_tokens(TINY, 8, 16, seed=2)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1


def test_residual_projections_have_scaled_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4))  # 16k and 65k weights per projection
    expected = 0.02 / math.sqrt(2 * 4)
    for block in model.blocks:
        for proj in (block.attn.proj, block.mlp.proj):
            assert abs(proj.weight.std().item() / expected - 1) < 0.1
            assert torch.count_nonzero(proj.bias) == 0
    assert abs(model.blocks[0].mlp.fc.weight.std().item() / 0.02 - 1) < 0.1


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointing_gives_same_loss_and_gradients(dropout):
    tokens, targets = random_tokens(TINY, 4, 16), random_tokens(TINY, 4, 16, seed=2)
    results = []
    for checkpointing in (False, True):
        model = tiny_model(dropout=dropout)
        model.checkpointing = checkpointing
        torch.manual_seed(3)  # the same dropout masks; the recompute replays them
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_plain, grads_plain), (loss_checkpointed, grads_checkpointed) = results
    torch.testing.assert_close(loss_checkpointed, loss_plain, rtol=1e-6, atol=1e-7)
    for plain, checkpointed in zip(grads_plain, grads_checkpointed):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-7)


def test_checkpointing_skipped_under_no_grad_and_eval(monkeypatch):
    calls = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = tiny_model()
    model.checkpointing = True
    tokens = random_tokens(TINY, 2, 8)
    with torch.no_grad():
        model(tokens)
    model.eval()
    model(tokens)
    assert calls == []
    model.train()
    model(tokens)
    assert len(calls) == TINY.n_layer


# The CPU's fused attention kernel: FlopCounterMode has a formula for it only in recent torch (pytorch issue 195460);
# older releases count its FLOPs as 0. The math kernel writes attention out as batched products, which every torch sees.
CPU_ATTENTION_COUNTED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in flop_registry

FLOP_CONFIGS = [
    GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=128),  # mostly weight products
    GPTConfig(vocab_size=64, block_size=256, n_layer=2, n_head=2, n_embd=32),  # attention more than half
]


def counted_flops(model: nn.Module, tokens: torch.Tensor, *, training: bool, math_attention: bool) -> int:
    attention = sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
    with attention, FlopCounterMode(display=False) as counter:
        if training:
            model(tokens).sum().backward()
        else:
            with torch.no_grad():
                model(tokens)
    return counter.get_total_flops()


@pytest.mark.parametrize("config", FLOP_CONFIGS)
@pytest.mark.parametrize("training", [True, False])
def test_flops_per_token_matches_flop_counter(config, training):
    torch.manual_seed(0)
    model, batch = GPT(config), 2
    tokens = random_tokens(config, batch, config.block_size)
    counted = counted_flops(model, tokens, training=training, math_attention=True)
    estimated = flops_per_token(config, training=training) * batch * config.block_size
    assert abs(counted / estimated - 1) < 0.1


@pytest.mark.skipif(not CPU_ATTENTION_COUNTED, reason="this torch's flop_counter counts 0 for CPU fused attention")
@pytest.mark.parametrize("config", FLOP_CONFIGS)
@pytest.mark.parametrize("training", [True, False])
def test_flop_counter_adds_fused_attentions_recompute(config, training):
    torch.manual_seed(0)
    model, batch, time = GPT(config), 2, config.block_size
    tokens = random_tokens(config, batch, time)
    fused = counted_flops(model, tokens, training=training, math_attention=False)
    written_out = counted_flops(model, tokens, training=training, math_attention=True)
    recompute = 2 * config.n_layer * batch * time * time * config.n_embd  # q k^T once more per layer in backward
    assert fused - written_out == (recompute if training else 0)
    assert abs(fused / (flops_per_token(config, training=training) * batch * time) - 1) < 0.1


def test_attention_share_of_flops_grows_with_context():
    short = GPTConfig(block_size=32, n_embd=128)
    long = GPTConfig(block_size=256, n_embd=32, n_head=2)
    for config in (short, long):
        assert flops_per_token(config) == 3 * flops_per_token(config, training=False)
    attention_share = {
        c.block_size: 12 * c.n_layer * c.block_size * c.n_embd / flops_per_token(c) for c in (short, long)
    }
    assert attention_share[256] > 0.5 > attention_share[32]


def test_generate_length_prefix_and_seed():
    model = tiny_model()
    prompt = torch.tensor([1, 2, 3])
    first = generate(model, prompt, 10, generator=torch.Generator().manual_seed(7))
    again = generate(model, prompt, 10, generator=torch.Generator().manual_seed(7))
    assert first.shape == (13,)
    assert torch.equal(first[:3], prompt)
    assert torch.equal(first, again)
    batched = generate(model, prompt.repeat(2, 1), 4, temperature=0.5, top_k=5)
    assert batched.shape == (2, 7)


def test_generate_top_k_1_is_greedy():
    model = tiny_model().eval()
    tokens = torch.tensor([[5, 6]])
    for _ in range(6):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generate(model, torch.tensor([[5, 6]]), 6, top_k=1), tokens)


def test_generate_restores_mode_and_crops_long_prompts():
    model = tiny_model().train()
    out = generate(model, random_tokens(TINY, 1, 40), 5)
    assert out.shape == (1, 45)
    assert model.training
    model.eval()
    generate(model, torch.tensor([1]), 2)
    assert not model.training


@pytest.mark.parametrize(
    "kwargs, name",
    [({"temperature": 0.0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_k": 65}, "top_k")],
)
def test_generate_refuses_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        generate(tiny_model(), torch.tensor([1, 2]), 3, **kwargs)


def test_generate_refuses_empty_prompt():
    with pytest.raises(ValueError, match="prompt"):
        generate(tiny_model(), torch.tensor([], dtype=torch.int64), 3)


def test_optimizer_groups_split_matrices_from_biases_and_norms():
    model = tiny_model()
    decayed, plain = optimizer_groups(model, 0.1)
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    grouped = [id(p) for group in (decayed, plain) for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    assert len(grouped) == len(set(grouped))
    decayed_ids = {id(p) for p in decayed["params"]}
    assert id(model.tok_emb.weight) in decayed_ids and id(model.pos_emb.weight) in decayed_ids
    assert id(model.blocks[0].attn.qkv.weight) in decayed_ids
    for name, p in model.named_parameters():
        if name.endswith("bias") or ".ln_" in name or name.startswith("ln_"):
            assert id(p) not in decayed_ids, name
    torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-3)  # AdamW takes the groups as they are


def test_dropout_differs_in_train_mode_only():
    model = tiny_model(dropout=0.2)
    tokens = random_tokens(TINY, 2, 16)
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


@pytest.mark.slow  # compiles a GPT step
def test_compiled_gradients_match_eager_where_compat_says_they_do():
    """helpers.compat.compiled_gpt_gradients_right against the compiler itself: on this torch, every gradient of a
    compiled step agrees with eager mode's, or the token embedding's is far off (torch 2.6 on a CPU)."""
    from helpers import compat

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32))
    tokens = torch.randint(0, 256, (4, 32))

    def gradients(step_model: nn.Module) -> dict[str, torch.Tensor]:
        model.zero_grad()
        F.cross_entropy(step_model(tokens).flatten(0, 1), tokens.flatten()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    eager, compiled = gradients(model), gradients(torch.compile(model))
    errors = {name: ((compiled[name] - g).norm() / g.norm()).item() for name, g in eager.items()}
    right, why = compat.compiled_gpt_gradients_right("cpu")
    if right:
        assert max(errors.values()) < 1e-4, errors
    else:
        assert errors["tok_emb.weight"] > 0.05, (why, errors)
