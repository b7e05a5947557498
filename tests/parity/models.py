"""The reference models of suites/models/models.cpp written again in Python, module for module.

Names and parameter order match the C++ modules (fc0.weight, block1.qkv.bias, ...), so a state
dumped by trainscope loads here by name. The forward passes use the same ATen ops in the same order:
on one machine, with the same weights, data and generator state, both sides compute the same bits.
`boundary` sees every block output, as Trainer::boundary does (block names and dtypes are compared).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import sac

# name: (family, hidden or blocks per stage, width, layers, heads, seq_len, vocab), as model_presets().
PRESETS = {
    "mlp-tiny": ("mlp", [64], 0, 0, 0, 0, 0),
    "mlp": ("mlp", [512, 256], 0, 0, 0, 0, 0),
    "cnn-tiny": ("cnn", [1, 1], 8, 0, 0, 0, 0),
    "cnn": ("cnn", [2, 2, 2], 32, 0, 0, 0, 0),
    "gpt-tiny": ("gpt", [], 64, 2, 4, 64, 256),
    "gpt-small": ("gpt", [], 256, 4, 4, 128, 1024),
}


class CheckpointPolicy:
    """none | full | every:k | selective-op, as suites/techniques/checkpoint.hpp parses them (every:k
    checkpoints 0, k, 2k...; selective-op checkpoints every block under torchtitan's op-level policy, sac.py)."""

    def __init__(self, text="none"):
        self.every = 0
        self.op_level = text == "selective-op"
        if text in ("full", "selective-op"):
            self.every = 1
        elif text.startswith("every:"):
            self.every = int(text.split(":", 1)[1])
        elif text != "none":
            raise ValueError(f"the parity references know none, full, every:k and selective-op here, not '{text}'")

    def checkpoints(self, index):
        return self.every > 0 and index % self.every == 0


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.policy = CheckpointPolicy()
        self.boundary = lambda name, x: x

    def run_block(self, index, fn, x):
        if self.training and torch.is_grad_enabled() and self.policy.checkpoints(index):
            if self.policy.op_level:  # torchtitan's SelectiveAC around the block
                return sac.run(fn, x)
            # torch.utils.checkpoint as the issue names it: non-reentrant, RNG state preserved.
            return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=True)
        return fn(x)

    def loss(self, inputs, targets):
        logits = self.forward(inputs)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).to(dtype), targets.reshape(-1))


class Mlp(Reference):
    def __init__(self, hidden, in_features, classes):
        super().__init__()
        self.names = []
        for i, h in enumerate(hidden):
            self.add_module(f"fc{i}", nn.Linear(in_features, h))
            self.names.append(f"fc{i}")
            in_features = h
        self.head = nn.Linear(in_features, classes)

    def forward(self, x):
        h = x.flatten(1)
        for i, name in enumerate(self.names):
            layer = getattr(self, name)
            h = self.run_block(i, lambda t, layer=layer: torch.relu(layer(t)), h)
            h = self.boundary(name, h)
        return self.boundary("head", self.head(h))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = self.shortcut_bn = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride, 0, bias=False)
            self.shortcut_bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        s = self.shortcut_bn(self.shortcut(x)) if self.shortcut is not None else x
        return torch.relu(y + s)


class Cnn(Reference):
    def __init__(self, stages, width, channels, classes):
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(width)
        cin, n = width, 0
        for stage, blocks in enumerate(stages):
            cout = width << stage
            for b in range(blocks):
                self.add_module(f"block{n}", BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1))
                n += 1
                cin = cout
        self.nblocks = n
        self.head = nn.Linear(cin, classes)

    def features(self, x):
        h = self.boundary("stem", torch.relu(self.stem_bn(self.stem(x))))
        for i in range(self.nblocks):
            h = self.run_block(i, getattr(self, f"block{i}"), h)
            h = self.boundary(f"block{i}", h)
        return h.mean((2, 3))

    def forward(self, x):
        return self.boundary("head", self.head(self.features(x)))


class DecoderBlock(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, S, D = x.shape
        Dh = D // self.heads
        qkv = self.qkv(self.ln1(x))

        # The attention core in a function of its own, as in the C++ block: its S x S tensors are freed
        # when it returns (Python would otherwise keep them alive as locals until the block returns).
        def core(packed):
            q, k, v = packed.view(B, S, 3, self.heads, Dh).permute(2, 0, 3, 1, 4)
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(Dh)
            causal = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
            att = torch.softmax(scores.masked_fill(causal, float("-inf")), -1)
            att = F.dropout(att, self.dropout, self.training)
            return torch.matmul(att, v).transpose(1, 2).reshape(B, S, D)

        y = core(qkv)
        h = x + F.dropout(self.proj(y), self.dropout, self.training)
        m = self.fc_proj(F.gelu(self.fc(self.ln2(h))))
        return h + F.dropout(m, self.dropout, self.training)


class Gpt(Reference):
    def __init__(self, d, layers, heads, seq_len, vocab, dropout):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq_len, d)
        self.nblocks = layers
        for i in range(layers):
            self.add_module(f"block{i}", DecoderBlock(d, heads, dropout))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, tokens):
        pos = torch.arange(tokens.size(1), dtype=torch.long, device=tokens.device)
        h = self.boundary("embed", self.tok_emb(tokens) + self.pos_emb(pos).unsqueeze(0))
        for i in range(self.nblocks):
            h = self.run_block(i, getattr(self, f"block{i}"), h)
            h = self.boundary(f"block{i}", h)
        return self.boundary("head", F.linear(self.ln_f(h), self.tok_emb.weight))  # tied head

    def blocks(self):
        return [getattr(self, f"block{i}") for i in range(self.nblocks)]


def make_model(preset, dropout=0.0, image_shape=(1, 28, 28), classes=10):
    if preset not in PRESETS:
        raise ValueError(f"no Python mirror of model '{preset}' (known: {', '.join(PRESETS)})")
    family, hidden, width, layers, heads, seq_len, vocab = PRESETS[preset]
    if family == "mlp":
        c, h, w = image_shape
        return Mlp(hidden, c * h * w, classes)
    if family == "cnn":
        return Cnn(hidden, width, image_shape[0], classes)
    return Gpt(width, layers, heads, seq_len, vocab, dropout)


def blocks_of(model):
    """The units a sharding strategy wraps, as trainscope's zero3 does: one per block."""
    if hasattr(model, "blocks"):  # Gpt, hf_llama.HfLlama
        return model.blocks()
    if isinstance(model, Cnn):
        return [getattr(model, f"block{i}") for i in range(model.nblocks)]
    return [getattr(model, n) for n in model.names]
