"""Weightless Qwen2.5-shaped model folders for vLLM's ``load_format="dummy"`` (GPU benchmarks).

``build_dummy_model(out, shape)`` writes ``config.json`` + ``generation_config.json`` shaped like
Qwen2.5-0.5B-Instruct (``"0.5b"``) or Qwen2.5-7B (``"7b"``), and a synthetic tokenizer that
covers every one of the 151936 ids: a ``tokenizers`` WordLevel vocabulary ``<t0>`` ..
``<t151935>`` split on whitespace, Qwen's special tokens at their real ids. Unknown words map
to ``<t0>``, so a benchmark prompt of N short English words is N tokens.

The tokenizer is written twice, into ``out`` and ``out/tokenizer``: pass
``tokenizer=out/tokenizer`` to vLLM. transformers 5 rebuilds the tokenizer of a folder whose
config.json says ``model_type: qwen2`` (a byte-level BPE with no merges, which tokenizes text
to nothing); a folder without config.json gets the plain fast tokenizer.

The shapes are the ones the raw-vLLM reference figures (``gpumesh_bench.gpu.records``) were
measured on, so the mesh runs the very same engines. Needs only the ``tokenizers`` package; ~2 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "build_dummy_model"]

VOCAB = 151936
SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}

_BASE: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": VOCAB,
    "transformers_version": "5.17.0",  # >= 5.0 silences transformers' tokenizer regex check
}

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                 "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
               "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False},
}

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def _token(i: int) -> str:
    return SPECIAL.get(i, f"<t{i}>")


def build_dummy_model(out: str | Path, shape: str = "0.5b") -> Path:
    """Write the folder (idempotent: an existing config.json of this shape is kept)."""
    out = Path(out)
    cfg = {**_BASE, **SHAPES[shape.lower()]}
    cfg_path = out / "config.json"
    if cfg_path.is_file() and json.loads(cfg_path.read_text()) == cfg \
            and (out / "tokenizer" / "tokenizer.json").is_file():
        return out
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643]}, indent=2))
    tok = Tokenizer(models.WordLevel(vocab={_token(i): i for i in range(VOCAB)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Join tokens with a space when decoding (a WordPiece decoder with an impossible prefix).
    tok.decoder = decoders.WordPiece(prefix="\u0000\u0000", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL.values()])
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    for d in (out, out / "tokenizer"):
        d.mkdir(parents=True, exist_ok=True)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
        (d / "special_tokens_map.json").write_text(
            json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2))
    return out


if __name__ == "__main__":
    import sys

    print(build_dummy_model(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "0.5b"))
