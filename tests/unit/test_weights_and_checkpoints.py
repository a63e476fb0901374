"""Weight versions on disk and joint checkpoints: complete or invisible, verified, pruned."""

import json
import os

import pytest

from vime.recovery import checkpoint as ckpt
from vime.weights import disk


def writer(content: bytes):
    def write(folder):
        os.makedirs(folder)
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(content)

    return write


def test_publish_verify_and_prune(tmp_path):
    root = str(tmp_path / "w")
    for version in range(4):
        path = disk.publish_full(root, version, writer(b"v%d" % version))
        assert os.path.basename(path) == f"weight_v{version:06d}"
        assert disk.verify(path).version == version
    assert disk.published_versions(root) == [0, 1, 2, 3]
    assert disk.prune(root, {2, 3}) == [0, 1]
    assert disk.published_versions(root) == [2, 3]
    with open(os.path.join(disk.version_dir(root, 3), "model.safetensors"), "ab") as f:
        f.write(b"tampered")
    with pytest.raises(disk.WeightError, match="does not match its checksum"):
        disk.verify(disk.version_dir(root, 3))


def test_a_failed_write_leaves_no_version(tmp_path):
    root = str(tmp_path / "w")

    def broken(folder):
        writer(b"partial")(folder)
        raise OSError("disk full")

    with pytest.raises(OSError):
        disk.publish_full(root, 1, broken)
    assert disk.published_versions(root) == []
    assert os.listdir(root) == []


def state(step, cursor=0, **options):
    return ckpt.CheckpointState(
        schema=1, step=step, weight_version=step, consumer_cursor=cursor, run_options={"seed": 1, **options}
    )


def test_checkpoint_is_complete_or_invisible(tmp_path):
    root = str(tmp_path / "save")
    ckpt.save_checkpoint(root, state(2, 8), writer(b"model"))
    assert ckpt.latest_step(root) == 2

    def crash(folder):
        writer(b"half")(folder)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, state(4, 16), crash)
    assert ckpt.latest_step(root) == 2
    folder, loaded = ckpt.load_state(root)
    assert folder.endswith("iter_0000002") and loaded.consumer_cursor == 8
    assert sorted(os.listdir(root)) == [".checkpoint.lock", "iter_0000002", "latest_checkpointed_iteration.txt"]
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.load_state(root, 4)


def test_changed_run_options_are_refused():
    ckpt.check_run_options({"seed": 1, "prompt_data": "a"}, {"seed": 1, "prompt_data": "a"})
    with pytest.raises(ckpt.CheckpointError, match="^--n-samples-per-prompt"):
        ckpt.check_run_options({"n_samples_per_prompt": 8}, {"n_samples_per_prompt": 4})


def test_load_without_latest_file_is_a_clear_error(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="no latest_checkpointed_iteration.txt"):
        ckpt.load_state(str(tmp_path))
    json.dumps({})
