"""--update-weight-transport nccl: what can be checked without a GPU (the broadcast itself is
checked by tests/gpu/check_nccl_weights.py on a machine with two GPUs)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re

import pytest
import torch

from vime.config import ConfigError, parse_train_args
from vime.config.weight_sync import WeightSyncConfig
from vime.weights import nccl


@pytest.fixture
def args(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return [
        "--hf-checkpoint",
        str(tmp_path),
        "--prompt-data",
        "data.jsonl",
        "--rm-type",
        "exact_match",
        "--run-dir",
        str(tmp_path / "run"),
    ]


def test_metadata_round_trip_in_parameter_order():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    metas = nccl.tensor_metadata(model.named_parameters())
    assert [(m.name, m.dtype, m.shape) for m in metas] == [
        ("0.weight", "bfloat16", [4, 3]),
        ("0.bias", "bfloat16", [4]),
        ("1.weight", "bfloat16", [4]),
        ("1.bias", "bfloat16", [4]),
    ]
    text = nccl.encode_metadata(metas)
    assert isinstance(text, str) and nccl.decode_metadata(text) == metas
    assert nccl.torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown torch dtype"):
        nccl.torch_dtype("Tensor")
    with pytest.raises(ValueError, match="appears twice"):
        nccl.tensor_metadata([("a", torch.zeros(1)), ("a", torch.zeros(1))])


def test_a_tensor_that_differs_from_the_metadata_is_refused_before_sending():
    meta = nccl.TensorMeta("w", "float32", [2, 2])
    nccl.check_tensor(meta, "w", torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"tensor w \(float32, \[4\]\) differs"):
        nccl.check_tensor(meta, "w", torch.zeros(4))
    with pytest.raises(ValueError, match="differs"):
        nccl.check_tensor(meta, "w", torch.zeros(2, 2, dtype=torch.float16))


def test_group_layout_trainer_first_then_each_engines_workers():
    assert nccl.group_layout([1]) == (2, [1])
    assert nccl.group_layout([1, 2, 4]) == (8, [1, 2, 4])
    with pytest.raises(ValueError):
        nccl.group_layout([0])


def test_tensor_checksums_see_every_bit():
    a = torch.randn(5, 3).to(torch.bfloat16)
    b = a.clone()
    assert nccl.tensor_sha256(a) == nccl.tensor_sha256(b)
    b.view(torch.int16)[2, 1] ^= 1
    assert nccl.tensor_sha256(a) != nccl.tensor_sha256(b)
    assert nccl.tensor_sha256(a.t()) == nccl.tensor_sha256(a.t().contiguous())


def test_nccl_without_gpus_is_refused_naming_the_flag(monkeypatch, args):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^--update-weight-transport: 'nccl' needs CUDA GPUs"):
        parse_train_args(args + ["--update-weight-transport", "nccl"])
    with pytest.raises(RuntimeError, match="--update-weight-transport nccl: the trainer process sees no CUDA"):
        nccl.NcclWeightSender().open("127.0.0.1", 1, 2)


def test_nccl_with_gpus_passes_and_adds_the_worker_extension(monkeypatch, args):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    settings = parse_train_args(args + ["--update-weight-transport", "nccl"])
    engine_args = settings.weights.engine_vllm_args({"max-model-len": "64"})
    assert engine_args == {"max-model-len": "64", "worker-extension-cls": "vime.weights.nccl.NcclWeightReceiver"}
    with pytest.raises(ConfigError, match="^--vllm-worker-extension-cls"):
        settings.weights.engine_vllm_args({"worker-extension-cls": "my.Extension"})
    with pytest.raises(ConfigError, match="^--update-weight-mode: 'delta' applies to the disk transport"):
        parse_train_args(args + ["--update-weight-transport", "nccl", "--update-weight-mode", "delta"])
    with pytest.raises(ConfigError, match="^--update-weight-mode: 'auto' applies to the disk transport"):
        parse_train_args(args + ["--update-weight-transport", "nccl", "--update-weight-mode", "auto"])
    assert WeightSyncConfig().engine_vllm_args({"a": None}) == {"a": None}  # disk: nothing added


def test_delta_mode_and_full_interval_flags(args):
    settings = parse_train_args(args + ["--update-weight-mode", "delta", "--update-weight-full-interval", "5"])
    assert (settings.weights.update_weight_mode, settings.weights.update_weight_full_interval) == ("delta", 5)
    assert parse_train_args(args + ["--update-weight-mode", "auto"]).weights.update_weight_mode == "auto"
    with pytest.raises(ConfigError, match="^--update-weight-full-interval: must be >= 1"):
        parse_train_args(args + ["--update-weight-full-interval", "0"])


def test_worker_extension_resolves_and_does_not_collide_with_vllm_workers():
    module, _, name = nccl.WORKER_EXTENSION.rpartition(".")
    extension = getattr(importlib.import_module(module), name)
    assert extension is nccl.NcclWeightReceiver
    methods = [a for a in vars(extension) if not a.startswith("__")]
    assert all(m.startswith(("vime_", "_vime_")) for m in methods), methods
    # vLLM refuses an extension whose attribute names the worker class already has. Its worker
    # classes are read as source (importing vLLM takes seconds).
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "v1", "worker")
    source = "".join(open(os.path.join(folder, f)).read() for f in os.listdir(folder) if f.endswith(".py"))
    pattern = r"^\s+def (\w+)\(|^\s+self\.(\w+)\s*[:=]"  # methods and attributes set in __init__
    defined = {method or attribute for method, attribute in re.findall(pattern, source, re.M)}
    assert "reload_weights" in defined and "get_model" in defined  # what the extension relies on
    assert not defined & set(methods)
