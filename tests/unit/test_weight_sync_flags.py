"""The reference framework's weight-sync flags (issue 19, point 6): --update-weight-buffer-size,
--update-weight-delta-encoding, --update-weight-delta-checksum, --update-weight-local-checkpoint-dir.

Parsing, bad values refused naming the flag, the start-up notes where vime's mechanism makes a flag moot,
and what each does in vime's own code: real tensors, real safetensors files, real folders.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from safetensors.torch import save_file

from tests.train_args import minimal_train_argv
from vime.config import ConfigError, parse_train_args
from vime.config.weight_sync import WeightSyncConfig
from vime.weights import delta, disk, nccl
from vime.weights.local import LocalWeights
from vime.weights.publisher import WeightPublisher
from vime.workers.engine_members import EngineTemplate
from vime.workers.engines import EngineActor

# ---------------------------------------------------------------- parsing and validation


def parse(config_dir, tmp_path, *extra):
    return parse_train_args(minimal_train_argv(config_dir, "--run-dir", str(tmp_path / "run"), *extra))


def test_defaults_are_the_reference_frameworks(config_dir, tmp_path):
    w = parse(config_dir, tmp_path).weights
    assert w.update_weight_buffer_size == 512 * 1024**2
    assert w.update_weight_delta_encoding == "xor"
    assert w.update_weight_delta_checksum == "xxh3-128"
    assert w.update_weight_local_checkpoint_dir is None
    assert w.startup_notes() == []  # defaults say nothing (the checksum packages are installed here)


def test_values_parse(config_dir, tmp_path):
    local = tmp_path / "nvme"
    s = parse(
        config_dir,
        tmp_path,
        "--update-weight-mode",
        "delta",
        "--update-weight-buffer-size",
        str(4 * 512 * 1024 * 1024),
        "--update-weight-delta-encoding",
        "overwrite",
        "--update-weight-delta-checksum",
        "adler32",
        "--update-weight-local-checkpoint-dir",
        str(local),
    )
    w = s.weights
    assert w.update_weight_buffer_size == 2 * 1024**3
    assert w.update_weight_delta_encoding == "overwrite"
    assert w.update_weight_delta_checksum == "adler32" and w.delta_checksum() == "adler32"
    assert w.update_weight_local_checkpoint_dir == str(local)
    assert s.args.update_weight_buffer_size == 2 * 1024**3  # hooks see them in args too
    # buffer size acts with nccl only: the disk transport says so once
    assert w.startup_notes() == [
        "--update-weight-buffer-size 2147483648: no effect with the disk transport (the trainer writes whole "
        "safetensors files, each engine reloads them); it sizes the broadcast buckets of --update-weight-transport nccl"
    ]


def test_relative_local_dir_becomes_absolute(config_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    w = parse(config_dir, tmp_path, "--update-weight-local-checkpoint-dir", "ckpt").weights
    assert w.update_weight_local_checkpoint_dir == str(tmp_path / "ckpt")


@pytest.mark.parametrize("size", ["0", "-5"])
def test_buffer_size_must_be_positive(config_dir, tmp_path, size):
    with pytest.raises(ConfigError) as error:
        parse(config_dir, tmp_path, "--update-weight-buffer-size", size)
    assert error.value.flag == "--update-weight-buffer-size"


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--update-weight-delta-encoding", "zstd"),
        ("--update-weight-delta-checksum", "md5"),
        ("--update-weight-buffer-size", "512MB"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(config_dir, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit):
        parse(config_dir, tmp_path, flag, value)
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--update-weight-local-checkpoint-dir", "--update-weight-trainer-dir"])
def test_a_host_dir_that_is_a_file_or_url_is_refused(config_dir, tmp_path, flag):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for value in (str(a_file), "s3://bucket/ckpt", ""):
        with pytest.raises(ConfigError) as error:
            parse(config_dir, tmp_path, flag, value)
        assert error.value.flag == flag


def test_trainer_dir_is_made_absolute_and_said_where_moot(config_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = parse(config_dir, tmp_path, "--update-weight-mode", "auto", "--update-weight-trainer-dir", "nvme")
    assert s.weights.update_weight_trainer_dir == str(tmp_path / "nvme") and s.weights.startup_notes() == []
    from vime.workers.trainer_worker import TrainerWorkerSpec

    spec = TrainerWorkerSpec.from_settings(s, transport="memory", store=None, threads=1, cpu_affinity=None)
    assert spec.weight_scratch_dir == str(tmp_path / "nvme" / "trainer")  # the publisher's scratch, in its folder
    assert WeightSyncConfig(update_weight_trainer_dir="/nvme").startup_notes() == [
        "--update-weight-trainer-dir /nvme: no effect with --update-weight-mode full and the disk transport (it "
        "holds the parent of the next delta)"
    ]


def test_startup_notes_where_a_flag_is_moot():
    full = WeightSyncConfig(update_weight_delta_encoding="overwrite", update_weight_delta_checksum="blake3")
    assert full.startup_notes() == [
        "--update-weight-delta-encoding overwrite: no effect with --update-weight-mode full "
        "(it encodes delta versions)",
        "--update-weight-delta-checksum blake3: no effect with --update-weight-mode full (full versions are checked "
        "by the sha256 of every file)",
    ]
    nccl_run = WeightSyncConfig(update_weight_transport="nccl", update_weight_local_checkpoint_dir="/nvme/ckpt")
    assert nccl_run.startup_notes() == [
        "--update-weight-local-checkpoint-dir /nvme/ckpt: no effect with --update-weight-transport nccl (engines "
        "receive the weights in memory; nothing is kept on disk)"
    ]
    # nccl and a buffer size: it acts (buckets), nothing to say
    assert WeightSyncConfig(update_weight_transport="nccl", update_weight_buffer_size=1024).startup_notes() == []


def test_missing_checksum_package_falls_back_to_sha256_and_says_so(monkeypatch):
    from vime.config import weight_sync

    monkeypatch.setitem(weight_sync.CHECKSUM_PACKAGES, "xxh3-128", "a_package_that_is_not_installed")
    config = WeightSyncConfig(update_weight_mode="delta")
    assert config.delta_checksum() == "sha256"
    assert delta.usable_checksum("xxh3-128") == "xxh3-128"  # the codec's own check, with the package here
    assert config.startup_notes() == [
        "--update-weight-delta-checksum xxh3-128: the package it needs is not installed here; delta files carry "
        "sha256 per tensor instead"
    ]


# ---------------------------------------------------------------- delta encoding and checksum, on real files


def write_weights(path: str, tensors: dict[str, torch.Tensor]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


@pytest.fixture
def versions(tmp_path):
    """Two versions of the same layout: a small step on every weight (some elements unchanged)."""
    torch.manual_seed(0)
    old = {
        "a.weight": torch.randn(64, 32, dtype=torch.bfloat16),
        "b.weight": torch.randn(300, dtype=torch.float32),
        "c.step": torch.arange(10, dtype=torch.int64),
    }
    new = {name: t.clone() for name, t in old.items()}
    new["a.weight"][:8] += 0.5
    new["b.weight"] *= 1.001
    new["c.step"][3] = 99
    parent = write_weights(str(tmp_path / "v1" / "model.safetensors"), old)
    child = write_weights(str(tmp_path / "v2" / "model.safetensors"), new)
    return parent, child


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_encoding_rebuilds_bit_for_bit(versions, tmp_path, encoding):
    parent, child = versions
    out = str(tmp_path / "d.vdelta")
    header = delta.encode_file(parent, child, out, encoding=encoding, checksum="xxh3-128")
    assert header.kind == encoding and delta.read_header(out)[0].kind == encoding  # the engine reads it from here
    delta.decode_file(parent, out, str(tmp_path / "rebuilt"))
    assert read(str(tmp_path / "rebuilt")) == read(child)


def test_overwrite_is_idempotent_xor_is_not(versions, tmp_path):
    parent, child = versions
    for encoding in ("xor", "overwrite"):
        out = str(tmp_path / f"{encoding}.vdelta")
        delta.encode_file(parent, child, out, encoding=encoding)
        again = str(tmp_path / f"{encoding}.again")
        delta.decode_file(child, out, again)  # applied a second time: to the new bytes
        assert (read(again) == read(child)) is (encoding == "overwrite")


@pytest.mark.parametrize("checksum", ["xxh3-128", "blake3", "adler32", "sha256"])
def test_each_tensor_carries_its_checksum(versions, tmp_path, checksum):
    parent, child = versions
    out = str(tmp_path / "d.vdelta")
    header = delta.encode_file(parent, child, out, checksum=checksum)
    assert header.checksum == checksum
    data = read(child)
    for chunk in header.chunks:
        piece = data[chunk.offset : chunk.offset + chunk.length]
        expected = {
            "adler32": lambda b: f"{zlib.adler32(b):08x}",
            "sha256": lambda b: __import__("hashlib").sha256(b).hexdigest(),
            "xxh3-128": lambda b: __import__("xxhash").xxh3_128(b).hexdigest(),
            "blake3": lambda b: __import__("blake3").blake3(b).hexdigest(),
        }[checksum](piece)
        assert chunk.digest == expected, chunk.name


@pytest.mark.parametrize("checksum", ["xxh3-128", "adler32"])
def test_apply_against_other_bytes_is_refused_naming_the_tensor(versions, tmp_path, checksum):
    parent, child = versions
    out = str(tmp_path / "d.vdelta")
    delta.encode_file(parent, child, out, checksum=checksum)
    from safetensors.torch import load_file

    other = load_file(parent)
    other["b.weight"][7] += 1.0  # same layout, one tensor's bytes differ
    wrong_parent = write_weights(str(tmp_path / "other" / "model.safetensors"), other)
    with pytest.raises(delta.DeltaError, match=rf"rebuilt b\.weight does not match its {checksum} checksum"):
        delta.decode_file(wrong_parent, out, str(tmp_path / "rebuilt"))


def test_publisher_writes_the_flags_encoding_and_checksum_and_engine_applies_it(tmp_path):
    torch.manual_seed(1)
    weights = {"w": torch.randn(128, 16), "b": torch.randn(16)}

    def writer(tensors):
        def write(folder):
            os.makedirs(folder, exist_ok=True)
            save_file({k: v.clone() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))

        return write

    root = str(tmp_path / "weights")
    publisher = WeightPublisher(root, keep=3, encoding="overwrite", checksum="blake3")
    publisher.publish(1, writer(weights), mode="delta")
    weights["w"][0] += 1.0
    second = publisher.publish(2, writer(weights), mode="delta")
    assert second.mode == "delta"
    header, _ = delta.read_header(os.path.join(second.path, "model.safetensors" + delta.SUFFIX))
    assert (header.kind, header.checksum) == ("overwrite", "blake3")
    engine = LocalWeights(str(tmp_path / "engine"))
    engine.receive(disk.version_dir(root, 1))
    path, _ = engine.receive(second.path)
    expected = str(tmp_path / "expected")
    writer(weights)(expected)
    assert read(os.path.join(path, "model.safetensors")) == read(os.path.join(expected, "model.safetensors"))


# ---------------------------------------------------------------- local checkpoint dir


def test_local_checkpoint_dir_holds_each_engines_copy(tmp_path):
    local_root = str(tmp_path / "nvme")
    template = EngineTemplate(
        model="m",
        vllm_args={},
        tensor_parallel_size=1,
        run_token="t",
        log_dir=str(tmp_path / "logs"),
        startup_timeout=1,
        http_timeout=1,
        weight_dir=str(tmp_path / "weights"),
        weights_local_dir=local_root,
    )
    assert template.spec(3).weights_local_dir == os.path.join(local_root, "engine_3")
    assert EngineTemplate(**{**template.__dict__, "weights_local_dir": None}).spec(3).weights_local_dir is None
    # the engine actor keeps the version it loads there, not beside the published folders
    root = str(tmp_path / "weights")
    disk.publish_full(root, 1, lambda f: write_weights(os.path.join(f, "model.safetensors"), {"x": torch.ones(4)}))
    actor = EngineActor(template.spec(3))
    local = actor._local(root)
    path, _ = local.receive(disk.version_dir(root, 1), 1)
    assert path == os.path.join(local_root, "engine_3", "weight_v000001")
    assert os.listdir(path) == ["model.safetensors"]
    assert not os.path.exists(os.path.join(root, ".engine_3"))
    # the default: beside the published versions
    assert EngineActor(EngineTemplate(**{**template.__dict__, "weights_local_dir": None}).spec(3))._local(
        root
    ).root == (os.path.join(root, ".engine_3"))


def test_local_checkpoint_dir_itself_is_never_wiped(tmp_path):
    """LocalWeights clears its root at start: that root is a per-engine folder inside the user's directory."""
    local_root = tmp_path / "nvme"
    local_root.mkdir()
    (local_root / "someone_elses_file").write_text("keep")
    template = EngineTemplate(
        model="m",
        vllm_args={},
        tensor_parallel_size=1,
        run_token="t",
        log_dir=str(tmp_path),
        startup_timeout=1,
        http_timeout=1,
        weight_dir=str(tmp_path / "w"),
        weights_local_dir=str(local_root),
    )
    EngineActor(template.spec(0))._local(str(tmp_path / "w"))
    assert (local_root / "someone_elses_file").read_text() == "keep"


