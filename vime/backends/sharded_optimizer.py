"""ZeRO-1 for the Megatron backend: ``--use-distributed-optimizer`` with ``--train-backend megatron``.

Each data-parallel rank keeps the optimizer's state (AdamW's two moments, SGD's momentum) and, with ``--bf16``,
the float32 master weights only for its own part of the parameters, as megatron-core's DistributedOptimizer does.

Why not megatron-core's DistributedOptimizer: it allocates on CUDA and runs on megatron-core's own
DistributedDataParallel (contiguous gradient buffers in CUDA memory, bucketed reduce-scatters), which vime does not
use: vime reduces the gradients itself (``MegatronBackend.sum_gradients`` / ``finish_gradients``), on gloo over CPU
as on NCCL. Here the gradients are all-reduced exactly as without the flag (every rank holds the whole summed
gradient, and clipping by the global norm is unchanged), and only the optimizer's step and state are split. (gloo
does reduce-scatter too, ``reduce_scatter_tensor``, checked with torch 2.x here: summing each rank's range only,
megatron-core's way, would also shard the float32 gradients of --bf16's stand-ins; not done yet.)

The split (:class:`FlatLayout`): the model's parameters, in ``module.parameters()`` order, flattened end to end,
padded to a multiple of the N ranks and cut into N equal contiguous ranges; rank r owns range r. The N ranks are
those that sum the parameters' gradients (a :class:`ShardGroup`): under expert parallelism the routed experts are
laid out and split on their own over the ranks holding the same experts, the other parameters over the data x
context parallel ranks, as megatron-core's distributed optimizer splits them. A parameter's
overlap with a rank's range is a *piece*; a real torch optimizer (``--optimizer``: AdamW or SGD, the command line's
settings, schedule and clipping) steps this rank's pieces. The update is elementwise, so stepping pieces is
stepping the whole tensors (a parameter without a gradient keeps ``grad is None`` and is skipped, as unsharded).

- float32 model: a piece is a view of its parameter's own storage, so the optimizer updates this rank's part of the
  model in place; nothing is copied.
- ``--bf16``: the model's parameters become bf16 (forward and backward in bf16) and a piece is a float32 master of
  its part. Gradients still add up in float32: each parameter's bf16 gradient is moved, upcast, after every
  backward into the float32 gradient of a stand-in tensor (:func:`gradient_slot`, holding no weights), and the
  stand-ins are what the backend's reductions and clipping receive (as the masters are without the flag).

After the step the ranks all-gather their pieces (float32, in chunks of :data:`GATHER_CHUNK_ELEMENTS` per rank)
into every rank's model parameters (rounded to bf16 with ``--bf16``).

Memory per parameter and rank, AdamW over N ranks: float32, 4 (weights) + 4 (gradient) + 8/N (moments), against
4 + 4 + 8 unsharded; ``--bf16``, 2 + 4 + (4 + 8)/N, against 2 + 4 + 4 + 8. The gradients are freed once the step
has read them, before the all-gather, which holds one chunk of the range at a time.

Checkpoints keep the unsharded format (``megatron_checkpoint``), so that they load at another data-parallel size
and with or without the flag: :meth:`ShardedOptimizer.whole_state` all-gathers the float32 weights and the
optimizer's state into an unsharded optimizer of the same kind for the time of a save or a load, i.e. every rank
holds for that time what an unsharded rank holds always (12 bytes per parameter with AdamW), then frees it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterator

import torch

from vime.backends.data_parallel import DataParallel
from vime.backends.lr_schedule import LRSchedule
from vime.backends.precision import accumulate_grad_into, copy_parameter_attributes, installed, parameter_places
from vime.backends.torch_backend import ModelRole, make_optimizer
from vime.backends.trainer_spec import TorchTrainerSpec
from vime.config.roles import RoleOverrides

# Elements each rank contributes to one all-gather: bounds the receive buffer to N x this many float32 values.
GATHER_CHUNK_ELEMENTS = 1 << 24


class StateAccess(enum.Enum):
    """What a caller does with a role's whole training state (:meth:`ShardedOptimizer.whole_state`)."""

    READ = "read"  # a checkpoint is written from it
    WRITE = "write"  # a checkpoint is loaded into it: it becomes the role's state


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements ``start:stop`` of parameter ``index`` (flattened), at ``flat_start`` in the flat layout."""

    index: int
    start: int
    stop: int
    flat_start: int


class FlatLayout:
    """Parameters of ``numels`` elements end to end, cut into ``ranks`` equal ranges (the last ones padded).
    ``indices``: each parameter's position in the model's list, which the segments name (default: its position
    here)."""

    def __init__(self, numels: list[int], ranks: int, indices: list[int] | None = None):
        self.numels = numels
        self.indices = list(range(len(numels))) if indices is None else indices
        self.offsets = [0]
        for n in numels:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]
        self.shard_size = -(-self.total // ranks)

    def segments(self, flat_start: int, length: int) -> Iterator[Segment]:
        """The parts of parameters that flat elements ``flat_start : flat_start + length`` cover."""
        flat_stop = min(flat_start + length, self.total)
        index = bisect.bisect_right(self.offsets, flat_start) - 1
        while flat_start < flat_stop and index < len(self.numels):
            begin = self.offsets[index]
            stop = min(flat_stop, self.offsets[index + 1])
            if stop > flat_start:
                yield Segment(self.indices[index], flat_start - begin, stop - begin, flat_start)
            flat_start = max(flat_start, stop)
            index += 1

    def pieces(self, rank: int) -> list[Segment]:
        """The segments rank ``rank`` owns."""
        return list(self.segments(rank * self.shard_size, self.shard_size))


def gradient_slot(param: torch.Tensor) -> torch.nn.Parameter:
    """A float32 stand-in for ``param`` in the gradient reductions: its shape, its megatron-core attributes
    (``tensor_model_parallel``, ``sequence_parallel``, ``shared``, ...), a full float32 ``.grad``, and no weights
    (one element seen through zero strides: ``zeros_like`` still gives a full, ordinary tensor)."""
    holder = torch.zeros((), dtype=torch.float32, device=param.device).expand(param.shape)
    slot = torch.nn.Parameter(holder, requires_grad=param.requires_grad)
    copy_parameter_attributes(param, slot)
    return slot


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a contiguous tensor's elements (what pieces and gathers index)."""
    if not tensor.is_contiguous():
        raise ValueError("--use-distributed-optimizer: a parameter is not contiguous and cannot be split")
    return tensor.view(-1)


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """Parameters whose gradients ``dp``'s ranks sum (each of those ranks holds the same copy of them): their
    optimizer state (and with --bf16 their float32 masters) is split over those ranks. Under expert parallelism the
    routed experts are a group of their own (megatron-core's expert-data-parallel ranks), the other parameters
    another (data x context parallel ranks)."""

    params: list[torch.nn.Parameter]
    dp: DataParallel


