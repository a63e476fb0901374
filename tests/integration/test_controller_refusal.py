"""A controller whose queue's writes keep failing across its restarts (recovery/volume_failure.py) refuses the queue in
its next incarnation: the calls in flight when the last one ended, and every later call, get the volume's error as
their answer, which the driver reports in one line naming --rollout-data-dir (vime/recovery/disk_full.py).

CI once saw the earlier way, where that incarnation's constructor raised (a JuiceFS metadata server restarted mid-run,
tests/faults/test_juicefs_storage_faults.py): Ray printed the constructor's error, traceback and all, once for every
call in flight ("Task Controller.sync failed. There are infinite retries remaining ..."), before vime's one line.
Here the real controller actor on a real straw queue under a local Ray, its journal sync failed by the fault hook
(VIME_FAULT_ERRORS); what Ray prints of it is this process's output."""

from __future__ import annotations

import errno
import os

import pytest

from tests.conftest import REPO
from tests.controller_spec import controller_spec, write_prompts
from tests.local_ray import local_ray
from vime.recovery.disk_full import VolumeFailed, WrittenVolume
from vime.recovery.volume_failure import MAX_VOLUME_RESTARTS, RESTARTS_NAME, volume_restarts
from vime.workers.controller import Controller

pytestmark = pytest.mark.integration

# Opening a new queue takes the controller's first five journal syncs and a lease one or two: the 7th is in the
# second lease.
FAILING_SYNC = 7


def test_a_controller_whose_writes_keep_failing_refuses_the_queue_and_ray_prints_no_traceback(tmp_path, capfd):
    import ray

    prompts = write_prompts(tmp_path, 8)
    spec = controller_spec(tmp_path, prompts, restart_on_volume_failure=True, volume_wait_seconds=5)
    data_dir = spec.store.data_dir
    # Two incarnations in a row already ended on a failed write: this one's failure is the last one ridden out.
    os.makedirs(data_dir)
    with open(os.path.join(data_dir, RESTARTS_NAME), "w") as f:
        f.write(f"{MAX_VOLUME_RESTARTS - 1}\n")
    env = {
        "PYTHONPATH": REPO,
        "VIME_FAULT_ERRORS": f"controller.straw.before_file_sync@{FAILING_SYNC}",
        "VIME_FAULT_STATE": str(tmp_path),  # once: the restarted incarnation's syncs go through
    }
    with local_ray(namespace="vime-refusal-test", runtime_env={"env_vars": env}):
        controller = ray.remote(num_cpus=0, max_restarts=10, max_task_retries=-1)(Controller).remote(spec)
        first = ray.get(controller.ready.remote(), timeout=120)["incarnation"]
        errors = []
        for _ in range(5):
            try:
                ray.get(controller.lease.remote("worker", 2), timeout=120)
            except ray.exceptions.RayTaskError as error:  # the call in flight, answered by the next incarnation
                errors.append(error)
        assert os.path.exists(tmp_path / "controller.straw.before_file_sync.failed")  # the sync did fail
        assert volume_restarts(data_dir) == MAX_VOLUME_RESTARTS
        assert len(errors) == 4, errors  # the failing lease and every one after it
        for error in errors:
            # Ray's wrapper is an OSError that keeps the text only (its errno is lost on the way)
            assert isinstance(error, OSError) and f"[Errno {errno.EIO}] Input/output error" in str(error), repr(error)
            assert f"failed again after {MAX_VOLUME_RESTARTS} restarts of its controller" in str(error)
        with pytest.raises(OSError, match="failed again after"):
            ray.get(controller.stats.remote(), timeout=60)
        with pytest.raises(OSError, match="failed again after"):  # and the new incarnation holds nothing
            ray.get(controller.ready.remote(), timeout=60)
        ray.get(controller.shutdown.remote(), timeout=60)  # a refusing incarnation stops as any other
        assert first  # the first incarnation was up before the failure
    # The driver's stop: one line naming the flag (the error reaches it as Ray's wrapper of the OSError).
    queue = WrittenVolume.queue(data_dir, 1, save=str(tmp_path / "save"))
    with pytest.raises(VolumeFailed, match=f"^the volume of --rollout-data-dir {data_dir} failed a call: the run"):
        with queue.stop_when_full("the run"):
            raise errors[0]
    printed = capfd.readouterr()
    assert "Traceback" not in printed.out + printed.err, printed.err[-3000:]
