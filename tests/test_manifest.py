"""The manifest: built from measurements, valid against its schema, and checked by doctor."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fixtures.factory import Sidecar
from mtpkit import open_bundle
from mtpkit.convert.manifest import build_manifest
from mtpkit.schemas import validate
from mtpkit.verify.doctor import report


def _stamp(path):
    doc = build_manifest(open_bundle(path), source={"kind": "hf", "path": "/src"})
    (path / "mtpkit.json").write_text(json.dumps(doc))
    return doc


def test_manifest_is_true_to_the_tensors(bundle_copy):
    path = bundle_copy("qwen3_5_moe", Sidecar(policy="layers", bits=8, group_size=32))
    doc = _stamp(path)
    validate(doc, "manifest")
    q = doc["quantization"]
    assert q["trunk"]["default"] == {"mode": "affine", "bits": 4, "group_size": 64}
    assert set(q["trunk"]["modules"]) and all(m["bits"] == 8 for m in q["trunk"]["modules"].values())
    assert q["sidecar"]["default"] == {"mode": "affine", "bits": 8, "group_size": 32}
    assert doc["mtp"]["policy"] == "layers" and doc["mtp"]["file"] == "mtp.safetensors"
    roles = {f["path"]: f["role"] for f in doc["files"]}
    assert roles["model.safetensors"] == "trunk" and roles["mtp.safetensors"] == "sidecar"
    assert report(path, deep=True)["summary"]["ok"]


def test_deep_catches_same_size_tampering(bundle_copy):
    path = bundle_copy("qwen3_5", Sidecar())
    _stamp(path)
    template = path / "chat_template.jinja"
    template.write_text(template.read_text().replace("assistant", "assistent"))
    assert report(path)["summary"]["ok"]  # sizes still match: only --deep can tell
    deep = report(path, deep=True)
    assert [(f["code"], f["location"]) for f in deep["findings"]] == [
        ("manifest.stale", "chat_template.jinja")]


def test_schema_rejects_escaping_paths(bundle_copy):
    path = bundle_copy("llama", None)
    doc = _stamp(path)
    doc["files"][0]["path"] = "../outside"
    with pytest.raises(jsonschema.ValidationError):
        validate(doc, "manifest")
