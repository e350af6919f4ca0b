"""Build a tiny random Llama model and a locally trained tokenizer (no hub downloads).

Usage: python -m kv_push.common.testing.tiny_model OUT_DIR [--seed N]
(or examples/make_tiny_model.py, which calls ``main``). Needs torch, tokenizers, transformers.

The model is only for exercising P/D serving on CPU: random weights, 2 layers, 2 KV heads of
size 64 (4 query heads), bf16. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

TEXT = """The quick brown fox jumps over the lazy dog. Prefill and decode run on different servers.
A key value cache holds attention keys and values for every token of the prompt. Push mode writes
the cache from the prefill server into blocks the decode server registered in advance. Pull mode
reads it after the prefill is done. Latency matters: the time to the first token is what users
feel. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. Tokens, blocks, layers, heads, bytes and ranks.
"""


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        print(f"tiny model already at {out}")
        return
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(out)

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=fast.vocab_size, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=2048, torch_dtype="bfloat16",
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    gen = out / "generation_config.json"
    if gen.exists():
        cfg = json.loads(gen.read_text())
        cfg.pop("eos_token_id", None)  # let generation run to max_tokens
        gen.write_text(json.dumps(cfg))
    print(f"tiny model written to {out}")


if __name__ == "__main__":
    main()
