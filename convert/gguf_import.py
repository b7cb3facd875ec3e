"""GGUF -> Hugging Face checkpoint folder, which the normal convert pipeline then takes.

gguf-py reads and dequantizes the tensors; llama.cpp stores llama Q/K weights permuted for its
rotary layout, which is undone here; transformers' GGUF tokenizer converter (no torch needed)
rebuilds tokenizer.json; the chat template comes from the metadata."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mtpkit.convert.errors import ConvertError
from mtpkit.convert.writer import write_text
from mtpkit.loaders.findings import UserError
from mtpkit.loaders.gguf_header import HINT, GGUFInvalid, check_gguf

# GGUF tensor names -> Hugging Face names, per architecture (gguf-py's tensor_mapping, reversed).
GGUF_TO_HF: dict[str, dict[str, str]] = {
    "llama": {
        r"token_embd\.weight": "model.embed_tokens.weight",
        r"output_norm\.weight": "model.norm.weight",
        r"output\.weight": "lm_head.weight",
        r"blk\.(\d+)\.attn_norm\.weight": r"model.layers.\1.input_layernorm.weight",
        r"blk\.(\d+)\.ffn_norm\.weight": r"model.layers.\1.post_attention_layernorm.weight",
        r"blk\.(\d+)\.attn_q\.weight": r"model.layers.\1.self_attn.q_proj.weight",
        r"blk\.(\d+)\.attn_k\.weight": r"model.layers.\1.self_attn.k_proj.weight",
        r"blk\.(\d+)\.attn_v\.weight": r"model.layers.\1.self_attn.v_proj.weight",
        r"blk\.(\d+)\.attn_output\.weight": r"model.layers.\1.self_attn.o_proj.weight",
        r"blk\.(\d+)\.ffn_gate\.weight": r"model.layers.\1.mlp.gate_proj.weight",
        r"blk\.(\d+)\.ffn_up\.weight": r"model.layers.\1.mlp.up_proj.weight",
        r"blk\.(\d+)\.ffn_down\.weight": r"model.layers.\1.mlp.down_proj.weight",
    },
}
# Tensors llama.cpp permutes for its rotary layout, with the metadata key of their head count.
ROTARY_PERMUTED = {"llama": {"self_attn.q_proj.weight": "attention.head_count",
                             "self_attn.k_proj.weight": "attention.head_count_kv"}}
CONFIG_KEYS = {  # HF config key -> GGUF metadata key under the architecture's prefix
    "num_hidden_layers": "block_count", "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv", "rope_theta": "rope.freq_base",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "context_length",
}


class GGUFError(ValueError):
    pass


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(w, n_head): HF keeps rotary pairs as two halves."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return field.contents() if field is not None else None


def _hf_name(arch: str, name: str) -> str:
    for pattern, target in GGUF_TO_HF[arch].items():
        if re.fullmatch(pattern, name):
            return re.sub(pattern, target, name)
    raise GGUFError(f"tensor {name!r} has no known Hugging Face name for {arch}")


def _config(reader: Any, arch: str, vocab: int, tied: bool, dtype: str) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": arch, "architectures": ["LlamaForCausalLM"],
                              "vocab_size": vocab, "tie_word_embeddings": tied,
                              "torch_dtype": dtype, "hidden_act": "silu"}
    for hf_key, key in CONFIG_KEYS.items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None:
            config[hf_key] = value
    for hf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("pad_token_id", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[hf_key] = value
    name = _field(reader, "general.name")
    if name:
        config["_gguf_name"] = name
    return config


# tokenizer.ggml.* metadata -> the names transformers' GGUF tokenizer converters read.
TOKENIZER_KEYS = {
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                  "unk_token": "unk_token_id", "pad_token": "pad_token_id"}


def read_gguf_tokenizer(reader: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer_dict, tokenizer_config) from a GGUF's metadata, read with gguf-py: what
    transformers' own `get_gguf_tokenizer` returns, without the torch that its reader imports
    (5.17+) and in the releases that do not have it (before 5.17)."""
    tokenizer = {name: value for key, name in TOKENIZER_KEYS.items()
                 if (value := _field(reader, f"tokenizer.ggml.{key}")) is not None}
    config = {name: value for name, key in (("chat_template", "tokenizer.chat_template"),
                                            ("add_bos_token", "tokenizer.ggml.add_bos_token"),
                                            ("add_eos_token", "tokenizer.ggml.add_eos_token"))
              if (value := _field(reader, key)) is not None}
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to sentencepiece vocabularies
    for name, key in SPECIAL_TOKENS.items():
        token_id = tokenizer.get(key)
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return tokenizer, config