class _Shard:
    """One :class:`ShardGroup` laid out flat over its ranks: this rank's pieces of it, the optimizer tensors of
    those pieces (``piece_params``, set by the optimizer) and the all-gather that gives every rank the whole."""

    def __init__(self, indices: list[int], numels: list[int], dp: DataParallel):
        self.indices, self.dp = indices, dp
        self.layout = FlatLayout(numels, dp.size, indices)
        self.pieces = self.layout.pieces(dp.rank)
        self.piece_params: list[torch.nn.Parameter] = []
        if not self.pieces:
            raise ValueError(
                f"--use-distributed-optimizer: {self.layout.total} parameter elements leave rank {dp.rank} of the "
                f"{dp.size} that share them nothing to own"
            )

    def all_gather(self, values_of: Callable[[torch.Tensor], torch.Tensor | None], targets: list[torch.Tensor]):
        """Every rank's ``values_of(piece)`` (None: zeros) into ``targets`` (tensors shaped like the model's
        parameters, indexed as they are; any dtype: the float32 values are cast)."""
        size = self.layout.shard_size
        first = self.dp.rank * size
        for start in range(0, size, GATHER_CHUNK_ELEMENTS):
            chunk = self._chunk(values_of, first + start, min(GATHER_CHUNK_ELEMENTS, size - start))
            received = [chunk]
            if self.dp.size > 1:
                import torch.distributed as dist

                received = [torch.empty_like(chunk) for _ in range(self.dp.size)]
                dist.all_gather(received, chunk, group=self.dp.group)
            for rank, values in enumerate(received):
                for s in self.layout.segments(rank * size + start, len(values)):
                    at = s.flat_start - rank * size - start
                    _flat(targets[s.index].data)[s.start : s.stop].copy_(values[at : at + s.stop - s.start])

    def _chunk(self, values_of, flat_start: int, length: int) -> torch.Tensor:
        """Elements ``flat_start`` to ``flat_start + length`` of the flat layout, within this rank's range, as
        float32: its pieces' ``values_of`` (zeros where None, and past the last parameter). One chunk at a time,
        so that a gather holds no copy of the rank's whole range."""
        chunk = torch.zeros(length, dtype=torch.float32, device=self.piece_params[0].device)
        end = flat_start + length
        for segment, piece in zip(self.pieces, self.piece_params):
            low = max(flat_start, segment.flat_start)
            high = min(end, segment.flat_start + segment.stop - segment.start)
            if low < high and (values := values_of(piece)) is not None:
                chunk[low - flat_start : high - flat_start].copy_(
                    _flat(values)[low - segment.flat_start : high - segment.flat_start]
                )
        return chunk

    def max_over_ranks(self, per_param: torch.Tensor) -> None:
        """``per_param``'s columns of this group's parameters, set to their maximum over the group's ranks."""
        if self.dp.size > 1:
            import torch.distributed as dist

            columns = per_param[:, self.indices].contiguous()
            dist.all_reduce(columns, op=dist.ReduceOp.MAX, group=self.dp.group)
            per_param[:, self.indices] = columns


