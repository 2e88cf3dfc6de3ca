"""A random tiny Llama and random prompts: what the objective study's smoke run trains on, no download.

    python3 benchmarks/gpu/tiny_model.py DIR      # DIR/hf (the model, tokenizer, chat template), DIR/prompts

``benchmarks/gpu/real_model.sh smoke`` (the GPU script's study part) runs ``tools/objective_study.py``
on them; tests/test_objective_study.py imports :func:`make_tiny_model` and :func:`make_tiny_prompts`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bebop_megatron.study.stages import DONE  # the study's mark of a complete folder


TINY_WORDS = ("hello world how are you the cat sat on mat i am fine thank what is two plus four "
              "tell me a story once upon time there was dog who ran far away end good night").split()


def make_tiny_model(path: Path) -> Path:
    """A random Llama (hidden 32, 2 layers, the family of SmolLM2) with a word-level tokenizer and
    a chat template: what the smoke run trains on, so that it needs no download."""
    import torch
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / DONE).is_file():
        return path
    roles = ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tok = Tokenizer(tok_models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(TINY_WORDS)],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>", *roles]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                 eos_token="</s>", additional_special_tokens=roles)
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                        "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    hf.save_pretrained(str(path))
    hf = AutoTokenizer.from_pretrained(str(path))
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, vocab_size=len(hf),
                         bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
                         tie_word_embeddings=True, initializer_range=0.3)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    (path / DONE).write_text("ok\n")
    return path


def make_tiny_prompts(path: Path, num_train: int = 24, num_heldout: int = 6) -> Path:
    import random

    rng = random.Random(0)
    path.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", num_train), ("heldout", num_heldout)):
        lines = [json.dumps({"id": f"{split}{i}", "prompt": " ".join(rng.choices(TINY_WORDS, k=6))}) for i in range(n)]
        (path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    root = Path(sys.argv[1])  # usage: tiny_model.py DIR
    make_tiny_model(root / "hf")
    if not (root / "prompts" / "heldout.jsonl").is_file():
        make_tiny_prompts(root / "prompts")