def gguf_tokenizer_converter() -> Callable[[str, dict[str, Any]], tuple[Any, dict]]:
    """transformers' `convert_gguf_tokenizer(architecture, tokenizer_dict)` from wherever the
    installed release keeps it: integrations.gguf.gguf_tokenizer_mapping from 5.18,
    integrations.ggml before (5.17 has the new module, but not this function in it)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        try:
            from transformers.integrations.ggml import convert_gguf_tokenizer
        except ImportError as err:
            import transformers

            raise GGUFError(f"transformers {transformers.__version__} has no GGUF tokenizer converter "
                            "(mtpkit supports transformers>=5.7,<6)") from err
    return convert_gguf_tokenizer


def _tokenizer(reader: Any, arch: str, out: Path) -> None:
    tokenizer_dict, tokenizer_config = read_gguf_tokenizer(reader)
    backend, _ = gguf_tokenizer_converter()(arch, tokenizer_dict)
    backend.save(str(out / "tokenizer.json"))
    template = tokenizer_config.pop("chat_template", None)
    if template:
        write_text(out / "chat_template.jinja", template)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **{k: v for k, v in tokenizer_config.items() if v is not None}}
    write_text(out / "tokenizer_config.json", json.dumps(config, indent=2))


def gguf_to_hf(path: Path, out: Path, dtype: str = "bfloat16",
               progress: Callable[[int], None] = lambda n: None) -> Path:
    """Write a Hugging Face checkpoint folder for the GGUF file `path` into `out`.

    The file is untrusted: its header is validated first (loaders/gguf_header.py), so gguf-py
    never loops over a forged count, and whatever still fails on its contents (a metadata value
    of the wrong type, a tensor missing) is ConvertError gguf.invalid, not a traceback."""
    try:
        check_gguf(path)
    except GGUFInvalid as exc:
        raise ConvertError(exc.code, str(exc), exc.hint) from None
    try:
        return _gguf_to_hf(path, out, dtype, progress)
    except (GGUFError, UserError):
        raise
    except NotImplementedError as exc:  # a tensor type gguf-py cannot dequantize
        raise GGUFError(f"{path.name}: {exc}") from None
    except Exception as exc:
        message = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConvertError("gguf.invalid", f"{path.name}: {type(exc).__name__}: {message}",
                           HINT) from None


def _gguf_to_hf(path: Path, out: Path, dtype: str, progress: Callable[[int], None]) -> Path:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_TO_HF:
        raise GGUFError(f"GGUF architecture {str(arch)[:80]!r} is not supported (supported: "
                        f"{', '.join(GGUF_TO_HF)})")
    target = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}[dtype]
    out.mkdir(parents=True, exist_ok=True)
    weights: dict[str, mx.array] = {}
    for tensor in reader.tensors:
        name = _hf_name(arch, tensor.name)
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        for suffix, heads_key in ROTARY_PERMUTED.get(arch, {}).items():
            if name.endswith(suffix):
                values = unpermute(values, int(_field(reader, f"{arch}.{heads_key}")))
        weights[name] = mx.array(values).astype(target)
        progress(tensor.n_bytes)
    vocab = weights["model.embed_tokens.weight"].shape[0]
    tied = "lm_head.weight" not in weights
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    write_text(out / "config.json", json.dumps(_config(reader, arch, vocab, tied, dtype), indent=2))
    _tokenizer(reader, arch, out)
    return out
