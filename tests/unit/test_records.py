"""Record codec: every field round-trips through real straw storage; bad captures never publish."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from straw.errors import CorruptData

from vime.queue import records
from vime.queue.records import IncompleteCapture, decode_group, encode_group, expand, run_length, tensor_record
from vime.queue.rollout_queue import StoreOptions
from vime.queue.transport import StrawTransport
from vime.sample import Sample, Status

OWNER = {"task_id": "t", "attempt_id": "a"}


def full_sample(index=0, response_length=3):
    tokens = [5, 6, 7, 8, 9][: 2 + response_length]
    return Sample(
        group_index=4,
        index=index,
        prompt_index=17,
        prompt="p",
        label={"answer": "482"},
        tokens=tokens,
        response="xyz",
        response_length=response_length,
        loss_mask=[1, 0, 1][:response_length],
        reward=0.75,
        status=Status.TRUNCATED,
        rollout_log_probs=[-0.5, -1.25, -2.0][:response_length],
        weight_versions=[3, 3, 4][:response_length],
        metadata={"source_name": "math", "k": [1, 2]},
        source="dyn",
        session_id="s-1",
        rollout_routed_experts=torch.randint(0, 200, (len(tokens) - 1, 2, 4), dtype=torch.uint8),
        rollout_topk_token_ids=torch.randint(0, 100, (response_length, 128), dtype=torch.int32),
        rollout_topk_log_probs=torch.randn(response_length, 128),
        rollout_topp_ids=torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32),
        rollout_topp_offsets=torch.tensor([0, 2, 5, 6][: response_length + 1], dtype=torch.int64),
        rollout_topp_log_probs=torch.randn(6),
    )


def assert_same(a: Sample, b: Sample):
    for name in (
        "group_index",
        "index",
        "prompt_index",
        "label",
        "tokens",
        "response",
        "response_length",
        "loss_mask",
        "reward",
        "status",
        "weight_versions",
        "metadata",
        "source",
        "session_id",
    ):
        assert getattr(a, name) == getattr(b, name), name
    assert torch.tensor(a.rollout_log_probs, dtype=torch.float32).tolist() == b.rollout_log_probs
    for name in (
        "rollout_routed_experts",
        "rollout_topk_token_ids",
        "rollout_topk_log_probs",
        "rollout_topp_ids",
        "rollout_topp_offsets",
        "rollout_topp_log_probs",
    ):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


def test_run_length_versions():
    assert run_length([1, 1, 2, 2, 2, 5]) == [(1, 0, 2), (2, 2, 5), (5, 5, 6)]
    assert expand(run_length([0, 0, 1, 3, 3])) == [0, 0, 1, 3, 3]
    assert run_length([]) == []


def test_every_field_round_trips_through_straw(tmp_path):
    transport = StrawTransport(StoreOptions(str(tmp_path), "run"))
    group = [full_sample(0), full_sample(1, response_length=2)]
    ref = transport.publish(group, task_id="t", attempt_id="a", submission_id="sub")
    back = StrawTransport(StoreOptions(str(tmp_path), "run")).read(ref)
    assert len(back) == 2
    for a, b in zip(group, back):
        assert_same(a, b)
    assert back[0].source_name == "dyn"


def test_a_group_is_one_header_record_and_one_record_per_field():
    group = [full_sample(0), full_sample(1, response_length=2)]
    written = encode_group(group, "g", OWNER)
    assert [r.codec for r in written].count(records.HEADER_CODEC) == 1 and written[0].record_id == "g:h"
    assert written[0].metadata == {**records.GROUP_HEADER, **OWNER}
    assert len(written) == 1 + len({r.metadata.get("kind") for r in written[1:]})  # the header, then the fields
    assert [h.index for h in records.sample_headers(written)] == [0, 1]


def test_a_group_written_with_a_header_record_per_sample_is_still_read():
    """Groups published before the group header (one vime.sample.v1 record per sample) decode as they did: a queue
    written by an earlier vime is resumed by this one."""
    import msgspec
    from straw import Record

    group = [full_sample(0), full_sample(1, response_length=2)]
    header, *tensors = encode_group(group, "g", OWNER)
    per_sample = [
        Record(f"g:s{h.index}", msgspec.msgpack.encode(h), records.HEADER_CODEC, dict(OWNER))
        for h in records.sample_headers([header])
    ]
    for a, b in zip(group, decode_group(per_sample + tensors)):
        assert_same(a, b)
    assert [h.index for h in records.sample_headers(per_sample + tensors)] == [0, 1]
    unknown = msgspec.msgpack.encode(records.GroupHeader(schema=9, samples=[]))
    bad = Record("g:h", unknown, header.codec, header.metadata)
    with pytest.raises(CorruptData, match="unsupported group schema 9"):
        decode_group([bad, *tensors])


def test_the_codec_set_is_the_one_existing_queues_were_created_with(tmp_path, monkeypatch):
    """straw keeps a queue's codec set in its identity and refuses to recover it with another: a new codec would
    make every queue created by an earlier vime impossible to resume. The group header kept the codec."""
    from straw.errors import UnsafeRecovery

    import vime.queue.rollout_queue as rollout_queue
    from vime.queue.rollout_queue import StoreOptions, StrawRolloutQueue

    assert records.CODECS == ("bytes.v1", "json.v1", "tensor.v1", "vime.sample.v1")
    options = StoreOptions(str(tmp_path / "queue"), "run")
    StrawRolloutQueue.open(options, owner="test", lease_seconds=60).close()
    StrawRolloutQueue.open(options, owner="test", lease_seconds=60).close()  # recovered with the same set
    monkeypatch.setattr(rollout_queue, "CODECS", (*records.CODECS, "vime.other.v1"))
    with pytest.raises(UnsafeRecovery, match="identity/configuration mismatch"):
        StrawRolloutQueue.open(options, owner="test", lease_seconds=60)


def test_minimal_sample_round_trips_in_memory():
    sample = Sample(index=0, tokens=[1, 2], response_length=1, weight_versions=[0], reward=None)
    (back,) = decode_group(list(encode_group([sample], "x", OWNER)))
    assert back.loss_mask == [1] and back.rollout_log_probs is None and back.reward is None
    assert back.source_name == "unknown"


@pytest.mark.parametrize(
    "field, value",
    [
        ("rollout_routed_experts", torch.zeros(2, 2, 4, dtype=torch.uint8)),  # needs len(tokens) - 1 = 4 rows
        ("rollout_topk_token_ids", torch.zeros(2, 8, dtype=torch.int32)),  # needs response_length = 3 rows
        ("rollout_topp_offsets", torch.tensor([0, 1])),
        ("weight_versions", [0]),
    ],
)
def test_incomplete_capture_is_refused(field, value):
    sample = full_sample()
    setattr(sample, field, value)
    with pytest.raises(IncompleteCapture):
        encode_group([sample], "x", OWNER)


def test_corrupted_payload_is_detected(tmp_path):
    transport = StrawTransport(StoreOptions(str(tmp_path), "run"))
    sample = full_sample()
    sample.rollout_topk_log_probs = torch.full((3, 128), 0.123456789)
    ref = transport.publish([sample], task_id="t", attempt_id="a", submission_id="sub")
    pack = os.path.join(str(tmp_path), ref.manifest.segment.path)
    data = bytearray(open(pack, "rb").read())
    needle = torch.full((4,), 0.123456789).numpy().tobytes()
    at = data.find(needle)
    assert at >= 0
    data[at] ^= 0xFF
    with open(pack, "wb") as f:
        f.write(data)
    reader = StrawTransport(StoreOptions(str(tmp_path), "run"))
    with pytest.raises(CorruptData):
        reader.read(ref)
    with pytest.raises(CorruptData), reader.reading() as read:  # the trainer's path: one session for a step
        read(ref)


def test_groups_read_in_one_session_are_the_groups_published(tmp_path):
    """The trainer reads a step's groups in one straw read session (index of a pack read once): each group comes back
    whole and its own, in whatever order they are asked for, as a read of each alone gives it."""
    from vime.queue.transport import GroupToPublish

    writer = StrawTransport(StoreOptions(str(tmp_path), "run"))
    groups = []
    for g in range(5):
        samples = [full_sample(index=i) for i in range(3)]
        for s in samples:
            s.group_index, s.reward = g, float(10 * g + s.index)
        groups.append(GroupToPublish(samples, f"t{g}", "a", f"sub-{g}"))
    refs = writer.publish_groups(groups[:3]) + writer.publish_groups(groups[3:])  # two packs' worth of publications
    reader = StrawTransport(StoreOptions(str(tmp_path), "run"))
    order = [4, 0, 3, 1, 2, 0]
    with reader.reading() as read:
        together = [read(refs[g]) for g in order]
    alone = [reader.read(refs[g]) for g in order]
    assert [[(s.group_index, s.index, s.reward) for s in group] for group in together] == [
        [(g, i, float(10 * g + i)) for i in range(3)] for g in order
    ]
    assert [[s.tokens for s in group] for group in together] == [[s.tokens for s in group] for group in alone]


@pytest.mark.parametrize(
    "value",
    [
        np.arange(7, dtype=np.int32),
        np.array([], dtype=np.float32),
        np.ones((3, 2, 4), dtype=np.uint8),
        np.array([True, False]),
        np.linspace(-1, 1, 12, dtype=np.float64).reshape(3, 4)[:, ::2],  # not contiguous
        np.arange((5 << 20) // 8, dtype=np.int64),  # more than one 4 MiB chunk
    ],
)
def test_the_numpy_tensor_record_is_straw_s_own(value):
    """vime writes tensor.v1 records with numpy (no torch in the rollout workers); straw reads them as its own."""
    from straw.tensor import CHUNK_BYTES, tensor_record as straw_tensor_record

    ours = tensor_record(value, "r:x", kind="x")
    theirs = straw_tensor_record(torch.from_numpy(np.ascontiguousarray(value)), "r:x", kind="x")
    assert CHUNK_BYTES == records.CHUNK_BYTES
    assert (ours.record_id, ours.codec, ours.metadata) == (theirs.record_id, theirs.codec, theirs.metadata)
    assert bytes(ours.payload) == bytes(theirs.payload)


def test_a_rollout_worker_encodes_and_reads_a_group_without_importing_torch():
    """Encoding is what every rollout worker does for each group, and reading one the prefix of a continuation
    it resumes; torch's import would cost each worker ~1.7 CPU-s."""
    code = (
        "import sys\n"
        "from vime.queue.records import encode_group\n"
        "from vime.sample import Sample, Status\n"
        "s = Sample(tokens=[1, 2, 3], response_length=2, rollout_log_probs=[-0.5, -1.0], weight_versions=[1, 2],"
        " reward=1.0, status=Status.COMPLETED, teacher_log_probs=[-0.1, -0.2])\n"
        "records = encode_group([s], 'g', {'task_id': 't', 'attempt_id': 'a'})\n"
        "assert len(records) == 5, records\n"
        "from vime.queue.records import decode_group\n"
        "s.teacher_log_probs = None\n"  # a capture is decoded as a torch tensor: the trainer computes with it
        "[back] = decode_group(encode_group([s], 'g', {'task_id': 't', 'attempt_id': 'a'}))\n"
        "assert (back.tokens, back.rollout_log_probs, back.loss_mask) == ([1, 2, 3], [-0.5, -1.0], [1, 1]), back\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_capture_given_as_a_torch_tensor_keeps_its_dtype():
    sample = Sample(tokens=[1, 2, 3], response_length=2, weight_versions=[1, 1], status=Status.COMPLETED)
    sample.teacher_log_probs = torch.tensor([-0.5, -0.25], dtype=torch.bfloat16)
    [decoded] = decode_group(encode_group([sample], "g", OWNER))
    assert decoded.teacher_log_probs.dtype == torch.bfloat16
    assert decoded.teacher_log_probs.tolist() == [-0.5, -0.25]
