"""--update-weight-mode delta on the disk transport: encode, publish, prune, apply (docs/weights.md).

Real weights: the tiny Qwen2 model, changed by a real AdamW step between versions; the files are
what HF ``save_pretrained`` writes (what the trainer publishes).
"""

from __future__ import annotations

import json
import os

import msgspec
import pytest
import torch

from vime.weights import delta, disk
from vime.weights.local import LocalWeights
from vime.weights.publisher import WeightPublisher
from vime.workers.engines import EngineActor, EngineSpec

# ---------------------------------------------------------------- a trainer in miniature


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


class Trainer:
    """An HF model and its AdamW optimizer; ``step()`` changes every parameter."""

    def __init__(self, model_dir: str, seed: int = 0):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self) -> None:
        ids = torch.randint(0, 12, (4, 12))
        self.optimizer.zero_grad()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()

    def write(self, folder: str) -> None:
        self.model.save_pretrained(folder, safe_serialization=True)


def read_files(folder: str) -> dict[str, bytes]:
    return {
        name: open(os.path.join(folder, name), "rb").read()
        for name in sorted(os.listdir(folder))
        if name != disk.MANIFEST
    }


def expected_files(trainer: Trainer, tmp_path, name: str) -> dict[str, bytes]:
    folder = str(tmp_path / f"expected_{name}")
    trainer.write(folder)
    return read_files(folder)


@pytest.fixture
def trainer(model_dir):
    return Trainer(model_dir)


# ---------------------------------------------------------------- the tests


def test_delta_rebuilds_the_full_weights_bit_for_bit(tmp_path, trainer):
    root = str(tmp_path / "weights")
    publisher = WeightPublisher(root, keep=2)
    first = publisher.publish(1, trainer.write, mode="delta")
    assert (first.mode, first.parent) == ("full", None)  # the first publication is always full
    trainer.step()
    second = publisher.publish(2, trainer.write, mode="delta")
    assert (second.mode, second.parent) == ("delta", 1)
    assert second.published_bytes < 0.8 * second.full_bytes  # the XOR of one AdamW step compresses
    manifest = disk.verify(second.path)
    assert sorted(manifest.files) == sorted(n + delta.SUFFIX for n in manifest.full_files)
    expected = expected_files(trainer, tmp_path, "v2")

    disk.reconstruct(root, 2, str(tmp_path / "rebuilt"))
    assert read_files(str(tmp_path / "rebuilt")) == expected

    # The engine's side: its own copy of version 1, the delta applied to it.
    local = LocalWeights(str(tmp_path / "engine"))
    local.receive(first.path)
    folder, applied = local.receive(second.path)
    assert applied.version == 2 and local.version == 2
    assert read_files(folder) == expected
    from safetensors.torch import load_file

    loaded = load_file(os.path.join(folder, "model.safetensors"))
    for name, tensor in trainer.model.state_dict().items():
        if name in loaded:
            assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype, name
    assert not os.path.exists(disk.version_dir(local.root, 1))  # the previous copy is gone


def test_a_scratch_folder_elsewhere_holds_the_parent_of_the_next_delta(tmp_path, trainer):
    """--update-weight-trainer-dir: the parent of the next delta lives in the given folder, nothing under the
    weight directory's .trainer/; a full version is linked out of it (copied across file systems), and both
    kinds rebuild the trainer's files."""
    root, scratch = str(tmp_path / "weights"), str(tmp_path / "local_disk" / "trainer")
    publisher = WeightPublisher(root, keep=3, scratch=scratch)
    first = publisher.publish(1, trainer.write, mode="delta")
    trainer.step()
    second = publisher.publish(2, trainer.write, mode="delta")
    assert (first.mode, second.mode) == ("full", "delta")
    assert not os.path.exists(os.path.join(root, ".trainer"))
    assert os.listdir(scratch) == ["full_v000002"]  # the parent of version 3
    disk.reconstruct(root, 2, str(tmp_path / "rebuilt"))
    assert read_files(str(tmp_path / "rebuilt")) == expected_files(trainer, tmp_path, "v2")
    trainer.step()
    third = publisher.publish(3, trainer.write, mode="delta", force_full=True)
    assert third.mode == "full" and read_files(third.path) == expected_files(trainer, tmp_path, "v3")
    publisher.close()
    assert not os.path.exists(scratch)


def test_full_publications_first_every_interval_and_when_asked(tmp_path, trainer):
    root = str(tmp_path / "weights")
    publisher = WeightPublisher(root, keep=10)
    modes = []
    for version in range(1, 8):
        trainer.step()
        modes.append(publisher.publish(version, trainer.write, mode="delta", full_interval=3).mode)
    assert modes == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    assert publisher.publish(8, trainer.write, mode="delta", full_interval=3, force_full=True).mode == "full"
    assert publisher.publish(10, trainer.write, mode="delta", full_interval=3).mode == "full"  # 9 not published here
    # A new process (a resumed run) has no parent: its first publication is full.
    assert WeightPublisher(root, keep=10).publish(11, trainer.write, mode="delta").mode == "full"
    assert WeightPublisher(root, keep=10).publish(12, trainer.write, mode="full").mode == "full"


