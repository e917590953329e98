"""A small GPT (GPT-2's layout, byte-level by default) for the capstone training script, written to be read.

    config = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128)
    model = GPT(config)                       # tokens [B, T] -> logits [B, T, vocab_size]
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    text = generate(model, prompt, 200, top_k=50)

Each block is pre-norm: x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)). The output matrix is the token
embedding itself (tied weights). `parameter_count` and `flops_per_token` give the sizes from the config alone, for
tokens/s and MFU; `optimizer_groups` splits the parameters for AdamW's weight decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .checkpoint import unwrap_model
from .checks import check_int, check_positive_number, check_range


@dataclass(frozen=True)
class GPTConfig:
    """The model's sizes: vocabulary, context length, depth, heads, width, and the dropout probability."""

    vocab_size: int = 256  # bytes
    block_size: int = 128  # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # in [0, 1)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_int(name, getattr(self, name))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd must be divisible by n_head, got n_embd={self.n_embd} and n_head={self.n_head}")
        check_range("dropout", self.dropout, 0, 1, high_open=True)

    @property
    def head_size(self) -> int:
        """The width of one attention head."""
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head attention where each position sees itself and the positions before it."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)  # queries, keys and values in one product
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        # [B, T, 3d] -> three [B, n_head, T, head_size]
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).split(width, dim=2))
        # softmax(q k^T / sqrt(head_size)) v with the future masked; picks a flash / memory-efficient kernel if any
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(batch, time, width)  # heads side by side again
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Per-position feed-forward: widen 4 times, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """One transformer block, pre-norm: attention then MLP, each added to the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, n_layer blocks, a final LayerNorm and the tied output matrix."""

    def __init__(self, config: GPTConfig, *, checkpointing: bool = False) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.checkpointing = checkpointing  # recompute each block's activations in backward instead of keeping them
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one matrix reads tokens in and scores them out
        self.apply(_init_weights)
        # GPT-2: each block adds two projections to the residual stream; scale them so its variance stays put
        for module in self.modules():
            if isinstance(module, (CausalSelfAttention, MLP)):
                nn.init.normal_(module.proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx must hold token ids as int64 (or int32), got dtype {idx.dtype}")
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, time], got shape {tuple(idx.shape)}")
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(f"sequence length T={time} is longer than block_size={self.config.block_size}")
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        checkpointing = self.checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointing else block(x)
        return self.head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: weights normal(0, 0.02), biases 0, LayerNorm 1 and 0."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def parameter_count(config: GPTConfig) -> int:
    """Parameters of GPT(config), tied weights counted once."""
    d = config.n_embd
    per_block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return config.vocab_size * d + config.block_size * d + config.n_layer * per_block + 2 * d


def flops_per_token(config: GPTConfig, *, training: bool = True) -> int:
    """Matrix-multiply FLOPs per token at full context, for a training step (forward + backward) or a forward.

    The count of PaLM's appendix B and nanoGPT's `estimate_mfu`. A product by a weight matrix costs 2 FLOPs per
    weight per token forward (a multiply and an add) and twice that backward (the input's gradient and the
    weight's), so 6 N for training, 2 N forward only, N being the parameters that multiply: all but the position
    embeddings (a lookup), the tied output matrix counted once, as the head's product. Attention adds two products
    per layer, q k^T and the weights times v, each 2 * T * n_embd per token: 4 * n_layer * T * n_embd forward,
    3 times that for training. They are counted over the whole T x T, the half the causal mask skips included,
    as torch.utils.flop_counter counts them. Element-wise work (LayerNorm, GELU, softmax) is left out.

    Checking against flop_counter: a fused attention kernel recomputes q k^T in backward and the counter adds that
    product (14 rather than 12 * n_layer * T * n_embd); older torch counts 0 for the CPU's fused kernel (pytorch
    issue 195460). Under `sdpa_kernel(SDPBackend.MATH)` attention is the two products above, on every torch.
    """
    multiplying = parameter_count(config) - config.block_size * config.n_embd
    attention = 4 * config.n_layer * config.block_size * config.n_embd
    return 6 * multiplying + 3 * attention if training else 2 * multiplying + attention


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample max_new_tokens after `prompt` ([T0] or [B, T0] token ids on the model's device), in eval mode.

    The context is cropped to the last block_size tokens; the model's train/eval mode is restored after.
    Returns the prompt followed by the new tokens ([T0 + n] or [B, T0 + n]).
    """
    config = getattr(unwrap_model(model), "config", None)
    if not isinstance(config, GPTConfig):
        raise TypeError(f"model must be a GPT (or a wrapped one) with a GPTConfig, got {type(model).__name__}")
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_positive_number("temperature", temperature)
    check_int("top_k", top_k, maximum=config.vocab_size, allow_none=True)
    if prompt.dim() not in (1, 2) or prompt.shape[-1] == 0:
        raise ValueError(
            f"prompt must be a non-empty [T0] or [B, T0] tensor of token ids, got shape {tuple(prompt.shape)}"
        )
    tokens = prompt if prompt.dim() == 2 else prompt.unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -config.block_size :])[:, -1, :] / temperature  # the last position's scores
            if top_k is not None:  # keep the k most likely tokens
                kth_best = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth_best, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token], dim=1)
    finally:
        model.train(was_training)
    return tokens if prompt.dim() == 2 else tokens.squeeze(0)


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on the matrices (linear weights, embeddings), none on biases and LayerNorm."""
    check_range("weight_decay", weight_decay, 0, math.inf)
    parameters = list(model.parameters())  # a tied weight appears once
    return [
        {"params": [p for p in parameters if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
    ]
