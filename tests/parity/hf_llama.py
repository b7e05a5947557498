"""Hugging Face's LlamaForCausalLM as the parity reference of trainscope's llama (suites/models/llama.cpp).

The model is built from the dimensions a cell reports (cell.model.shape), with the attention
implementation the cell ran (eager or sdpa); trainscope's weights load into it by name. Names map one to
one: HF's `model.layers.<i>.self_attn.q_proj.weight` is trainscope's `block<i>.q_proj.weight`, and so on.
The loss is trainscope's: cross-entropy of the fp32 logits against the next tokens the batch holds
(HF's own loss shifts labels inside and would drop each sequence's last position).

    python hf_llama.py --count < shapes.json   parameter counts of {name: shape}, built on the meta device
"""
import copy
import json
import re
import sys

import torch
import torch.nn.functional as F
from torch import nn

import sac

transformers = None  # imported on first use (available()): the spawned ranks of the other rows never need it


def available():
    """Whether transformers imports (the llama rows are skipped with one line when it does not)."""
    global transformers
    if transformers is None:
        try:
            import transformers as t
        except ImportError:  # the rows say so; nothing else here needs it
            return False
        transformers = t
    return True

_TO_TRAINSCOPE = [
    (re.compile(r"^model\.embed_tokens\."), "embed_tokens."),
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkvo]_proj)\."), r"block\1.\2."),
    (re.compile(r"^model\.layers\.(\d+)\.mlp\.((gate|up|down)_proj)\."), r"block\1.\2."),
    (re.compile(r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\."), r"block\1.\2."),
    (re.compile(r"^model\.norm\."), "norm."),
    (re.compile(r"^lm_head\."), "lm_head."),
]


def trainscope_name(hf_name):
    for pattern, repl in _TO_TRAINSCOPE:
        if pattern.match(hf_name):
            return pattern.sub(repl, hf_name, count=1)
    raise KeyError(f"no trainscope name for HF parameter {hf_name}")


def config_of(shape, attention="eager"):
    """A LlamaConfig with the shape's dimensions (cell.model.shape or a preset's)."""
    rope = shape["rope"]
    if rope["factor"] > 1:
        rope_parameters = {"rope_type": "llama3", "rope_theta": rope["theta"], "factor": rope["factor"],
                           "low_freq_factor": rope["low_freq_factor"], "high_freq_factor": rope["high_freq_factor"],
                           "original_max_position_embeddings": rope["original_context"]}
    else:
        rope_parameters = {"rope_type": "default", "rope_theta": rope["theta"]}
    available()
    return transformers.LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["d_model"], intermediate_size=shape["ffn"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["seq_len"],
                       rms_norm_eps=shape["norm_eps"], rope_parameters=rope_parameters,
                       tie_word_embeddings=shape["tied"], attention_bias=False, mlp_bias=False,
                       attention_dropout=0.0, pad_token_id=None, use_cache=False, attn_implementation=attention)


class HfLlama(nn.Module):
    """LlamaForCausalLM behind the interface reference.py drives (loss, policy, boundary, blocks)."""

    def __init__(self, shape, attention):
        super().__init__()
        if not available():
            raise RuntimeError("transformers is not installed in this Python (scripts/reference-packages.txt)")
        self.lm = transformers.LlamaForCausalLM(config_of(shape, attention))
        self.attention = attention
        self.policy = None
        self.boundary = lambda name, x: x

    def forward(self, tokens):
        return self.lm(input_ids=tokens, use_cache=False).logits

    def loss(self, inputs, targets):
        logits = self.forward(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    def blocks(self):
        return list(self.lm.model.layers)

    def set_checkpoint(self, text, as_trainscope=False):
        """trainscope's `checkpoint` key on HF's model: none; full and selective-op checkpoint every decoder
        layer (selective-op under torchtitan's op-level policy, sac.py, as torchtitan wraps each block);
        selective checkpoints the attention core alone (suites/models/llama.cpp: from the rotated query, key
        and value to the heads' output before o_proj). as_trainscope (full, selective-op, SDPA): each
        checkpointed layer runs block_as_trainscope instead of HF's forward."""
        if text == "none":
            return
        if text in ("full", "selective-op"):
            run = sac.run if text == "selective-op" else sac.run_full
            for layer in self.lm.model.layers:
                inner = layer.forward  # the layer's own forward; checkpoint re-runs it in backward
                if as_trainscope:  # the replica of trainscope's block (block_as_trainscope)
                    def inner(hidden_states, *args, _layer=layer, position_embeddings=None, **kwargs):
                        return block_as_trainscope(_layer, hidden_states, *position_embeddings)

                def checkpointed(*args, _inner=inner, _run=run, **kwargs):
                    if not (self.training and torch.is_grad_enabled()):
                        return _inner(*args, **kwargs)
                    # HF hands every layer the position ids, which only reach the attention, which does
                    # not read them (RoPE comes as position_embeddings): kept out of the checkpoint, which
                    # would hold them until backward (512 B on llama-tiny; trainscope's block has none).
                    for unread in ("position_ids", "cache_position"):
                        kwargs.pop(unread, None)
                    return _run(_inner, *args, **kwargs)

                layer.forward = checkpointed
            return
        if text == "selective":
            # The attention implementation HF looks up by name (config._attn_implementation) behind a
            # checkpoint; only the attention modules see the new name, so the mask is built as before.
            name = _checkpointed_attention(self.attention)
            for layer in self.lm.model.layers:
                attn = layer.self_attn
                attn.config = copy.copy(attn.config)
                attn.config._attn_implementation = name
            return
        raise ValueError(f"the llama reference knows checkpoint none, full, selective and selective-op, not '{text}'")


def _rms_norm_as_trainscope(norm, x):
    """suites/models/llama.cpp's RmsNormImpl::forward, its C++ lifetimes kept: a temporary lives to the end
    of its statement, a local to the function's return."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    squared = h.pow(2)
    variance = squared.mean(-1, keepdim=True)
    del squared
    shifted = variance + norm.variance_epsilon
    scale = torch.rsqrt(shifted)
    h = h * scale
    del shifted, scale
    return norm.weight * h.to(input_dtype)


def _rotary_as_trainscope(x, cos, sin):
    """llama.cpp's apply_rotary and rotate_half, C++ lifetimes."""
    x_cos = x * cos.unsqueeze(1)
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    negated = -x2
    rotated = torch.cat((negated, x1), -1)
    del negated
    product = rotated * sin.unsqueeze(1)
    out = x_cos + product
    del rotated, product
    return out


def block_as_trainscope(layer, x, cos, sin):
    """LlamaBlock::forward (suites/models/llama.cpp, SDPA) on HF's decoder layer's weights, op for op and with
    C++'s lifetimes: every named local (normed, q, k, v, q_embed, k_embed, attn, h, normed2, gate, up) held
    until the block returns, each temporary to the end of its statement. HF's decoder layer computes the
    same values but rebinds hidden_states as it goes, so Python frees each intermediate after its last use.
    With the block's graph kept (no checkpointing) autograd holds them all anyway; under a checkpoint the
    difference is the forward's transient peak."""
    attn_m, mlp = layer.self_attn, layer.mlp
    B, S = x.shape[0], x.shape[1]
    hd = attn_m.head_dim
    residual = x
    normed = _rms_norm_as_trainscope(layer.input_layernorm, x)
    q = F.linear(normed, attn_m.q_proj.weight).view(B, S, -1, hd).transpose(1, 2)
    k = F.linear(normed, attn_m.k_proj.weight).view(B, S, -1, hd).transpose(1, 2)
    v = F.linear(normed, attn_m.v_proj.weight).view(B, S, -1, hd).transpose(1, 2)
    q_embed = _rotary_as_trainscope(q, cos, sin)
    k_embed = _rotary_as_trainscope(k, cos, sin)
    n_rep = attn_m.num_key_value_groups
    out = F.scaled_dot_product_attention(q_embed, k_embed, v, dropout_p=0.0, is_causal=True, scale=attn_m.scaling,
                                         enable_gqa=n_rep > 1)
    out = out.reshape(out.size(0), -1, S, v.size(-1))
    attn = out.transpose(1, 2).contiguous().reshape(B, S, -1).contiguous()
    del out  # the core lambda's local
    projected = F.linear(attn, attn_m.o_proj.weight)
    h = residual + projected
    del projected
    normed2 = _rms_norm_as_trainscope(layer.post_attention_layernorm, h)
    gate_out = F.linear(normed2, mlp.gate_proj.weight)
    gate = F.silu(gate_out)
    del gate_out
    up = F.linear(normed2, mlp.up_proj.weight)
    product = gate * up
    down = F.linear(product, mlp.down_proj.weight)
    result = h + down
    del product, down
    return result


def _checkpointed_attention(attention):
    """Registers (once) HF's `attention` implementation behind a non-reentrant checkpoint over the query,
    key and value, and returns its name. The checkpoint returns the heads' output only (HF discards the
    attention weights the implementation also returns)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama
    name = f"trainscope-checkpointed-{attention}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        base = modeling_llama.eager_attention_forward if attention == "eager" else ALL_ATTENTION_FUNCTIONS[attention]

        def checkpointed(module, query, key, value, attention_mask, **kwargs):
            # HF also hands the attention position_ids, which neither SDPA nor eager attention reads: kept
            # out of the checkpoint, which would hold them until backward (trainscope's core takes the
            # query, key, value and the mask).
            arguments = {k: v for k, v in kwargs.items() if not torch.is_tensor(v)}

            def core(q, k, v):
                return base(module, q, k, v, attention_mask, **arguments)[0]
            if not (module.training and torch.is_grad_enabled()):
                return base(module, query, key, value, attention_mask, **kwargs)
            return sac.run_full(core, query, key, value), None

        AttentionInterface.register(name, checkpointed)
    return name


def count(shape):
    """Parameters of HF's model with these dimensions, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config_of(shape))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    # --count: JSON {name: shape, ...} on stdin -> {name: parameters}
    if sys.argv[1:] == ["--count"]:
        if not available():
            print("transformers is not installed", file=sys.stderr)
            sys.exit(3)
        shapes = json.load(sys.stdin)
        print(json.dumps({name: count(s) for name, s in shapes.items()}))
        sys.exit(0)
    print(__doc__, file=sys.stderr)
    sys.exit(2)