class ShardedOptimizer:
    """This rank's part of ``module``'s optimizer (module docstring); the backend's training loop uses it as it
    uses a torch optimizer (``param_groups``, ``state``, ``zero_grad``, ``step``).

    ``make_optimizer(tensors)``: the torch optimizer of ``--optimizer`` over ``tensors``, built once over this
    rank's pieces and again over whole float32 tensors for checkpoints (:meth:`whole_state`). ``groups``: which
    ranks share which parameters (every parameter of ``module`` in exactly one group)."""

    def __init__(
        self,
        module: torch.nn.Module,
        make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        groups: list[ShardGroup],
        *,
        bf16: bool,
    ):
        self.module, self.make_optimizer, self.bf16 = module, make_optimizer, bf16
        self.model_params = list(module.parameters())  # a tied parameter once, as the unsharded optimizer has it
        self._places = parameter_places(module, self.model_params)  # where gathered tensors stand in (weights_as)
        self.shards = self._split(groups)
        for shard in self.shards:
            if bf16:  # the masters start as the float32 weights, before the model is rounded to bf16
                values = [_flat(self.model_params[s.index].detach())[s.start : s.stop].clone() for s in shard.pieces]
            else:  # views of the parameters' own storage
                values = [_flat(self.model_params[s.index].data)[s.start : s.stop] for s in shard.pieces]
            shard.piece_params = [self._piece_param(v, s) for v, s in zip(values, shard.pieces)]
        # Every shard's pieces, in the shards' order: what the torch optimizer steps.
        self.pieces = [segment for shard in self.shards for segment in shard.pieces]
        self.piece_params = [piece for shard in self.shards for piece in shard.piece_params]
        if bf16:
            self.params = [gradient_slot(p) for p in self.model_params]
            for p, slot in zip(self.model_params, self.params):
                p.data = p.data.to(torch.bfloat16)
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(accumulate_grad_into(slot))
        else:
            self.params = self.model_params  # the float32 parameters carry their own gradients
        self.optimizer = make_optimizer(self.piece_params)

    def _split(self, groups: list[ShardGroup]) -> list[_Shard]:
        position = {id(p): i for i, p in enumerate(self.model_params)}
        shards, covered = [], []
        for group in groups:
            indices = [position[id(p)] for p in group.params if id(p) in position]
            if len(indices) != len(group.params):
                raise ValueError("--use-distributed-optimizer: a shard group holds a tensor that is not the model's")
            if indices:  # e.g. a pipeline stage without MoE layers has no experts to split
                shards.append(_Shard(indices, [self.model_params[i].numel() for i in indices], group.dp))
                covered += indices
        if sorted(covered) != list(range(len(self.model_params))):
            raise ValueError("--use-distributed-optimizer: every parameter must be in exactly one shard group")
        return shards

    def _piece_param(self, values: torch.Tensor, segment: Segment) -> torch.nn.Parameter:
        # nn.Parameter over a view shares the parameter's storage (the float32 case): the step updates it in place.
        return torch.nn.Parameter(values, requires_grad=self.model_params[segment.index].requires_grad)

    # ------------------------------------------------------------------ the optimizer's interface
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's pieces with their part of the (reduced, clipped) gradients, then all-gather every
        rank's pieces into the model's parameters."""
        for segment, piece in zip(self.pieces, self.piece_params):
            grad = self.params[segment.index].grad
            piece.grad = None if grad is None else _flat(grad)[segment.start : segment.stop]
        self.optimizer.step()
        # The gradients are spent (the next step's zero_grad would drop them): freed before the gather needs room.
        for piece in self.piece_params:
            piece.grad = None
        for p in self.params:
            p.grad = None
        self._all_gather(lambda piece: piece, self.model_params)

    def gradient_holders(self) -> dict[int, torch.Tensor]:
        """id of each model parameter -> the tensor whose gradient the reductions receive in its place (--bf16)."""
        if not self.bf16:
            return {}
        return {id(p): slot for p, slot in zip(self.model_params, self.params)}

    # ------------------------------------------------------------------ gathering
    def _all_gather(self, values_of: Callable[[torch.Tensor], torch.Tensor | None], targets: list[torch.Tensor]):
        """Every rank's ``values_of(piece)`` into ``targets`` (tensors shaped like the model's parameters), each
        shard over its own ranks."""
        for shard in self.shards:
            shard.all_gather(values_of, targets)

    def _whole_masters(self, dtype: torch.dtype) -> list[torch.nn.Parameter]:
        """Every parameter's master weights, gathered, in ``dtype``, with the parameters' attributes."""
        whole = []
        for p in self.model_params:
            master = torch.nn.Parameter(
                torch.empty(p.shape, dtype=dtype, device=p.device), requires_grad=p.requires_grad
            )
            copy_parameter_attributes(p, master)
            whole.append(master)
        self._all_gather(lambda piece: piece, whole)
        return whole

    def _state_of(self, piece: torch.Tensor, key: str) -> torch.Tensor | None:
        return self.optimizer.state.get(piece, {}).get(key)

    def _gather_state(self, whole: torch.optim.Optimizer, masters: list[torch.Tensor]) -> None:
        """The pieces' optimizer state into ``whole`` (an optimizer over ``masters``), as the unsharded optimizer
        would hold it: a parameter never stepped has no state."""
        from vime.backends.megatron_checkpoint import ensure_optimizer_state

        ensure_optimizer_state(whole)  # every key of this optimizer's state, zero
        keys = sorted({k for state in whole.state.values() for k, v in state.items() if torch.is_tensor(v) and v.dim()})
        for key in keys:
            self._all_gather(functools.partial(self._state_of, key=key), [whole.state[m][key] for m in masters])
        # Per parameter: whether any piece of it has state, and its step count (the same on every piece).
        held = torch.full((2, len(masters)), -1.0, dtype=torch.float64)
        for segment, piece in zip(self.pieces, self.piece_params):
            state = self.optimizer.state.get(piece)
            if state:
                held[0, segment.index] = 1.0
                held[1, segment.index] = max(float(held[1, segment.index]), float(state.get("step", 0.0)))
        for shard in self.shards:  # the same order on every rank: collectives of different groups never cross
            shard.max_over_ranks(held)
        for i, master in enumerate(masters):
            if held[0, i] < 0:
                whole.state.pop(master, None)
            elif "step" in whole.state[master]:
                whole.state[master]["step"].fill_(float(held[1, i]))

    # ------------------------------------------------------------------ whole tensors: export and checkpoints
    @contextlib.contextmanager
    def _installed(self, tensors: list[torch.Tensor]) -> Iterator[torch.nn.Module]:
        with installed(self._places, tensors, self.model_params):
            yield self.module

    def weights_as(self, dtype: torch.dtype | None = None) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """Context in which the module holds the master weights in ``dtype`` (float32 by default), for reading
        (weights for the engines): the model itself where its parameters are in that dtype already (they are the
        masters rounded to it), else gathered copies."""
        dtype = dtype or torch.float32
        if all(p.dtype == dtype for p in self.model_params):
            return contextlib.nullcontext(self.module)
        return self._installed(self._whole_masters(dtype))

    @contextlib.contextmanager
    def whole_state(self, access: StateAccess) -> Iterator[torch.optim.Optimizer]:
        """Context in which the module holds whole float32 master weights and the yielded optimizer (of
        ``--optimizer``'s kind, with this one's settings) holds the whole state over them: the unsharded state a
        checkpoint saves or loads. With :attr:`StateAccess.WRITE` what it holds afterwards becomes this rank's
        part (weights, state and settings), and the model's parameters are set from the whole weights."""
        masters = self._whole_masters(torch.float32)
        whole = self.make_optimizer(masters)
        for mine, theirs in zip(self.optimizer.param_groups, whole.param_groups):
            theirs.update({k: v for k, v in mine.items() if k != "params"})
        self._gather_state(whole, masters)
        with self._installed(masters):
            yield whole
        if access is StateAccess.WRITE:
            self._take(whole, masters)

    @torch.no_grad()
    def _take(self, whole: torch.optim.Optimizer, masters: list[torch.Tensor]) -> None:
        for p, master in zip(self.model_params, masters):
            p.data.copy_(master)
        for mine, theirs in zip(self.optimizer.param_groups, whole.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        for segment, piece in zip(self.pieces, self.piece_params):
            master = masters[segment.index]
            if self.bf16:  # in float32 the piece is a view of the parameter just set
                piece.copy_(_flat(master)[segment.start : segment.stop])
            state = whole.state.get(master)
            if not state:
                self.optimizer.state.pop(piece, None)
                continue
            self.optimizer.state[piece] = {
                key: (_flat(value)[segment.start : segment.stop].clone() if value.dim() else value.clone())
                if torch.is_tensor(value)
                else value
                for key, value in state.items()
            }

    def to(self, device: torch.device) -> None:
        """After the module moved to ``device``: the pieces (views of the parameters again, in float32), the
        stand-ins and the state follow, in place (the optimizer keeps its references)."""
        for segment, piece in zip(self.pieces, self.piece_params):
            if self.bf16:
                piece.data = piece.data.to(device)
            else:
                piece.data = _flat(self.model_params[segment.index].data)[segment.start : segment.stop]
        if self.bf16:
            for slot in self.params:
                slot.data = slot.data.to(device)
                slot.grad = None
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:  # moments; Adam's scalar step stays put
                    state[key] = value.to(device)


class ShardedModelRole(ModelRole):
    """A :class:`ModelRole` whose optimizer is a :class:`ShardedOptimizer`: the same schedule, clipping and
    lifecycle; the reductions receive :attr:`ShardedOptimizer.params`."""

    optimizer: ShardedOptimizer

    def parameters(self):
        return iter(self.optimizer.params)

    def gradient_holders(self) -> dict[int, torch.Tensor]:
        return self.optimizer.gradient_holders()

    def weights_as(self, dtype: torch.dtype | None = None):
        return self.optimizer.weights_as(dtype)

    def whole_state(self, access: StateAccess):
        return self.optimizer.whole_state(access)

    def _move(self, device: torch.device) -> None:
        self.module.to(device)
        self.optimizer.to(device)


def make_sharded_role(
    name: str,
    module: torch.nn.Module,
    spec: TorchTrainerSpec,
    role: RoleOverrides,
    source: str | None,
    groups: list[ShardGroup],
) -> ShardedModelRole:
    """:func:`vime.backends.torch_backend.make_role` with the optimizer sharded over the ranks of ``groups``."""
    schedule = (spec.lr_schedule or LRSchedule(lr=spec.lr)).for_role(role, source)
    sharded = ShardedOptimizer(module, lambda tensors: make_optimizer(tensors, spec, role), groups, bf16=spec.bf16)
    return ShardedModelRole(name, module, sharded, role.get("clip_grad", spec.clip_grad), schedule)
