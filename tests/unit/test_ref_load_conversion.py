"""--ref-load as a Megatron checkpoint for the torch trainer (vime/backends/ref_load_conversion.py): converted to
HF once at start-up by `vime tools convert-megatron-to-hf` (a real conversion of a tiny model, in its own
process), reused by a later start, and refused naming the flag where it cannot be read."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO
from vime.backends import ref_load_conversion
from vime.config import ConfigError

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("ref_load")
    engine_model = make_tiny_model(str(root / "hf"), hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    other = make_tiny_model(
        str(root / "other"), hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, seed=3
    )
    megatron = str(root / "megatron")
    command = [sys.executable, "-m", "vime.cli", "tools", "convert-hf-to-megatron", "--hf-checkpoint", other]
    subprocess.run(command + ["--save", megatron, "--ckpt-format", "torch"], cwd=REPO, check=True, timeout=300)
    return {"hf": engine_model, "other": other, "megatron": megatron, "root": root}


def test_what_needs_converting():
    assert not ref_load_conversion.needs_conversion(None)
    assert not ref_load_conversion.needs_conversion("s3://bucket/model")


def test_a_megatron_ref_load_is_converted_once_and_reused(checkpoints, tmp_path):
    said = []
    assert ref_load_conversion.needs_conversion(checkpoints["megatron"])
    assert not ref_load_conversion.needs_conversion(checkpoints["hf"])
    run_dir = str(tmp_path / "run")
    folder = ref_load_conversion.hf_folder(checkpoints["megatron"], checkpoints["hf"], run_dir, said.append)
    assert folder == os.path.join(run_dir, "ref_load_hf")
    assert any("converting" in line for line in said)
    converted, original = (load_file(os.path.join(f, "model.safetensors")) for f in (folder, checkpoints["other"]))
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name  # the checkpoint's weights, not --hf-checkpoint's
    said.clear()
    assert ref_load_conversion.hf_folder(checkpoints["megatron"], checkpoints["hf"], run_dir, said.append) == folder
    assert said == [f"--ref-load {checkpoints['megatron']}: the torch trainer reads its HF conversion in {folder}"]
    assert not [n for n in os.listdir(run_dir) if ".tmp" in n]


def test_an_unreadable_megatron_ref_load_is_refused_naming_the_flag(checkpoints, tmp_path):
    from vime.tools.make_tiny_model import make_tiny_model

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(ConfigError, match="^--ref-load: .*iter_0000007"):
        ref_load_conversion.hf_folder(str(broken), checkpoints["hf"], str(tmp_path / "run"), print)
    # A checkpoint of another shape than --hf-checkpoint's config: the converter's error, nothing left behind.
    wider = make_tiny_model(str(tmp_path / "wider"), hidden_size=128, num_heads=2, num_kv_heads=1)
    with pytest.raises(ConfigError, match="^--ref-load: .* could not be converted to HF with --hf-checkpoint"):
        ref_load_conversion.hf_folder(checkpoints["megatron"], wider, str(tmp_path / "run2"), print)
    assert not os.path.exists(tmp_path / "run2" / "ref_load_hf")
    assert not [n for n in os.listdir(tmp_path / "run2") if ".tmp" in n]
