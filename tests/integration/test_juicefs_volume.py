"""The queue on a real JuiceFS mount (tests/juicefs.py): a mount with JuiceFS's defaults is read, accepted and
used by straw; a mount with write-back caching is refused by `vime train` before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.juicefs import juicefs_volume
from tests.train_args import minimal_train_argv
from vime.queue.juicefs_mount import JuiceFSMountRefused, checked_declaration

pytestmark = pytest.mark.integration


def test_a_default_mount_is_read_accepted_and_carries_the_queue(juicefs_mount):
    data_dir = os.path.join(juicefs_mount, "accepted")
    declaration = checked_declaration(data_dir)
    assert declaration["direct_mount"] is True and declaration["writeback"] is False
    assert declaration["client_version"].startswith("1.4.2")
    from straw import Record

    from vime.queue.rollout_queue import open_store

    os.makedirs(data_dir)
    with open_store(data_dir, "vime", profile="juicefs", declaration=declaration) as store:
        ref = store.publish([Record("message", b"through the JuiceFS client")], submission_id="one")
        assert next(store.read(ref)).payload == b"through the JuiceFS client"
        assert store.backend.diagnostics()["declaration"] == declaration
    # an explicit declaration that contradicts the mount is refused, naming the key
    with pytest.raises(JuiceFSMountRefused, match="--rollout-storage-declaration says writeback=True"):
        checked_declaration(data_dir, {"writeback": True})


def test_vime_train_refuses_a_writeback_mount_before_starting_anything(tmp_path, config_dir):
    with juicefs_volume(str(tmp_path / "volume"), "--writeback") as mount_point:
        with open(os.path.join(mount_point, ".config")) as f:
            assert json.load(f)["Chunk"]["Writeback"] is True  # the option took effect
        data_dir = os.path.join(mount_point, "queue")
        argv = minimal_train_argv(config_dir, "--rollout-storage-profile", "juicefs", "--rollout-data-dir", data_dir)
        run_dir = str(tmp_path / "run")
        argv[argv.index("--run-dir") + 1] = run_dir
        result = subprocess.run(
            [sys.executable, "-m", "vime.cli", "train", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
        assert "--rollout-storage-profile juicefs: the JuiceFS mount at" in result.stderr
        assert "write-back caching is on (--writeback)" in result.stderr
        assert "remount without --writeback" in result.stderr
        assert "starting Ray" not in result.stdout + result.stderr
        assert not os.path.exists(data_dir) and not os.path.exists(run_dir)  # refused before anything was made
