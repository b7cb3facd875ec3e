"""The model card (README.md): mlx-community style front matter plus an MTP section."""

from __future__ import annotations

from typing import Any

from mtpkit import __version__


def _front_matter(meta: dict[str, Any]) -> str:
    lines = ["---"]
    for key, value in meta.items():
        if isinstance(value, list):
            lines.append(f"{key}:")
            lines += [f"- {v}" for v in value]
        elif value is not None:
            lines.append(f"{key}: {value}")
    return "\n".join([*lines, "---", ""])


def model_card(name: str, base_model: str | None, manifest: dict[str, Any],
               command: str) -> str:
    mtp, q = manifest["mtp"], manifest["quantization"]
    trunk_q = q["trunk"]["default"]
    side_q = q["sidecar"]["default"]
    tags = ["mlx", "mtp", "speculative-decoding", manifest["family"]]
    meta = {"library_name": "mlx", "base_model": base_model, "tags": tags,
            "pipeline_tag": "text-generation"}
    quant_line = (f"{trunk_q['mode']} {trunk_q['bits']}-bit, group size {trunk_q['group_size']}"
                  f" ({q['trunk']['quantized_modules']} modules; "
                  f"{len(q['trunk']['modules'])} with their own settings)"
                  if trunk_q else "not quantized")
    parts = [_front_matter(meta), f"# {name}", "",
             f"This model was converted to MLX format from "
             f"{'`' + base_model + '`' if base_model else 'a local checkpoint'} "
             f"with mtpkit {__version__}:", "", "```bash", command, "```", "",
             f"Trunk quantization: {quant_line}.", ""]
    if mtp["present"]:
        side = (f"{side_q['mode']} {side_q['bits']}-bit, group size {side_q['group_size']}"
                if side_q else "full precision")
        parts += [
            "## Multi-token prediction (MTP)", "",
            f"The MTP head ships as a sidecar, `{mtp['file']}`, with canonical `mtp.` tensor "
            f"names ({mtp['layers']} layer(s), source family {mtp['source_family']}); the trunk "
            "shards contain no MTP tensors, so stock mlx-lm loads the trunk as is.", "",
            f"- sidecar policy `{mtp['policy']}`: {side}",
            f"- norms: {mtp['norm_encoding']} (encoded like the trunk's)",
            f"- concat order: {mtp['concat_order']}; trunk hidden fed after the final norm",
            "- quantization is recorded in `config.json` (`quantization`, "
            "`mtplx_mtp_quantization`) and in `mtpkit.json`, measured from the tensors", "",
            "Check the bundle with `mtpkit doctor .`; MTP runtimes that read "
            "`mtplx_mtp_quantization` (mtpkit, MTPLX) use the sidecar for speculative decoding.",
            ""]
    parts += ["## Use with mlx-lm", "", "```python", "from mlx_lm import load, generate", "",
              'model, tokenizer = load("' + name + '")',
              'print(generate(model, tokenizer, prompt="Hello", max_tokens=64))', "```", ""]
    return "\n".join(parts)
