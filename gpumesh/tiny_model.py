"""A tiny random-weight Qwen2 model with a locally trained tokenizer, built in seconds.

Model hubs are not always reachable (CI, air-gapped boxes, laptops), yet the node must run the
real vLLM engine in tests and demos. ``build_tiny_model`` writes a complete Hugging Face style
model folder that vLLM loads like any other local model:

- ``config.json``: Qwen2 architecture, hidden 128, 2 attention heads of head_dim 64 (vLLM's CPU
  attention needs head_dim >= 64), 1 KV head, 2 layers, 2048 positions, bfloat16.
- ``model.safetensors``: random weights from ``torch.manual_seed(seed)``.
- ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level BPE (HF ``tokenizers``) trained on
  a built-in English corpus, ~2k tokens, with a Qwen-style chat template
  (``<|im_start|>role\\n...<|im_end|>``); EOS is ``<|im_end|>``.
- ``generation_config.json``.

The output is a pure function of ``seed`` (and the installed torch / tokenizers versions): two
builds produce byte-identical files. The text it generates is gibberish, by design.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["TINY_MODEL_FILES", "build_tiny_model", "is_complete_model"]

logger = logging.getLogger(__name__)

TINY_MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
# Written last: its presence means every other file is complete.
_MARKER = ".gpumesh-tiny-model"

_VOCAB_TARGET = 2048
_HIDDEN = 128
_HEADS = 2
_KV_HEADS = 1
_LAYERS = 2
_INTERMEDIATE = 256
_MAX_POSITIONS = 2048

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A router balances requests across many nodes,
and every node wraps one inference engine. When a node is busy, its queue grows and the
router sends new work elsewhere. Heartbeats carry the load of each node to the router every
few hundred milliseconds, so the router always knows which machines are idle and which are
full. A request enters the mesh, waits in a queue, runs on a GPU, and streams its tokens back
to the client one by one. The first token matters most: people notice when an answer starts
late, far more than when it ends late.
Language models read text as tokens. A tokenizer splits words into pieces; common words are a
single piece, rare words are several. The model predicts the next piece, again and again,
until it writes an end token or reaches its length limit. Memory for the attention cache grows
with every token, and when the cache is full the scheduler must wait or evict older requests.
Good morning! How are you today? I am fine, thank you. What time is it? It is half past
seven in the evening. Where is the station? Turn left at the bridge, then walk straight on
for two hundred metres. Would you like some tea or coffee? Tea, please, with a little milk.
Numbers: zero, one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,
twenty, thirty, forty, fifty, one hundred, one thousand, 0 1 2 3 4 5 6 7 8 9 10 42 100 2048.
Once upon a time there was a small village by the sea. The people fished in the morning and
told stories at night. One winter a storm came and the boats stayed in the harbour for a
whole week, so the children learned to read, the old men mended nets, and the cooks made
soup from whatever was left in the cellar. When spring returned, the sea was calm and bright.
"""

