"""Hugging Face's LlamaForCausalLM as the parity reference of trainscope's llama (suites/models/llama.cpp).

The model is built from the dimensions a cell reports (cell.model.shape), with the attention
implementation the cell ran (eager or sdpa); trainscope's weights load into it by name. Names map one to
one: HF's `model.layers.<i>.self_attn.q_proj.weight` is trainscope's `block<i>.q_proj.weight`, and so on.
The loss is trainscope's: cross-entropy of the fp32 logits against the next tokens the batch holds
(HF's own loss shifts labels inside and would drop each sequence's last position).

    python hf_llama.py --count < shapes.json   parameter counts of {name: shape}, built on the meta device
"""
import json
import re
import sys

import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # the rows say so; nothing else here needs it
    transformers = None

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
    return LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["d_model"], intermediate_size=shape["ffn"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["seq_len"],
                       rms_norm_eps=shape["norm_eps"], rope_parameters=rope_parameters,
                       tie_word_embeddings=shape["tied"], attention_bias=False, mlp_bias=False,
                       attention_dropout=0.0, pad_token_id=None, use_cache=False, attn_implementation=attention)


class HfLlama(nn.Module):
    """LlamaForCausalLM behind the interface reference.py drives (loss, policy, boundary, blocks)."""

    def __init__(self, shape, attention):
        super().__init__()
        if transformers is None:
            raise RuntimeError("transformers is not installed in this Python (scripts/reference-packages.txt)")
        self.lm = LlamaForCausalLM(config_of(shape, attention))
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


def count(shape):
    """Parameters of HF's model with these dimensions, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config_of(shape))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    # --count: JSON {name: shape, ...} on stdin -> {name: parameters}
    if sys.argv[1:] == ["--count"]:
        if transformers is None:
            print("transformers is not installed", file=sys.stderr)
            sys.exit(3)
        shapes = json.load(sys.stdin)
        print(json.dumps({name: count(s) for name, s in shapes.items()}))
        sys.exit(0)
    print(__doc__, file=sys.stderr)
    sys.exit(2)