def test_out_of_order_delta_is_refused_naming_both_versions(tmp_path, trainer):
    root = str(tmp_path / "weights")
    publisher = WeightPublisher(root, keep=10)
    paths = []
    for version in (1, 2, 3):
        trainer.step()
        paths.append(publisher.publish(version, trainer.write, mode="delta").path)
    local = LocalWeights(str(tmp_path / "engine"))
    with pytest.raises(disk.WeightError, match="a delta from version 1 to version 2, but this engine holds no version"):
        local.receive(paths[1])
    local.receive(paths[0])
    with pytest.raises(disk.WeightError, match="from version 2 to version 3, but this engine holds version 1; refused"):
        local.receive(paths[2])
    assert local.version == 1  # nothing changed
    local.receive(paths[1])
    local.receive(paths[2])
    assert read_files(local.path) == expected_files(trainer, tmp_path, "v3")


def test_corrupted_delta_and_corrupted_parent_are_detected(tmp_path, trainer):
    root = str(tmp_path / "weights")
    publisher = WeightPublisher(root, keep=10)
    first = publisher.publish(1, trainer.write, mode="delta")
    trainer.step()
    second = publisher.publish(2, trainer.write, mode="delta")
    container = os.path.join(second.path, "model.safetensors" + delta.SUFFIX)
    original = open(container, "rb").read()
    with open(container, "r+b") as f:  # one flipped bit in the middle of the payload
        f.seek(len(original) // 2)
        f.write(bytes([original[len(original) // 2] ^ 0x01]))
    local = LocalWeights(str(tmp_path / "engine"))
    local.receive(first.path)
    with pytest.raises(disk.WeightError, match=r"model.safetensors.vdelta does not match its checksum"):
        local.receive(second.path)
    assert local.version == 1
    with open(container, "wb") as f:
        f.write(original)

    # The engine's own copy of version 1 went bad: the rebuilt file fails the trainer's checksum.
    held = os.path.join(local.path, "model.safetensors")
    data = bytearray(open(held, "rb").read())
    data[-5] ^= 0x40
    os.remove(held)  # a hard link to the published file: replace it, do not write through it
    open(held, "wb").write(bytes(data))
    with pytest.raises(disk.WeightError, match="rebuilt model.safetensors of version 2 does not match its checksum"):
        local.receive(second.path)
    assert disk.verify(first.path)  # the published version was not touched through the link


def test_prune_keeps_the_delta_chain_of_every_kept_version(tmp_path, trainer):
    root = str(tmp_path / "weights")
    publisher = WeightPublisher(root, keep=1)
    for version in range(1, 6):
        trainer.step()
        publisher.publish(version, trainer.write, mode="delta", full_interval=10)
    # keep {4, 5}; 5 is a delta of 4, of 3, ... of the full version 1: all of it stays.
    assert disk.published_versions(root) == [1, 2, 3, 4, 5]
    for version in range(6, 8):
        trainer.step()
        publisher.publish(version, trainer.write, mode="delta", full_interval=3)  # 6 is full (5 deltas since 1)
    assert [disk.read_manifest(disk.version_dir(root, v)).mode for v in (6, 7)] == ["full", "delta"]
    assert disk.published_versions(root) == [6, 7]
    disk.reconstruct(root, 7, str(tmp_path / "v7"))
    assert read_files(str(tmp_path / "v7")) == expected_files(trainer, tmp_path, "v7")
    assert disk.chain(root, 7) == [6, 7]
    assert disk.needed_versions(root, {7}) == {6, 7}


def test_a_version_of_another_lineage_is_replaced_not_reused(tmp_path):
    root = str(tmp_path / "weights")

    def writer(content: bytes):
        def write(folder):
            os.makedirs(folder)
            open(os.path.join(folder, "model.safetensors"), "wb").write(content)

        return write

    path = disk.publish_full(root, 3, writer(b"old lineage"))
    created = disk.read_manifest(path).created
    assert disk.publish_full(root, 3, writer(b"old lineage")) == path
    assert disk.read_manifest(path).created == created  # the same publication: kept as it was
    disk.publish_full(root, 3, writer(b"new lineage"))
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == b"new lineage"
    assert os.listdir(root) == ["weight_v000003"]


def test_engine_actor_loads_its_own_copy(tmp_path, trainer):
    """EngineActor.update_weights: vLLM is told to reload the engine's folder, never the published one."""

    class Client:
        def __init__(self):
            self.calls, self.loaded = [], []

        def pause(self, mode):
            self.calls.append(f"pause:{mode}")

        def reload_weights(self, path):
            self.calls.append("reload")
            self.loaded.append((path, read_files(path)))

        def reset_prefix_cache(self):
            self.calls.append("reset")

        def update_weight_version(self, version):
            self.calls.append(f"version:{version}")

        def resume(self):
            self.calls.append("resume")

        def probe(self, expect_version=None):
            self.calls.append(f"probe:{expect_version}")

    root = str(tmp_path / "weights")
    publisher = WeightPublisher(root, keep=1)
    actor = EngineActor(
        EngineSpec(
            index=3,
            model="unused",
            vllm_args={},
            tensor_parallel_size=1,
            run_token="t",
            log_path=str(tmp_path / "log"),
            startup_timeout=1,
            http_timeout=1,
        )
    )
    actor.client = Client()
    for version in (1, 2, 3):
        trainer.step()
        path = publisher.publish(version, trainer.write, mode="delta").path
        actor.update_weights(path, version, flush=version == 1)
        folder, files = actor.client.loaded[-1]
        assert folder == os.path.join(root, ".engine_3", f"weight_v{version:06d}")
        assert files == expected_files(trainer, tmp_path, f"v{version}")
    # Every update ends with a generation probe at the new version, after the engine resumed.
    assert actor.client.calls[:6] == ["pause:abort", "reload", "reset", "version:1", "resume", "probe:1"]
    assert actor.client.calls[6:11] == ["pause:keep", "reload", "version:2", "resume", "probe:2"]
    assert actor.version == 3
    with pytest.raises(disk.WeightError, match="holds version 3, not the version 4"):
        actor.update_weights(path, 4, flush=False)
    assert actor.local.version == 3 and os.path.isdir(actor.local.path)  # nothing changed
    actor.stop()
    assert not os.path.exists(os.path.join(root, ".engine_3"))


# ---------------------------------------------------------------- the container format


def _safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})


def test_containers_xor_raw_and_bad_input(tmp_path):
    parent, new = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    base = {"w": torch.randn(64, 33), "h": torch.randn(7).to(torch.bfloat16), "e": torch.zeros(0)}
    _safetensors(parent, base)
    _safetensors(new, {**base, "w": base["w"] + 1e-3})
    header = delta.encode_file(parent, new, str(tmp_path / "d"))
    assert header.kind == "xor" and [c.name for c in header.chunks][0] == "__header__"
    assert {c.name: c.itemsize for c in header.chunks} == {"__header__": 1, "e": 4, "h": 2, "w": 4}
    delta.decode_file(parent, str(tmp_path / "d"), str(tmp_path / "out"))
    assert open(tmp_path / "out", "rb").read() == open(new, "rb").read()

    reshaped = str(tmp_path / "c.safetensors")  # a layout change: stored whole
    _safetensors(reshaped, {**base, "w": base["w"].reshape(33, 64)})
    assert delta.encode_file(parent, reshaped, str(tmp_path / "r")).kind == "raw"
    delta.decode_file(None, str(tmp_path / "r"), str(tmp_path / "out2"))
    assert open(tmp_path / "out2", "rb").read() == open(reshaped, "rb").read()

    with pytest.raises(delta.DeltaError, match="needs the parent file"):
        delta.decode_file(None, str(tmp_path / "d"), str(tmp_path / "x"))
    open(tmp_path / "short", "wb").write(b"1234")
    with pytest.raises(delta.DeltaError, match="has 4 bytes"):
        delta.decode_file(str(tmp_path / "short"), str(tmp_path / "d"), str(tmp_path / "x"))
    data = open(tmp_path / "d", "rb").read()
    open(tmp_path / "cut", "wb").write(data[:-10])
    with pytest.raises(delta.DeltaError):
        delta.decode_file(parent, str(tmp_path / "cut"), str(tmp_path / "x"))
    open(tmp_path / "junk", "wb").write(b"not a delta at all")
    with pytest.raises(delta.DeltaError, match="bad magic"):
        delta.read_header(str(tmp_path / "junk"))


def test_large_tensors_are_cut_into_frames(tmp_path, monkeypatch):
    monkeypatch.setattr(delta, "BLOCK", 1024)
    parent, new = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    weights = torch.randn(1000)
    _safetensors(parent, {"w": weights})
    _safetensors(new, {"w": weights * 1.001})
    header = delta.encode_file(parent, new, str(tmp_path / "d"))
    assert len(next(c for c in header.chunks if c.name == "w").frames) == 4  # 4000 bytes in 1024-byte frames
    delta.decode_file(parent, str(tmp_path / "d"), str(tmp_path / "out"))
    assert open(tmp_path / "out", "rb").read() == open(new, "rb").read()


def test_schema_1_manifests_still_read(tmp_path):
    folder = tmp_path / "weight_v000001"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x")
    old = {
        "schema": 1,
        "version": 1,
        "mode": "full",
        "parent": None,
        "created": 0.0,
        "files": {"model.safetensors": disk.sha256_file(str(folder / "model.safetensors"))},
    }
    (folder / disk.MANIFEST).write_text(json.dumps(old))
    manifest = disk.verify(str(folder))
    assert manifest.full_checksums == old["files"] and manifest.parent_files == {}
    (folder / disk.MANIFEST).write_bytes(msgspec.json.encode({**old, "schema": 99}))
    with pytest.raises(disk.WeightError, match="newer than this vime"):
        disk.read_manifest(str(folder))