# ---------------------------------------------------------------- buffer size: NCCL buckets, on CPU tensors


def test_bucket_plan():
    assert nccl.bucket_plan([10, 10, 10], 0) == [[(0, 0, 10)], [(1, 0, 10)], [(2, 0, 10)]]
    # offsets aligned to 16 bytes; a bucket holds at most the buffer size
    assert nccl.bucket_plan([10, 10, 10], 32) == [[(0, 0, 10), (1, 16, 10)], [(2, 0, 10)]]
    # a tensor larger than the buffer goes alone
    assert nccl.bucket_plan([4, 100, 4, 4], 40) == [[(0, 0, 4)], [(1, 0, 100)], [(2, 0, 4), (3, 16, 4)]]
    assert nccl.bucket_plan([], 40) == []


class Wire:
    """Two ends of a broadcast on CPU: what rank 0 sends is what the receivers get, call by call."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []
        self.received = 0

    def broadcast(self, tensor, src, stream=None):
        assert src == 0
        self.sent.append(tensor.clone())

    def receiver(self):
        wire = self

        class End:
            def broadcast(self, tensor, src, stream=None):
                payload = wire.sent[wire.received]
                wire.received += 1
                assert payload.dtype == tensor.dtype and payload.shape == tensor.shape
                tensor.copy_(payload)

        return End()


@pytest.mark.parametrize(("bucket_bytes", "broadcasts"), [(0, 5), (512 * 1024**2, 1), (200, 3)])
def test_buckets_round_trip(bucket_bytes, broadcasts):
    torch.manual_seed(2)
    named = [
        ("embed", torch.randn(10, 8, dtype=torch.bfloat16)),  # 160 bytes
        ("expert.0", torch.randn(7, dtype=torch.float32)),  # 28
        ("expert.1", torch.randn(3, 3, dtype=torch.float16)),  # 18
        ("count", torch.arange(5, dtype=torch.int64)),  # 40
        ("big", torch.randn(200, dtype=torch.float32)),  # 800: alone under 200
    ]
    metas = nccl.tensor_metadata(named)
    wire = Wire()
    report = nccl.broadcast_buckets(wire, named, metas, bucket_bytes, "cpu", None)
    assert report["tensors"] == 5 and report["broadcasts"] == broadcasts == len(wire.sent)
    got = list(nccl.receive_buckets(wire.receiver(), metas, bucket_bytes, "cpu", None))
    assert [name for name, _ in got] == [name for name, _ in named]
    for (_, sent), (_, received) in zip(named, got):
        assert received.dtype == sent.dtype and received.shape == sent.shape and torch.equal(received, sent)


def test_buckets_check_the_metadata():
    named = [("a", torch.zeros(2)), ("b", torch.zeros(3))]
    metas = nccl.tensor_metadata(named)
    with pytest.raises(ValueError, match="differs from the metadata"):
        nccl.broadcast_buckets(Wire(), [("a", torch.zeros(2)), ("b", torch.zeros(4))], metas, 1024, "cpu", None)
    with pytest.raises(ValueError, match="2 tensors in the metadata, 1 given"):
        nccl.broadcast_buckets(Wire(), named[:1], metas, 1024, "cpu", None)


def test_engines_receive_with_the_trainers_buffer_size(tmp_path):
    template = EngineTemplate(
        model="m",
        vllm_args={},
        tensor_parallel_size=1,
        run_token="t",
        log_dir=str(tmp_path),
        startup_timeout=1,
        http_timeout=1,
        weight_dir=str(tmp_path / "w"),
        weight_buffer_bytes=1234,
    )
    actor = EngineActor(template.spec(0))
    calls = []

    class Client:
        def collective_rpc(self, method, kwargs=None):
            calls.append((method, kwargs))

    actor.client = Client()
    import vime.workers.engines as engines

    original = engines.swap_engine_weights
    engines.swap_engine_weights = lambda client, version, flush, receive, timing=None: receive()
    try:
        actor._probe = lambda: None
        actor.receive_nccl("[]", 1, True)
    finally:
        engines.swap_engine_weights = original
    assert calls == [("vime_receive_weights", {"metadata": "[]", "bucket_bytes": 1234})]
