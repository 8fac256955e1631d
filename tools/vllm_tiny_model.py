"""Make the test bed's tiny Llama model on local disk (no hub): ``python vllm_tiny_model.py OUT_DIR``.

Runs inside the vLLM virtualenv (it needs ``tokenizers`` and ``transformers``, which triscope's own
environment does not have), started by ``triscope_bed.engines.vllm_cpu.make_tiny_model``. The weights
are random: the model serves real requests at a real cost, and its words mean nothing.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

VOCAB = 4096
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
# One turn per message, the assistant turn opened when asked (what chat completions need).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONFIG = {  # 2 layers, hidden 256, 4 heads, 2 KV heads: about 3.3M parameters, 1 KiB of KV cache per token
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 2048, "vocab_size": VOCAB, "torch_dtype": "bfloat16",
}


def corpus(limit_bytes: int = 3_000_000) -> list[str]:
    """Training text found on any machine with Python: the standard library's own sources, in a fixed order."""
    texts: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def make(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    cfg = LlamaConfig(**CONFIG, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    return {"vocab": len(fast), "parameters": sum(p.numel() for p in model.parameters())}


if __name__ == "__main__":
    print(json.dumps(make(Path(sys.argv[1]))))
