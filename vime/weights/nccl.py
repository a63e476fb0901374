"""NCCL transport of weights (``--update-weight-transport nccl``; GPU only; docs/weights.md).

The trainer (rank 0) and every worker of every engine (ranks 1..) form one NCCL group outside
any ``torch.distributed`` default group: vLLM's ``StatelessProcessGroup`` (a TCP store for the
rendezvous) and ``PyNcclCommunicator`` (NCCL on one device), as vLLM's RLHF examples do. Each
synchronisation broadcasts every parameter from rank 0, in the order of a metadata list (name,
dtype, shape) that both sides hold; each engine worker receives into a fresh buffer and hands the
tensors to vLLM's weight loader (``reload_weights`` with an iterator: vLLM's in-place reload,
which also re-runs any post-load processing), as they arrive. ``--update-weight-buffer-size``
groups consecutive tensors into buckets of at most that many bytes, each broadcast as one flat
buffer (``bucket_plan``): fewer, larger NCCL calls for models of many small tensors (MoE experts);
a tensor larger than the buffer is broadcast alone.

The engine side is a vLLM worker extension (``--worker-extension-cls``, added to the engine's
flags by ``WeightSyncConfig.engine_vllm_args``): its methods are called through vLLM's
``/collective_rpc``, which runs them on every worker of the engine.

NCCL does not allow two ranks of one group on the same GPU ("Duplicate GPU detected"): the
trainer and the engines need GPUs of their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgspec

WORKER_EXTENSION = "vime.weights.nccl.NcclWeightReceiver"
FLAG = "--update-weight-transport"


class TensorMeta(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: list[int]


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_metadata(named_tensors: Iterable[tuple[str, Any]]) -> list[TensorMeta]:
    """Metadata of ``(name, tensor)`` pairs, in order; names must be unique."""
    metas, seen = [], set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        metas.append(TensorMeta(name, dtype_name(tensor.dtype), [int(n) for n in tensor.shape]))
    return metas


def encode_metadata(metas: Sequence[TensorMeta]) -> str:
    """A JSON string: vLLM's ``/collective_rpc`` forwards JSON arguments only."""
    return msgspec.json.encode(list(metas)).decode()


def decode_metadata(text: str) -> list[TensorMeta]:
    return msgspec.json.decode(text, type=list[TensorMeta])


def torch_dtype(name: str):
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def group_layout(workers_per_engine: Sequence[int]) -> tuple[int, list[int]]:
    """(world size, first rank of each engine): the trainer is rank 0, then each engine's workers."""
    offsets, next_rank = [], 1
    for workers in workers_per_engine:
        if workers < 1:
            raise ValueError(f"an engine has {workers} workers")
        offsets.append(next_rank)
        next_rank += workers
    return next_rank, offsets


BUCKET_ALIGN = 16  # bytes: each tensor of a bucket starts at a multiple (a view in any dtype is aligned)


def tensor_nbytes(meta: TensorMeta) -> int:
    count = 1
    for n in meta.shape:
        count *= int(n)
    return count * torch_dtype(meta.dtype).itemsize


def bucket_plan(sizes: Sequence[int], bucket_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive tensors (their byte sizes, in broadcast order) grouped into buckets of at most
    ``bucket_bytes`` bytes (``--update-weight-buffer-size``; each tensor's offset aligned to
    ``BUCKET_ALIGN``); a tensor that does not fit an empty bucket goes alone; <= 0: one tensor per
    bucket. Returns, per bucket, (index, byte offset in the bucket, bytes) of each tensor."""
    buckets: list[list[tuple[int, int, int]]] = []
    used = 0
    for index, size in enumerate(sizes):
        offset = -(-used // BUCKET_ALIGN) * BUCKET_ALIGN
        if not buckets or bucket_bytes <= 0 or (buckets[-1] and offset + size > bucket_bytes):
            buckets.append([])
            offset = 0
        buckets[-1].append((index, offset, int(size)))
        used = offset + size
    return buckets


def bucket_bytes_of(bucket: Sequence[tuple[int, int, int]]) -> int:
    _, offset, size = bucket[-1]
    return offset + size


def broadcast_buckets(
    communicator,
    named_tensors: Iterable[tuple[str, Any]],
    metadata: Sequence[TensorMeta],
    bucket_bytes: int,
    device,
    stream,
) -> dict[str, float]:
    """Rank 0's side: broadcast the tensors (checked against ``metadata``) bucket by bucket."""
    import torch

    pairs = iter(named_tensors)
    sent, size, calls = 0, 0, 0
    for bucket in bucket_plan([tensor_nbytes(meta) for meta in metadata], bucket_bytes):
        tensors = []
        for index, _, _ in bucket:
            try:
                name, tensor = next(pairs)
            except StopIteration:
                raise ValueError(f"{len(metadata)} tensors in the metadata, {index} given") from None
            check_tensor(metadata[index], name, tensor)
            tensors.append(tensor.detach().to(device).contiguous())
        if len(tensors) == 1:
            buffer = tensors[0]
        else:
            buffer = torch.empty(bucket_bytes_of(bucket), dtype=torch.uint8, device=device)
            for (_, offset, nbytes), tensor in zip(bucket, tensors):
                buffer[offset : offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        communicator.broadcast(buffer, src=0, stream=stream)
        calls += 1
        sent += len(tensors)
        size += sum(t.numel() * t.element_size() for t in tensors)
    if next(pairs, None) is not None:
        raise ValueError(f"more tensors given than the {len(metadata)} of the metadata")
    return {"tensors": float(sent), "bytes": float(size), "broadcasts": float(calls)}


def receive_buckets(group, metas: Sequence[TensorMeta], bucket_bytes: int, device, stream) -> Iterator[tuple[str, Any]]:
    """An engine worker's side of :func:`broadcast_buckets`: (name, tensor) as each bucket arrives."""
    import torch

    for bucket in bucket_plan([tensor_nbytes(meta) for meta in metas], bucket_bytes):
        if len(bucket) == 1:
            meta = metas[bucket[0][0]]
            tensor = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device=device)
            group.broadcast(tensor, src=0, stream=stream)
            yield meta.name, tensor
            continue
        buffer = torch.empty(bucket_bytes_of(bucket), dtype=torch.uint8, device=device)
        group.broadcast(buffer, src=0, stream=stream)
        for index, offset, nbytes in bucket:
            meta = metas[index]
            yield meta.name, buffer[offset : offset + nbytes].view(torch_dtype(meta.dtype)).view(meta.shape)


def tensor_sha256(tensor) -> str:
    """sha256 of a tensor's bytes in its own dtype (copied to the CPU)."""
    import torch

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def init_group(master_address: str, master_port: int, rank: int, world_size: int, device):
    """Join the trainer-engine NCCL group as ``rank``; returns vLLM's ``PyNcclCommunicator``.

    vLLM pins some NCCL settings in its own processes; its helper (0.3x) creates the communicator
    without them so that a peer outside vLLM does not hang. Older versions: the plain recipe.
    """
    try:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    except ImportError:
        stateless_init_process_group = None
    if stateless_init_process_group is not None:
        return stateless_init_process_group(master_address, master_port, rank, world_size, device)
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=device)


