"""--draft-model on every entry: generate, serve (and its requests' "mtp_draft": "model"),
verify-run and the Python API draft with it and refuse the same things with the same code in
one line (another vocabulary: draft.vocab_mismatch; an endpoint, or "model" with none loaded:
options.invalid). The decoding itself is tests/test_draft_model.py's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_draft_option import _post

import fixtures.numerics  # noqa: F401  (float32 runs in float32 on GPU backends too)
import mtpkit
from fixtures.fake_servers import in_thread
from fixtures.tokenizer import write_tokenizer
from mtpkit.cli import main
from mtpkit.loaders.findings import UserError
from mtpkit.schemas import validate
from mtpkit.serve.server import Server
from mtpkit.serve.service import Service


@pytest.fixture(scope="module")
def pair(built: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, Path, Path]:
    """(target, a 3-bit copy of it as the draft model, a draft of another vocabulary)."""
    target, draft = built("llama"), built("llama", bits=3, group_size=32)
    other = tmp_path_factory.mktemp("other") / "other"
    shutil.copytree(built("llama", seed=1), other)
    write_tokenizer(other, 300, thinking=False)
    return target, draft, other


def _generate(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["generate", *args])
    return result.exit_code, result.stdout, result.stderr


def test_generate_drafts_with_the_draft_model_and_says_so(pair) -> None:
    target, draft, _ = pair
    common = [str(target), "Hello", "--raw", "--max-tokens", "24", "--dtype", "float32", "--json"]
    code, out, err = _generate(*common, "--depth", "0")
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = _generate(*common, "--depth", "3", "--draft-model", str(draft))
    assert code == 0, err
    doc = json.loads(out)
    validate(doc, "generation")
    assert doc["tokens"] == plain["tokens"], "greedy drafts from the model answer like plain"
    model = doc["stats"]["sources"]["model"]
    assert model["rounds"] > 0 and sum(model["proposed"]) > 0
    assert set(doc["stats"]["sources"]) == {"model"}, "the draft model drafts by default"


@pytest.mark.parametrize("entry", ["generate", "serve", "verify-run"])
def test_every_entry_refuses_another_vocabulary_in_one_line(pair, entry: str) -> None:
    target, _, other = pair
    args = {"generate": ["generate", str(target), "Hi", "--raw"],
            "serve": ["serve", str(target), "--port", "0"],
            "verify-run": ["verify-run", str(target), "--runs", "1"]}[entry]
    result = CliRunner().invoke(main, [*args, "--draft-model", str(other)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error [draft.vocab_mismatch]"), \
        result.output
    assert "Traceback" not in result.output
    with pytest.raises(UserError) as err:  # the Python API says the same
        mtpkit.load(target, dtype="float32", draft_model=other)
    assert err.value.code == "draft.vocab_mismatch"


def test_model_drafts_without_a_draft_model_are_refused_everywhere(pair) -> None:
    target, _, _ = pair
    code, _, err = _generate(str(target), "Hi", "--raw", "--depth", "2", "--draft", "model")
    assert code == 2 and "error [options.invalid]" in err and "--draft-model" in err, err
    result = CliRunner().invoke(main, ["verify-run", "--endpoint", "http://127.0.0.1:9/v1",
                                       "--draft-model", str(target)])
    assert result.exit_code == 2 and "error [options.invalid]" in result.output, result.output
    runner = mtpkit.load(target, dtype="float32")
    with in_thread(Server(Service(runner, "m", 2, 64), "127.0.0.1", 0, None)) as url:
        status, doc = _post(url, {"prompt": "Hi", "max_tokens": 4, "mtp_draft": "model"})
    assert (status, doc["error"]["param"]) == (400, "mtp_draft"), doc
    assert doc["error"]["message"].startswith("options.invalid: mtp_draft \"model\"")


def test_serve_drafts_with_the_draft_model_alone_and_batched(pair) -> None:
    """Four requests at once through the batch, each answering as plain decoding does."""
    import threading

    target, draft, _ = pair
    runner = mtpkit.load(target, dtype="float32", draft_model=draft)
    prompts = ["Hello there", "One two three", "abc abc abc", "The end"]
    with in_thread(Server(Service(runner, "m", 3, 64, max_batch=4), "127.0.0.1", 0,
                          None)) as url:
        plain = [_post(url, {"prompt": p, "max_tokens": 16, "mtp_depth": 0})[1] for p in prompts]
        answers: list[dict] = [{}] * len(prompts)

        def ask(i: int) -> None:
            answers[i] = _post(url, {"prompt": prompts[i], "max_tokens": 16})[1]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for p, a in zip(plain, answers, strict=True):
        assert a["choices"][0]["text"] == p["choices"][0]["text"]
        assert a["usage"]["mtp"]["draft"] == "model"
        assert set(a["usage"]["mtp"]["sources"]) == {"model"}