_WORDS = (  # noqa: SIM905 (a readable block of words)
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact be have do say get make go know "
    "take see come think look want give use find tell ask seem feel try leave call good new "
    "first last long great little own other old right big high different small large next early "
    "young important few public bad same able to of in for on with at by from up about into over "
    "after the and a that I it not he as you this but his they her she or an will my one all would "
    "there their what so out if who which go me when can like no just him know people into year "
    "your some could them see other than then now look only come its over also back after use two "
    "how our work first well way even new want because any these give day most us server request "
    "token model cache memory queue node router engine stream latency throughput GPU batch prefill "
    "decode schedule balance load heartbeat lease drain health trace span metric window rate"
).split()


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Build (or reuse) the tiny model in ``out_dir`` and return its path.

    Idempotent: if ``out_dir`` already holds a complete tiny model it is returned untouched
    (whatever seed built it). Files are written to a temporary sibling folder and moved into
    place, so a crash never leaves a half-written model. Raises ``FileExistsError`` if
    ``out_dir`` is a non-empty folder that is not a tiny model (it is never deleted). Blocking
    (CPU-bound, ~1-3 s): call it via ``asyncio.to_thread`` from async code.
    """
    out = Path(out_dir)
    if is_complete_model(out):
        logger.debug("tiny model already present in %s", out)
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # Never delete what we did not write: a half-built tiny model cannot exist (builds
        # are moved into place whole), so this is someone else's folder.
        raise FileExistsError(f"{out} exists and is not a tiny model built by gpumesh")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_model(tmp, seed)
        tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is not a secret
        try:
            os.replace(tmp, out)  # atomic; replaces an empty folder
        except OSError:
            # Another process finished first: use its copy.
            if not is_complete_model(out):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model (seed=%d) in %s", seed, out)
    return out


def is_complete_model(path: str | Path) -> bool:
    """True if ``path`` holds every file of a tiny model build."""
    p = Path(path)
    return (p / _MARKER).is_file() and all((p / f).is_file() for f in TINY_MODEL_FILES)


def _corpus() -> list[str]:
    """The training corpus: the fixed text plus deterministic word salad for more merges."""
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    rng = random.Random(1234)  # fixed: the tokenizer does not depend on the weight seed
    # Pronounceable made-up words give BPE enough distinct pairs to reach the target vocab.
    onsets = ("", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr")
    vowels = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y")
    codas = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt")
    made_up = [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(rng.randint(1, 3)))
        for _ in range(1500)
    ]
    vocabulary = list(_WORDS) * 4 + made_up
    for _ in range(2500):
        n = rng.randint(6, 16)
        words = [rng.choice(vocabulary) for _ in range(n)]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice((".", ".", "?", "!", ",")))
    return lines


def _train_tokenizer() -> Any:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_TARGET,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_model(out: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    tok = _train_tokenizer()
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eot_id = tok.token_to_id(ENDOFTEXT)
    im_end_id = tok.token_to_id(IM_END)
    tok.save(str(out / "tokenizer.json"), pretty=False)

    added_tokens_decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in _SPECIAL_TOKENS
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added_tokens_decoder,
            "additional_special_tokens": [IM_START, IM_END],
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": _MAX_POSITIONS,
        },
    )
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": [IM_START, IM_END],
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
        },
    )

    # Written by hand (not Qwen2Config.to_json_file) so the bytes do not depend on the
    # installed transformers version.
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": eot_id,
        "eos_token_id": im_end_id,
        "hidden_act": "silu",
        "hidden_size": _HIDDEN,
        "head_dim": _HIDDEN // _HEADS,
        "initializer_range": 0.02,
        "intermediate_size": _INTERMEDIATE,
        "max_position_embeddings": _MAX_POSITIONS,
        "max_window_layers": _LAYERS,
        "num_attention_heads": _HEADS,
        "num_hidden_layers": _LAYERS,
        "num_key_value_heads": _KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": eot_id,
            "eos_token_id": [im_end_id, eot_id],
            "pad_token_id": eot_id,
            "do_sample": False,
        },
    )

    save_file(_random_weights(config, seed, torch), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / _MARKER).write_text(f"seed={seed}\n", encoding="utf-8")


def _random_weights(config: dict[str, Any], seed: int, torch: Any) -> dict[str, Any]:
    """Qwen2ForCausalLM tensors, named as transformers names them, from one seeded generator.

    Built directly rather than through ``Qwen2ForCausalLM(config)`` so the draw order (and so
    the bytes) is fixed here, not by a transformers version's init code.
    """
    gen = torch.Generator().manual_seed(seed)
    std = float(config["initializer_range"])
    h = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    v = int(config["vocab_size"])
    hd = int(config["head_dim"])
    q_out = int(config["num_attention_heads"]) * hd
    kv_out = int(config["num_key_value_heads"]) * hd

    def normal(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def ones(n: int) -> Any:
        return torch.ones(n, dtype=torch.float32)

    # Embeddings a little larger than the init default so logits are not near-uniform and
    # greedy decoding produces varied text rather than one token repeated.
    w: dict[str, Any] = {"model.embed_tokens.weight": normal(v, h) * 25.0}
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(h)
        w[p + "post_attention_layernorm.weight"] = ones(h)
        w[p + "self_attn.q_proj.weight"] = normal(q_out, h)
        w[p + "self_attn.q_proj.bias"] = normal(q_out)
        w[p + "self_attn.k_proj.weight"] = normal(kv_out, h)
        w[p + "self_attn.k_proj.bias"] = normal(kv_out)
        w[p + "self_attn.v_proj.weight"] = normal(kv_out, h)
        w[p + "self_attn.v_proj.bias"] = normal(kv_out)
        w[p + "self_attn.o_proj.weight"] = normal(h, q_out)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
    w["model.norm.weight"] = ones(h)
    w["lm_head.weight"] = normal(v, h) * 25.0
    # bfloat16: what vLLM's CPU backend computes in anyway (no load-time conversion).
    return {k: t.to(torch.bfloat16).contiguous() for k, t in w.items()}