def _destroy(communicator) -> None:
    destroy = getattr(communicator, "destroy", None)
    if destroy is not None:
        with contextlib.suppress(Exception):
            destroy()


class NcclWeightSender:
    """The trainer's end (rank 0). ``open`` blocks until every engine worker has joined."""

    def __init__(self, device=None):
        self.device = device
        self.communicator = None
        self.world_size = 0

    def open(self, master_address: str, master_port: int, world_size: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"{FLAG} nccl: the trainer process sees no CUDA device")
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.device is None else torch.device(self.device)
        )
        self.communicator = init_group(master_address, master_port, 0, world_size, self.device)
        self.world_size = world_size

    def send(
        self, named_tensors: Iterable[tuple[str, Any]], metadata: Sequence[TensorMeta], *, bucket_bytes: int = 0
    ) -> dict[str, float]:
        """Broadcast the tensors in ``metadata`` order (checked: same names, dtypes, shapes), in
        buckets of at most ``bucket_bytes`` (``--update-weight-buffer-size``; 0: one per tensor)."""
        import torch

        if self.communicator is None:
            raise RuntimeError("NcclWeightSender.send before open")
        stream = torch.cuda.current_stream(self.device)
        report = broadcast_buckets(self.communicator, named_tensors, metadata, bucket_bytes, self.device, stream)
        torch.cuda.synchronize(self.device)
        return report

    def close(self) -> None:
        if self.communicator is not None:
            _destroy(self.communicator)
            self.communicator = None


def check_tensor(meta: TensorMeta, name: str, tensor) -> None:
    if (name, dtype_name(tensor.dtype), [int(n) for n in tensor.shape]) != (meta.name, meta.dtype, meta.shape):
        raise ValueError(
            f"tensor {name} ({dtype_name(tensor.dtype)}, {list(tensor.shape)}) differs from the "
            f"metadata the engines received: {meta.name} ({meta.dtype}, {meta.shape})"
        )


class NcclWeightReceiver:
    """vLLM worker extension: mixed into every worker of an engine (``--worker-extension-cls``).

    Method names carry a ``vime_`` prefix: vLLM refuses an extension whose names collide with
    the worker's own.
    """

    def vime_join_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank + int(rank_offset)
        self._vime_group = init_group(master_address, int(master_port), rank, int(world_size), self.device)

    def vime_receive_weights(self, metadata: str, checksums: bool = False, bucket_bytes: int = 0) -> dict:
        """Receive every tensor of ``metadata`` (JSON from ``encode_metadata``) and load it;
        ``bucket_bytes`` must be the trainer's (``--update-weight-buffer-size``).

        Returns {"tensors": n, "checksums": {name: sha256 of the bytes received}} (checksums only
        when asked: they copy every tensor to the CPU).
        """
        import torch

        group = getattr(self, "_vime_group", None)
        if group is None:
            raise RuntimeError("vime_receive_weights before vime_join_weight_group")
        metas = decode_metadata(metadata)
        digests: dict[str, str] = {}
        stream = torch.cuda.current_stream()

        def received() -> Iterator[tuple[str, Any]]:
            for name, tensor in receive_buckets(group, metas, int(bucket_bytes), self.device, stream):
                if checksums:
                    digests[name] = tensor_sha256(tensor)
                yield name, tensor

        tensors = received()
        self._vime_load(tensors)
        for _ in tensors:  # a loader that stopped early must not leave the trainer's broadcast waiting
            pass
        torch.cuda.synchronize()
        return {"tensors": len(metas), "checksums": digests}

    def _vime_load(self, weights: Iterator[tuple[str, Any]]) -> None:
        runner_reload = getattr(self.model_runner, "reload_weights", None)
        if runner_reload is not None and "weights_iterator" in inspect.signature(runner_reload).parameters:
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:  # vLLM before in-place reloading: the model's loader directly
            self.get_model().load_weights(weights=weights)

    def vime_param_checksums(self) -> dict[str, str]:
        """sha256 of every parameter of the served model, by vLLM's (possibly fused) names."""
        model = self.get_model()
        return {name: tensor_sha256(param) for name, param in model.named_parameters()}

    def vime_leave_weight_group(self) -> None:
        group = getattr(self, "_vime_group", None)
        if group is not None:
            _destroy(group)
            self._vime_group = None
