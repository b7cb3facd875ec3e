"""Gemma 4's assistant drafter: the pair read and diagnosed, converted into one bundle, and its
forward checked against transformers' own Gemma4AssistantForCausalLM over a tiny gemma4_text
trunk's mlx-lm caches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from fixtures.gemma4 import (
    READS,
    assistant_config,
    attach,
    build_assistant,
    build_target,
    target_config,
)
from mtpkit.schemas import validate
from mtpkit.verify.doctor import report


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """variant -> (target checkpoint, assistant checkpoint), built once, read-only."""
    root = tmp_path_factory.mktemp("gemma4")
    return {v: (build_target(v, root / v), build_assistant(v, root / f"{v}-assistant"))
            for v in ("e2b", "31b")}


@pytest.fixture
def paired(pairs: dict[str, tuple[Path, Path]], tmp_path: Path):
    """A writable target with its assistant attached in `assistant/`."""
    def get(variant: str) -> Path:
        target, assistant = pairs[variant]
        out = shutil.copytree(target, tmp_path / variant)
        attach(out, assistant)
        return out
    return get


def _codes(doc: dict) -> set[str]:
    return {f["code"] for f in doc["findings"]} - {"mtp.absent"}


@pytest.mark.parametrize("variant", ["e2b", "31b"])
def test_a_healthy_pair_is_recognised(paired, variant):
    doc = report(paired(variant))
    validate(doc, "doctor_report")
    assert doc["summary"]["ok"] and not _codes(doc), doc["findings"]
    drafter = doc["bundle"]["drafter"]
    assert drafter["reads"] == READS[variant]  # resolved through the target's K/V sharing
    assert drafter["lm_head"] == ("centroids" if variant == "e2b" else "tied")


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(edit(tensors), str(folder / "model.safetensors"))


def _only(doc: dict, code: str) -> dict:
    assert _codes(doc) == {code}, doc["findings"]
    [hit] = [f for f in doc["findings"] if f["code"] == code]
    assert hit["hint"] and hit["location"] and doc["summary"]["exit_code"] == 1
    return hit


def test_hidden_size_of_another_target(paired):
    b = paired("e2b")
    _edit_config(b, lambda c: c.update(hidden_size=80))  # the target, not the assistant
    _edit_tensors(b, lambda t: t)
    doc = report(b)
    hits = [f for f in doc["findings"] if f["code"] == "drafter.mismatch"]
    assert any("backbone_hidden_size 64" in f["message"] and "80" in f["message"] for f in hits)


def test_a_target_without_the_kind_it_reads(paired):
    """A target with full-attention layers only: the assistant's sliding layers have nothing
    to read (mlx-lm builds and runs such a target; the pair cannot)."""
    b = paired("31b")
    _edit_config(b, lambda c: c.update(layer_types=["full_attention"] * 6))
    doc = report(b)
    hits = [f for f in doc["findings"] if f["code"] == "drafter.mismatch"]
    assert any("sliding_attention" in f["message"] and "keeps no K/V" in f["message"]
               for f in hits), doc["findings"]


def test_head_size_that_does_not_fit(paired):
    b = paired("31b")
    _edit_config(b, lambda c: c.update(global_head_dim=64))
    doc = report(b)
    hits = [f for f in doc["findings"] if f["code"] == "drafter.mismatch"]
    assert hits and "queries are 32 wide, the target's keys 64" in hits[0]["message"]


def test_vocabulary_of_another_tokenizer(paired):
    b = paired("31b")
    _edit_config(b / "assistant", lambda c: c["text_config"].update(vocab_size=1024))
    _edit_tensors(b / "assistant", lambda t: {**t, "model.embed_tokens.weight": __import__(
        "numpy").zeros((1024, 32), "float32")})
    hit = _only(report(b), "tokenizer.vocab_mismatch")
    assert "1024" in hit["message"] and "512" in hit["message"]


def test_own_tokenizer_mapping_differently(paired):
    b = paired("31b")
    tok = json.loads((b / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, z = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[z] = vocab[z], vocab[a]
    (b / "assistant" / "tokenizer.json").write_text(json.dumps(tok))
    _only(report(b), "tokenizer.vocab_mismatch")


@pytest.mark.parametrize(("damage", "code", "where"), [
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.3.self_attn.q_norm.weight"},
     "weights.missing", "assistant:model.layers.3.self_attn.q_norm.weight"),
    (lambda t: {**t, "pre_projection.weight": t["pre_projection.weight"][:, :48]},
     "weights.shape_mismatch", "assistant:pre_projection.weight"),
    (lambda t: {**t, "model.layers.0.self_attn.k_proj.weight": t["post_projection.weight"]},
     "weights.unexpected", "assistant:model.layers.0.self_attn.k_proj.weight"),
    (lambda t: {**t, "masked_embedding.token_ordering":
                t["masked_embedding.token_ordering"].astype("float32")},
     "weights.dtype_mismatch", "assistant:masked_embedding.token_ordering"),
])
def test_assistant_tensors_named_and_shaped(paired, damage, code, where):
    b = paired("e2b")
    _edit_tensors(b / "assistant", damage)
    assert _only(report(b), code)["location"] == where


@pytest.mark.parametrize(("edit", "words"), [
    (lambda c: c.update(model_type="gemma4_text"), "not 'gemma4_assistant'"),
    (lambda c: c["text_config"].update(num_kv_shared_layers=2), "num_kv_shared_layers is 2"),
    (lambda c: c["text_config"].update(enable_moe_block=True), "enable_moe_block"),
    (lambda c: c.update(num_centroids=15), "divisible by num_centroids"),
])
def test_not_an_assistant(paired, edit, words):
    b = paired("e2b")
    _edit_config(b / "assistant", edit)
    assert words in _only(report(b), "drafter.invalid")["message"]


def test_manifest_naming_a_missing_drafter(paired):
    b = paired("31b")
    shutil.move(b / "assistant", b / "elsewhere")
    from mtpkit.loaders.assistant import read_drafter
    rep = read_drafter(b, target_config("31b"), {"drafter": {"path": "gone"}})
    assert [f.code for f in rep.findings] == ["drafter.invalid"]
    assert read_drafter(b, target_config("31b"), {"drafter": {"path": "elsewhere"}}).spec


def test_no_assistant_no_drafter(pairs):
    doc = report(pairs["31b"][0])
    assert doc["bundle"]["drafter"] is None and doc["summary"]["ok"]


def test_assistant_config_keys_are_transformers(pairs):
    """The fixture's config is one transformers' own Gemma4AssistantConfig accepts as valid."""
    from transformers import Gemma4AssistantConfig

    for variant in ("e2b", "31b"):
        config = Gemma4AssistantConfig(**assistant_config(variant))
        config.validate_architecture()
        assert config.text_config.num_kv_shared_layers == 4


@pytest.mark.parametrize("variant", ["e2b", "31b"])
def test_convert_with_drafter(pairs, tmp_path, variant):
    """convert TARGET --drafter ASSISTANT: one bundle; the trunk converted at its root (stock
    mlx-lm loads it), the assistant copied into assistant/ byte for byte, the manifest naming
    it with the layers it reads; doctor finds the pair healthy."""
    from mlx_lm.utils import load_model

    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.trunk import QuantOptions

    target, assistant = pairs[variant]
    out = tmp_path / "out"
    result = convert(str(target), out, ConvertOptions(quant=QuantOptions(quantize=False),
                                                      drafter=str(assistant)))
    manifest = json.loads((out / "mtpkit.json").read_text())
    validate(manifest, "manifest")
    assert manifest["drafter"]["path"] == "assistant"
    assert manifest["drafter"]["reads"] == READS[variant]
    assert manifest["drafter"]["weights"] == "as_given"
    roles = {f["path"]: f["role"] for f in manifest["files"]}
    assert roles["assistant/model.safetensors"] == roles["assistant/config.json"] == "drafter"
    for name in ("config.json", "model.safetensors"):
        assert (out / "assistant" / name).read_bytes() == (assistant / name).read_bytes()
    assert report(out)["summary"]["ok"] and not [f for f in result.findings
                                                 if f.severity == "error"]
    load_model(out)  # the trunk alone, as stock mlx-lm reads the bundle's root
    again = tmp_path / "again"  # an existing bundle converted again keeps its drafter
    convert(str(out), again, ConvertOptions(quant=QuantOptions(quantize=False)))
    assert json.loads((again / "mtpkit.json").read_text())["drafter"] == manifest["drafter"]
    from mtpkit.convert.repair import repair

    (out / "chat_template.jinja").unlink()  # damage doctor --fix repairs; the drafter stays
    repair(out, tmp_path / "fixed")
    fixed = json.loads((tmp_path / "fixed" / "mtpkit.json").read_text())
    assert fixed["drafter"] == manifest["drafter"]
    assert (tmp_path / "fixed" / "assistant" / "model.safetensors").read_bytes() == (
        assistant / "model.safetensors").read_bytes()


@pytest.mark.parametrize(("edit", "code"), [
    (lambda c: c.update(backbone_hidden_size=96), "drafter.mismatch"),
    (lambda c: c.update(model_type="llama"), "drafter.invalid"),
])
def test_convert_refuses_a_drafter_that_does_not_fit(pairs, tmp_path, edit, code):
    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.errors import ConvertError
    from mtpkit.convert.trunk import QuantOptions

    target, _ = pairs["31b"]
    config = assistant_config("31b")
    edit(config)  # an assistant trained for another target: config and tensors agree
    bad = build_assistant("31b", tmp_path / "bad", config=config)
    with pytest.raises(ConvertError) as err:
        convert(str(target), tmp_path / "out", ConvertOptions(
            quant=QuantOptions(quantize=False), drafter=str(bad)))
    assert err.value.code == code and not (tmp_path / "out").exists()
    with pytest.raises(ConvertError) as err:
        convert(str(target), tmp_path / "out", ConvertOptions(
            quant=QuantOptions(quantize=False), drafter=str(tmp_path / "nowhere")))
    assert err.value.code == "drafter.invalid"


def test_the_cli_converts_a_pair_and_refuses_a_misfit_in_one_line(pairs, tmp_path):
    """`mtpkit convert TARGET OUT --drafter ASSISTANT`: the same bundle as the Python API's;
    an assistant for another target is one line with its code, exit 2, no output."""
    from click.testing import CliRunner

    from mtpkit.cli import main

    target, assistant = pairs["31b"]
    ok = CliRunner().invoke(main, ["convert", str(target), str(tmp_path / "out"),
                                   "--drafter", str(assistant)])
    assert ok.exit_code == 0, ok.output
    assert json.loads((tmp_path / "out" / "mtpkit.json").read_text())["drafter"]["path"] == \
        "assistant"
    config = assistant_config("31b")
    config.update(backbone_hidden_size=96)
    bad = build_assistant("31b", tmp_path / "bad", config=config)
    no = CliRunner().invoke(main, ["convert", str(target), str(tmp_path / "no"),
                                   "--drafter", str(bad)])
    errors = [line for line in no.output.splitlines() if line.startswith("error")]
    assert no.exit_code == 2 and len(errors) == 1 and "[drafter.mismatch]" in errors[0], no.output
    assert not (tmp_path / "no").exists()


def _reference(assistant: Path, variant: str):
    """transformers' own Gemma4AssistantForCausalLM (float32, eager attention) with the
    checkpoint's weights: the independent reference for the MLX module."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    config = Gemma4AssistantConfig(**assistant_config(variant))
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    ref = Gemma4AssistantForCausalLM(config).float().eval()
    state = {k: torch.from_numpy(v) for k, v in load_file(str(assistant / "model.safetensors"))
             .items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    ref.lm_head.weight = ref.model.embed_tokens.weight  # tied, as the config says
    return ref


def _reference_kv(caches, variant: str):
    """The K/V transformers' assistant is given: the fixture's hand-written layer per kind,
    the sliding one's whole buffer in position order (its own mask picks the window)."""
    import mlx.core as mx
    import numpy as np
    import torch

    out = {}
    for kind, index in READS[variant].items():
        cache = caches[index]
        if kind == "sliding_attention":
            keys, values = (cache._temporal_order(a) for a in (cache.keys, cache.values))
        else:
            keys, values = (a[..., :cache.offset, :] for a in (cache.keys, cache.values))
        out[kind] = tuple(torch.from_numpy(np.array(a.astype(mx.float32))) for a in (keys, values))
    return out


@pytest.mark.parametrize("variant", ["e2b", "31b"])
def test_forward_matches_transformers(pairs, variant):
    """A tiny gemma4_text trunk (mlx-lm) prefills 12 tokens (its sliding caches past their
    8-token window, in order), then decodes 3 alone (rotating in place): at both states the
    assistant's K greedy drafts, each step's logits and its next hidden equal transformers'
    Gemma4AssistantForCausalLM fed the same K/V, position and inputs."""
    import mlx.core as mx
    import numpy as np
    import torch
    from mlx_lm.utils import load_model

    from mtpkit.decoder.drafters.assistant import AssistantDrafter, load_assistant
    from mtpkit.decoder.model.trunk import Trunk

    target, assistant = pairs[variant]
    model, _ = load_model(target)
    trunk = Trunk(model)  # the post-norm hidden, as transformers feeds it
    caches = trunk.make_cache()
    drafter = AssistantDrafter.pair(load_assistant(assistant), model, target_config(variant))
    assert drafter.reads == READS[variant]
    ref = _reference(assistant, variant)
    table = np.array(model.model.embed_tokens.weight) * np.sqrt(target_config(variant)[
        "hidden_size"])
    prompt = mx.array([[5, 17, 40, 3, 99, 250, 7, 7, 64, 301, 12, 8]])
    hidden, _ = trunk(prompt, caches)
    for step, last in enumerate((77, 5)):
        if step:  # three tokens decoded alone: the sliding caches rotate in place
            for token in (21, 300, 4):
                hidden, _ = trunk(mx.array([[token]]), caches)
        h = hidden[:, -1:]
        tokens, q = drafter.draft(caches, h, last, 3)
        assert q is None
        kv, position = _reference_kv(caches, variant), caches[0].offset
        prev, tok = torch.from_numpy(np.array(h.astype(mx.float32))), last
        with torch.no_grad():
            for k in range(3):
                embeds = torch.from_numpy(table[[tok]][None].astype(np.float32))
                out = ref(inputs_embeds=torch.cat([embeds, prev], dim=-1),
                          position_ids=torch.tensor([[position]]), shared_kv_states=kv)
                mine_logits, mine_h = drafter.assistant.step(
                    mx.concatenate([drafter.embed(mx.array([[tok]])), mx.array(prev.numpy())],
                                   axis=-1), _shared(drafter, caches), position)
                np.testing.assert_allclose(np.array(mine_logits), out.logits.numpy(),
                                           rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(np.array(mine_h), out.last_hidden_state.numpy(),
                                           rtol=1e-4, atol=1e-4)
                tok, prev = int(out.logits[0, -1].argmax()), out.last_hidden_state
                assert int(tokens[0, k]) == tok


def _shared(drafter, caches):
    from mtpkit.decoder.drafters.assistant import shared_kv

    return shared_kv(caches, drafter.reads, drafter.assistant.spec.sliding_window)[0]


def test_proposer_sampled_drafts_carry_their_law(pairs):
    """The Proposer at temperature 0.7, top-k 50: a Draft after the last committed token whose q
    rows are the processed laws (decoder/sampling.py's, drafter=True) of transformers' logits
    along the drafted chain, each draft drawn from its row by that row's uniforms; greedy, the
    argmax chain; nothing to draft before the trunk has a hidden."""
    from dataclasses import dataclass, field
    from typing import Any

    import mlx.core as mx
    import numpy as np
    import torch
    from mlx_lm.utils import load_model

    from mtpkit.decoder.drafters.assistant import AssistantDrafter, AssistantProposer, load_assistant
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.options import SamplingParams, Source
    from mtpkit.decoder.sampling import Candidates, candidates

    variant = "e2b"
    target, assistant = pairs[variant]
    model, _ = load_model(target)
    trunk = Trunk(model)  # the post-norm hidden, as transformers feeds it

    @dataclass
    class Feed:
        params: SamplingParams
        cache: list[Any] = field(default_factory=trunk.make_cache)
        last: int = 33
        assistant_hidden: mx.array | None = None

        def round_noise(self, head_steps: int, drafts: int = 0):
            if self.params.greedy:
                return None, None
            mx.random.seed(3)
            return mx.random.uniform(shape=(head_steps, 50)), mx.zeros((head_steps + 51,))

    drafter = AssistantDrafter.pair(load_assistant(assistant), model, target_config(variant))
    params = SamplingParams(temperature=0.7, top_k=50)
    feed = Feed(params)
    proposer = AssistantProposer(drafter, feed)
    assert proposer.propose(3) is None  # no prompt yet
    hidden, _ = trunk(mx.array([[5, 17, 40, 3, 99, 250, 7, 7, 64, 301, 12, 8]]), feed.cache)
    feed.assistant_hidden = hidden[:, -1:]
    draft = proposer.propose(3)
    assert draft.source is Source.MODEL and draft.depth == 3 and int(draft.tokens[0, 0]) == 33
    draws, _ = feed.round_noise(3)
    ref = _reference(assistant, variant)
    table = (np.array(model.model.embed_tokens.weight) * np.sqrt(64)).astype(np.float32)
    kv, position = _reference_kv(feed.cache, variant), feed.cache[0].offset
    prev, tok = torch.from_numpy(np.array(feed.assistant_hidden)), 33
    for k in range(3):
        with torch.no_grad():
            out = ref(inputs_embeds=torch.cat([torch.from_numpy(table[[tok]][None]), prev], -1),
                      position_ids=torch.tensor([[position]]), shared_kv_states=kv)
        law = candidates(mx.array(out.logits[0, -1:].numpy()), params, drafter=True)
        row = draft.q[k:k + 1]
        np.testing.assert_array_equal(np.array(row.ids), np.array(law.ids))
        np.testing.assert_allclose(np.array(row.probs), np.array(law.probs), atol=1e-5)
        tok = int(draft.tokens[0, k + 1])
        assert tok == int(Candidates(row.probs, row.ids).draw(draws[k:k + 1])[0])
        prev = out.last_hidden_state
    feed.params = SamplingParams()
    greedy = proposer.propose(2)
    assert greedy.q is None and greedy.rule is None
    tokens, _ = drafter.draft(feed.cache, feed.assistant_hidden, 33, 2)
    assert greedy.tokens[0, 1:].tolist() == tokens[0].tolist()


def test_convert_a_pair_in_mtplx_layout(pairs, tmp_path):
    """SRC holding target/ and assistant/ (and no config.json of its own) converts as the
    target with that assistant as its drafter."""
    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.trunk import QuantOptions

    target, assistant = pairs["e2b"]
    pair = tmp_path / "pair"
    shutil.copytree(target, pair / "target")
    shutil.copytree(assistant, pair / "assistant")
    convert(str(pair), tmp_path / "out", ConvertOptions(quant=QuantOptions(quantize=False)))
    manifest = json.loads((tmp_path / "out" / "mtpkit.json").read_text())
    assert manifest["drafter"]["reads"] == READS["e2b"]
    assert report(tmp_path / "out")["summary"]["ok"]


@pytest.mark.parametrize("variant", ["e2b", "31b"])
def test_layers_read_are_those_transformers_stores(variant):
    """The target layer whose K/V each kind of assistant layer reads is the one transformers'
    Gemma4TextConfig marks "store" (the last K/V-owning layer of that kind), for both the
    K/V-shared E2B-like target and the 31B-like one."""
    from transformers import Gemma4TextConfig

    from mtpkit.loaders.assistant import target_kv

    config = target_config(variant)
    modes = Gemma4TextConfig(**config).kv_sharing_modes
    stores = {config["layer_types"][i]: i for i, m in enumerate(modes) if m == "store"}
    assert stores == READS[variant] == target_kv(config).layer
    # the published multimodal checkpoints nest the same text config
    nested = {"model_type": "gemma4", "text_config": {**config, "model_type": "gemma4_text"}}
    assert target_kv(nested).layer == READS[variant]
