"""Index files: missing shards, paths that try to leave the bundle (also through a symlink),
disagreements with the shard headers; fuzzed index JSON never raises."""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtpkit import open_bundle
from mtpkit.loaders.config import read_config
from mtpkit.loaders.paths import inside
from mtpkit.loaders.weights import read_weights


def test_inside_rejects_escapes(tmp_path):
    root = tmp_path / "b"
    root.mkdir()
    (tmp_path / "secret").write_text("x")
    for bad in ("../secret", "/etc/passwd", "a/../../secret", "..\\secret", "", "x\x00y"):
        assert inside(root, bad) is None, bad
    os.symlink(tmp_path / "secret", root / "link.safetensors")
    assert inside(root, "link.safetensors") is None
    assert inside(root, "sub/ok.safetensors") == root / "sub/ok.safetensors"


def test_symlinked_shard_outside_bundle_is_not_read(bundle_copy, tmp_path):
    path = bundle_copy("llama", None)
    outside = tmp_path / "outside.safetensors"
    (path / "model.safetensors").rename(outside)
    os.symlink(outside, path / "model.safetensors")
    view = open_bundle(path)
    assert "index.path_escape" in {f.code for f in view.findings}
    assert view.weights.trunk == {}  # nothing was read through the link


def test_unindexed_shard_that_mlx_lm_would_glob(bundle_copy):
    path = bundle_copy("llama", None)
    (path / "model-extra.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    findings = open_bundle(path).findings
    assert any(f.code == "index.tensor_mismatch" and "mlx-lm loads" in f.message for f in findings)
    assert any(f.code == "index.tensor_mismatch" and "stored twice" in f.message for f in findings)


def test_sharded_bundle_is_read_through_its_index(bundle_copy):
    """Split the trunk into two shards by hand: doctor sees every tensor, no findings."""
    import mlx.core as mx

    path = bundle_copy("qwen3_5", None)
    arrays = mx.load(str(path / "model.safetensors"))
    names = sorted(arrays)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        mx.save_safetensors(str(path / shard), {k: arrays[k] for k in keys},
                            metadata={"format": "mlx"})
    (path / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    view = open_bundle(path)
    assert len(view.weights.trunk) == len(names)
    assert view.weights.trunk_files == sorted(shards)
    assert [f.code for f in view.findings] == ["mtp.missing"]


index_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=10), inner, max_size=3)),
    max_leaves=12)
shard_names = st.one_of(st.sampled_from(["model.safetensors", "../x", "/etc/passwd",
                                         "model-00009-of-00009.safetensors", "a/b/../../../c"]),
                        st.text(max_size=12))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.one_of(index_values, st.fixed_dictionaries(
    {"weight_map": st.dictionaries(st.text(max_size=10), shard_names, max_size=4)})))
def test_fuzzed_index_yields_findings_never_exceptions(built, tmp_path_factory, doc):
    import shutil

    path = tmp_path_factory.mktemp("fz") / "b"
    shutil.copytree(built("llama", None), path)
    (path / "model.safetensors.index.json").write_text(json.dumps(doc))
    weights = read_weights(path, read_config(path))
    assert all(f.code for f in weights.findings)


def test_fuzz_garbage_index_bytes(bundle_copy):
    path = bundle_copy("llama", None)
    (path / "model.safetensors.index.json").write_bytes(b"\xff\xfe{not json")
    assert "index.invalid" in {f.code for f in open_bundle(path).findings}


def test_symlinked_metadata_files_are_not_followed(bundle_copy, tmp_path):
    path = bundle_copy("llama", None)
    secret = tmp_path / "secret.json"
    secret.write_text('{"model_type": "llama", "hidden_size": 1}')
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        (path / name).unlink()
        os.symlink(secret, path / name)
    escapes = {f.location for f in open_bundle(path).findings if f.code == "index.path_escape"}
    assert escapes == {"config.json", "tokenizer.json", "chat_template.jinja"}
