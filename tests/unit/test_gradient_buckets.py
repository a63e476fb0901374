"""The data-parallel gradient sum works through buckets of bounded size (vime.backends.data_parallel): the ranks'
gradients add up as with one flat buffer, whatever their sizes, layout and presence, while the copy a sum holds
beyond the gradients is at most one bucket."""

import os

import torch

from tests.gloo_ranks import join_group, leave_group, run_ranks
from vime.backends import data_parallel
from vime.backends.data_parallel import DataParallel, gradient_buckets
from vime.runtime.ports import free_port


def test_buckets_keep_the_order_bound_the_size_and_split_dtypes():
    sizes = [3, 4, 10, 2, 2, 1]
    grads = [torch.zeros(n) for n in sizes[:5]] + [torch.zeros(1, dtype=torch.float64)]
    buckets = gradient_buckets(grads, limit=8)
    assert [[g.numel() for g in b] for b in buckets] == [[3, 4], [10], [2, 2], [1]]
    assert [g for b in buckets for g in b] == grads  # every gradient once, in order (identity, not value)
    assert {b[0].dtype for b in buckets[3:]} == {torch.float64}


SHAPES = [(3,), (2, 5), (10,), (4, 3), (1,), (6,)]


def _gradients(rank: int) -> list[torch.Tensor | None]:
    """Rank r's gradients: (r + 1) x a fixed pattern; the fourth non-contiguous (a transposed view), the fifth
    present on rank 0 only, the sixth on no rank."""
    grads = []
    for index, shape in enumerate(SHAPES):
        base = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 10 * index
        grads.append((rank + 1) * base)
    grads[3] = grads[3].t().contiguous().t()
    grads[4] = grads[4] if rank == 0 else None
    grads[5] = None
    return grads


def _rank(rank: int, port: int, work: str) -> None:
    join_group(rank, port)
    data_parallel.GRADIENT_BUCKET_ELEMENTS = 8  # the (2, 5) and (10,) gradients are buckets of their own
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    for param, grad in zip(params, _gradients(rank)):
        param.grad = grad
    assert not params[3].grad.is_contiguous()
    DataParallel().sum_gradients(params)
    torch.save([p.grad for p in params], os.path.join(work, f"rank{rank}.pt"))
    leave_group()


def test_two_ranks_sum_their_gradients_bucket_by_bucket(tmp_path):
    run_ranks(_rank, (free_port(), str(tmp_path)), 2)
    first, second = (torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2))
    expected = [a + b for a, b in zip(_gradients(0)[:4], _gradients(1)[:4])]
    expected += [_gradients(0)[4], None]  # a gradient only rank 0 had; none on either rank stays None
    for ours, theirs, want in zip(first, second, expected):
        if want is None:
            assert ours is None and theirs is None
        else:
            assert torch.equal(ours, want) and torch.equal(theirs, want)
