"""Debug-replay archives (DESIGN §7): one immutable file per trained step.

``--save-debug-rollout-data PATH`` writes, after each trained step, exactly the batch the trainer
trained (its samples in training order, every field, optional captures with their dtype and
shape), the groups it came from, the policy version it trained, the step's recorded metrics
(loss, grad_norm, ...) and the trainer's settings. ``--load-debug-rollout-data PATH`` trains on
these files again (``vime/replay.py``).

``PATH`` contains ``{rollout_id}`` (optionally with a format spec, ``{rollout_id:06d}``): the
0-based rollout id of the step, so step N of ``metrics.jsonl`` is rollout id N - 1.

File layout: ``MAGIC`` (8 bytes), the SHA-256 of the body (32 bytes), the body (msgpack of a
versioned :class:`DebugArchive`). A file is written under a temporary name in its folder, fsynced,
then linked to its final name, which fails if that name exists (no clobbering even between two
writers), and the folder is fsynced: an archive is complete or absent.

Immutability: an existing archive is never replaced. A resumed run retrains the steps after its
checkpoint from the same accepted groups; when the existing archive holds the same batch (same
rollout id, policy version and samples, compared by digest) the save is accepted and the file is
left as it is. Anything else is refused (:class:`ArchiveExists`) and the run stops.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import re
import uuid
from typing import Any

import msgspec
import numpy as np
import torch

from vime.config.base import ConfigError
from vime.queue.records import OPTIONAL_TENSORS as TENSOR_FIELDS
from vime.runtime.durable import fsync_path
from vime.sample import Sample, Status

SAVE_FLAG = "--save-debug-rollout-data"
LOAD_FLAG = "--load-debug-rollout-data"
MAGIC = b"VIMEDBG1"
SCHEMA = 1
PLACEHOLDER = re.compile(r"\{rollout_id(?::[^{}]*)?\}")


class ArchiveError(ConfigError):
    """A debug archive (or its path) is unusable; the message names the flag and the file."""


class ArchiveExists(ArchiveError):
    """The archive of this step exists and holds a different batch: archives are immutable."""


# ----------------------------------------------------------------------------- schema
class ArchivedTensor(msgspec.Struct, frozen=True):
    kind: str  # torch | numpy | list: what the sample held, restored as the same kind
    dtype: str  # torch dtype name without "torch." (numpy: numpy's name)
    shape: list[int]
    data: bytes  # C-order raw bytes


class ArchivedSample(msgspec.Struct, frozen=True):
    group_index: int
    index: int
    prompt_index: int
    prompt: Any
    label: Any
    tokens: list[int]
    response: str
    response_length: int
    loss_mask: list[int] | None
    reward: Any  # kept as given (float, int or None)
    status: str
    rollout_log_probs: list[float] | None
    weight_versions: list[int]
    metadata: dict[str, Any]
    source: str | None
    session_id: str | None
    tensors: dict[str, ArchivedTensor] = {}


class ArchivedGroup(msgspec.Struct, frozen=True):
    position: int  # acceptance position in the queue (-1 when unknown)
    task_id: str
    size: int  # its samples, consecutive in ``samples``


class DebugArchive(msgspec.Struct, frozen=True):
    schema: int
    rollout_id: int  # 0-based; the step is rollout_id + 1
    policy_version: int  # weight version the step trained (it published policy_version + 1)
    groups: list[ArchivedGroup]
    samples: list[ArchivedSample]  # exactly the trained batch, in training order
    samples_digest: str  # SHA-256 of the encoded samples
    metrics: dict[str, Any]  # what the trainer reported for the step (loss, grad_norm, ...)
    trainer: dict[str, Any]  # the trainer's settings (TorchTrainerSpec as plain values)
    argv: list[str]  # the command line of the recording run

    def grouped(self) -> list[list[Sample]]:
        """The samples as ``Sample`` objects, one list per group."""
        samples = [from_archived(s) for s in self.samples]
        groups, start = [], 0
        for group in self.groups:
            groups.append(samples[start : start + group.size])
            start += group.size
        return groups


# ----------------------------------------------------------------------------- samples
def _plain(value: Any) -> Any:
    """msgspec hook: numpy / torch scalars and arrays inside metadata or labels as plain values."""
    if isinstance(value, (np.generic, torch.Tensor, np.ndarray)):
        return value.tolist()
    raise NotImplementedError(f"cannot archive a value of type {type(value).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain)


def _encode_tensor(value: Any) -> ArchivedTensor:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        return ArchivedTensor(
            "torch", str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw.numpy().tobytes()
        )
    kind = "numpy" if isinstance(value, np.ndarray) else "list"
    array = np.ascontiguousarray(np.asarray(value))
    if array.dtype == object:
        raise ValueError("a ragged or non-numeric capture cannot be archived")
    return ArchivedTensor(kind, array.dtype.str, list(array.shape), array.tobytes())


def _decode_tensor(item: ArchivedTensor) -> Any:
    if item.kind == "torch":
        dtype = getattr(torch, item.dtype)
        if not item.data:
            return torch.empty(item.shape, dtype=dtype)
        return torch.frombuffer(bytearray(item.data), dtype=torch.uint8).view(dtype).reshape(item.shape)
    array = np.frombuffer(item.data, dtype=np.dtype(item.dtype)).reshape(item.shape).copy()
    return array if item.kind == "numpy" else array.tolist()


def to_archived(sample: Sample) -> ArchivedSample:
    tensors = {
        name: _encode_tensor(getattr(sample, name)) for name in TENSOR_FIELDS if getattr(sample, name) is not None
    }
    return ArchivedSample(
        group_index=sample.group_index,
        index=sample.index,
        prompt_index=sample.prompt_index,
        prompt=sample.prompt,
        label=sample.label,
        tokens=[int(t) for t in sample.tokens],
        response=sample.response,
        response_length=sample.response_length,
        loss_mask=None if sample.loss_mask is None else [int(m) for m in sample.loss_mask],
        reward=sample.reward.item() if isinstance(sample.reward, (np.generic, torch.Tensor)) else sample.reward,
        status=Status(sample.status).value,
        rollout_log_probs=None if sample.rollout_log_probs is None else [float(x) for x in sample.rollout_log_probs],
        weight_versions=[int(v) for v in sample.weight_versions],
        metadata=sample.metadata,
        source=sample.source,
        session_id=sample.session_id,
        tensors=tensors,
    )


def from_archived(item: ArchivedSample) -> Sample:
    sample = Sample(
        group_index=item.group_index,
        index=item.index,
        prompt_index=item.prompt_index,
        prompt=item.prompt,
        label=item.label,
        tokens=list(item.tokens),
        response=item.response,
        response_length=item.response_length,
        loss_mask=None if item.loss_mask is None else list(item.loss_mask),
        reward=item.reward,
        status=Status(item.status),
        rollout_log_probs=None if item.rollout_log_probs is None else list(item.rollout_log_probs),
        weight_versions=list(item.weight_versions),
        metadata=dict(item.metadata),
        source=item.source,
        session_id=item.session_id,
    )
    for name, tensor in item.tensors.items():
        setattr(sample, name, _decode_tensor(tensor))
    return sample


def samples_digest(samples: list[ArchivedSample]) -> str:
    return hashlib.sha256(_ENCODER.encode(samples)).hexdigest()


def build_archive(
    *,
    rollout_id: int,
    policy_version: int,
    groups: list[tuple[int, str, list[Sample]]],
    metrics: dict[str, float],
    trainer: dict[str, Any],
    argv: list[str],
) -> DebugArchive:
    """``groups``: (queue position, task id, samples) in training order."""
    try:
        samples = [to_archived(s) for _, _, members in groups for s in members]
        digest = samples_digest(samples)
    except (TypeError, ValueError, NotImplementedError) as error:
        raise ArchiveError(SAVE_FLAG, f"rollout {rollout_id}: a sample cannot be archived ({error})") from None
    return DebugArchive(
        schema=SCHEMA,
        rollout_id=rollout_id,
        policy_version=policy_version,
        groups=[ArchivedGroup(position, task_id, len(members)) for position, task_id, members in groups],
        samples=samples,
        samples_digest=digest,
        metrics=msgspec.to_builtins(metrics, enc_hook=_plain),
        trainer=msgspec.to_builtins(trainer, enc_hook=_loose),
        argv=list(argv),
    )


# ----------------------------------------------------------------------------- paths
def check_template(template: str, flag: str) -> None:
    """A path with ``{rollout_id}`` that formats, on a local (or mounted) filesystem."""
    if "://" in template:
        raise ConfigError(flag, f"{template!r}: give a local or mounted path (archives are renamed into place)")
    if not PLACEHOLDER.search(template):
        raise ConfigError(
            flag, f"{template!r} must contain '{{rollout_id}}' (one file per step), e.g. /data/debug/{{rollout_id}}.vdr"
        )
    try:
        template.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as error:
        raise ConfigError(flag, f"{template!r} does not format with only rollout_id: {error!r}") from None


def archive_path(template: str, rollout_id: int) -> str:
    return os.path.abspath(template.format(rollout_id=rollout_id))


def existing_archives(template: str) -> dict[int, str]:
    """rollout id -> path of every archive file the template names, by rollout id."""
    if not os.path.isabs(template):
        template = os.path.join(os.getcwd(), template)
    pieces = [p.replace("{{", "{").replace("}}", "}") for p in PLACEHOLDER.split(template)]
    regex = re.compile(r"(\d+)".join(re.escape(p) for p in pieces))
    found = {}
    for hit in glob.glob("*".join(glob.escape(p) for p in pieces)):
        match = regex.fullmatch(hit)
        if not match or len(set(match.groups())) != 1 or not os.path.isfile(hit):
            continue
        rollout_id = int(match.group(1))
        if archive_path(template, rollout_id) == os.path.abspath(hit):  # e.g. "7" vs "007" with {rollout_id:03d}
            found[rollout_id] = os.path.abspath(hit)
    return dict(sorted(found.items()))


# ----------------------------------------------------------------------------- files
def encode_archive(archive: DebugArchive) -> bytes:
    body = _ENCODER.encode(archive)
    return MAGIC + hashlib.sha256(body).digest() + body


def decode_archive(data: bytes, path: str, flag: str = LOAD_FLAG) -> DebugArchive:
    if data[: len(MAGIC)] != MAGIC:
        raise ArchiveError(flag, f"{path} is not a vime debug archive")
    body = data[len(MAGIC) + 32 :]
    if hashlib.sha256(body).digest() != data[len(MAGIC) : len(MAGIC) + 32]:
        raise ArchiveError(flag, f"{path} is damaged (its checksum does not match)")
    try:
        archive = msgspec.msgpack.decode(body, type=DebugArchive)
    except msgspec.DecodeError as error:
        raise ArchiveError(flag, f"{path}: unreadable archive ({error})") from None
    if archive.schema != SCHEMA:
        raise ArchiveError(flag, f"{path}: archive schema {archive.schema}, this vime reads {SCHEMA}")
    return archive


def read_archive(path: str, flag: str = LOAD_FLAG) -> DebugArchive:
    try:
        with open(path, "rb") as f:
            return decode_archive(f.read(), path, flag)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as error:
        raise ArchiveError(flag, f"cannot read {path}: {error.strerror}") from None


def _same_batch(existing: DebugArchive, new: DebugArchive) -> bool:
    return (existing.rollout_id, existing.policy_version, existing.samples_digest) == (
        new.rollout_id,
        new.policy_version,
        new.samples_digest,
    )


def write_archive(path: str, archive: DebugArchive) -> str:
    """Write ``archive`` at ``path`` once. Returns "written", or "kept" when ``path`` already holds
    the same batch (a step retrained after a resume); raises ArchiveExists otherwise."""
    if os.path.lexists(path):
        _refuse_unless_same(path, archive)
        return "kept"
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise ArchiveError(SAVE_FLAG, f"cannot create the folder of {path}: {error.strerror}") from None
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(encode_archive(archive))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists: never clobbers
        except FileExistsError:
            _refuse_unless_same(path, archive)
            return "kept"
        except OSError:  # a filesystem without hard links: rename (the check above guards it)
            os.replace(tmp, path)
        fsync_path(folder)
    except OSError as error:
        raise ArchiveError(SAVE_FLAG, f"cannot write {path}: {error.strerror or error}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return "written"


def _refuse_unless_same(path: str, archive: DebugArchive) -> None:
    if not os.path.isfile(path):
        raise ArchiveExists(SAVE_FLAG, f"{path} exists and is not an archive file; archives are never replaced")
    try:
        existing = read_archive(path, SAVE_FLAG)
    except ArchiveError as error:
        raise ArchiveExists(
            SAVE_FLAG,
            f"{path} already exists and is not a readable archive ({error.message}); "
            "archives are never replaced: move it away or give another path",
        ) from None
    if not _same_batch(existing, archive):
        if existing.rollout_id != archive.rollout_id:
            what = f"rollout {existing.rollout_id}, not {archive.rollout_id}"
        elif existing.policy_version != archive.policy_version:
            what = f"a batch trained on policy v{existing.policy_version}, this step trains v{archive.policy_version}"
        else:
            what = (
                f"other samples than this step trained ({len(existing.samples)} recorded, {len(archive.samples)} now)"
            )
        raise ArchiveExists(
            SAVE_FLAG,
            f"{path} already exists and holds {what}. Archives are immutable (only a step "
            "retrained after a resume may meet an identical one): move the old archives "
            "away or give another path",
        )


def _same(a: Any, b: Any, rel_tol: float = 0.0) -> bool:
    """Equality of metric values: bit for bit (numbers as float64 bits, NaN equal to NaN), or within
    ``rel_tol`` relative (and as much absolute) when it is not 0."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if np.float64(a).tobytes() == np.float64(b).tobytes() or (a != a and b != b):
            return True
        return rel_tol > 0 and abs(a - b) <= rel_tol * max(abs(a), abs(b), 1.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rel_tol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, rel_tol) for x, y in zip(a, b))
    return a == b


def metric_differences(recorded: dict[str, Any], replayed: dict[str, Any], rel_tol: float = 0.0) -> list[str]:
    """Names of the metrics that differ (timings, ``*_seconds``, excluded): bit for bit, or beyond ``rel_tol``
    relative when the recording summed in another order (several trainer ranks)."""
    names = {k for k in (*recorded, *replayed) if not k.endswith("_seconds")}
    return [
        name
        for name in sorted(names)
        if name not in recorded or name not in replayed or not _same(recorded[name], replayed[name], rel_tol)
    ]


def _loose(value: Any) -> Any:
    """msgspec hook for settings: anything without a plain form is recorded by its repr."""
    try:
        return _plain(value)
    except NotImplementedError:
        return vars(value) if hasattr(value, "__dict__") and not callable(value) else repr(value)


def spec_as_dict(spec: Any) -> dict[str, Any]:
    """A trainer spec dataclass as plain values (for the record and for comparing with a replay)."""
    plain = msgspec.msgpack.encode({f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}, enc_hook=_loose)
    return msgspec.msgpack.decode(plain)  # tuples become lists, as in a stored archive
