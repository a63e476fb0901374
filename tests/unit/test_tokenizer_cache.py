"""vime.data.tokenizer: a checkpoint's tokenizer is AutoTokenizer's, built directly from the recorded class once a
process has recorded it, and AutoTokenizer's again whenever the record does not hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from vime.data import tokenizer as tokenizer_module
from vime.data.tokenizer import fingerprint, load_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "vime" / "tokenizers"


@pytest.fixture
def checkpoint(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path / "model"), hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64)


def _auto_tokenizer_refused(monkeypatch):
    """AutoTokenizer raising: a load that still succeeds did not use it."""
    import transformers

    def refuse(*_args, **_kwargs):
        raise AssertionError("AutoTokenizer was used")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def test_the_second_load_builds_the_recorded_class_and_the_same_tokenizer(cache, checkpoint, monkeypatch):
    from transformers import AutoTokenizer

    first = load_tokenizer(checkpoint)
    (record,) = [json.loads(p.read_text()) for p in cache.iterdir()]
    assert record["class"] == type(AutoTokenizer.from_pretrained(checkpoint)).__qualname__
    _auto_tokenizer_refused(monkeypatch)
    second = load_tokenizer(checkpoint)
    assert type(second) is type(first) and fingerprint(second) == fingerprint(first)
    assert second.encode("371=482") == first.encode("371=482") and second.decode(first.encode("12=3")) == "12=3"


def test_a_process_loading_a_recorded_tokenizer_does_not_import_torch(cache, checkpoint):
    load_tokenizer(checkpoint)
    code = (
        "import sys; from vime.data.tokenizer import load_tokenizer; "
        f"load_tokenizer({checkpoint!r}); print('torch' in sys.modules)"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_record_that_does_not_hold_falls_back_to_auto_tokenizer_and_is_rewritten(cache, checkpoint):
    reference = fingerprint(load_tokenizer(checkpoint))
    (path,) = cache.iterdir()
    for wrong in (
        {"fingerprint": "0" * 64},  # the recorded class builds another tokenizer
        {"class": "NoSuchTokenizer"},  # it is gone from transformers
        {"module": "not_transformers.tokenization", "class": "Tokenizer"},  # not transformers' own code
    ):
        path.write_text(json.dumps({**json.loads(path.read_text()), **wrong}))
        assert fingerprint(load_tokenizer(checkpoint)) == reference
        assert json.loads(path.read_text())["fingerprint"] == reference  # recorded again from AutoTokenizer
    path.write_text("{not json")
    assert fingerprint(load_tokenizer(checkpoint)) == reference


def test_the_record_is_keyed_by_the_tokenizer_files(cache, checkpoint):
    load_tokenizer(checkpoint)
    config = os.path.join(checkpoint, "tokenizer_config.json")
    with open(config) as f:
        settings = json.load(f)
    settings["model_max_length"] = 32
    with open(config, "w") as f:
        json.dump(settings, f)
    assert load_tokenizer(checkpoint).model_max_length == 32
    assert len(list(cache.iterdir())) == 2


def test_a_name_that_is_not_a_folder_is_not_recorded(cache, monkeypatch):
    assert tokenizer_module._record_path("organisation/model-on-the-hub") is None
