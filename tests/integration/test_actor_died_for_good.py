"""A process of the run that died and that Ray did not restart again (the controller once its ten restarts are
spent, say) ends the run with one line naming it and how to resume, not a traceback (vime/train.py's main,
workers/failure_reasons.py's died_for_good). The actor here is a small one that ends its own process
(tests/dying_actors.py): the real controller would have to die eleven times first, which takes minutes; Ray's error
about it is the real one."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.dying_actors import CannotStart, Ends
from tests.local_ray import local_ray
from vime.workers.failure_reasons import died_for_good

pytestmark = pytest.mark.integration


def test_an_actor_dead_for_good_is_named_with_why_and_one_that_could_not_start_is_left_to_its_own_error():
    import ray

    # the actors' classes are in tests/, which Ray's workers import by name
    with local_ray(namespace="vime-died-test", runtime_env={"env_vars": {"PYTHONPATH": REPO}}):
        actor = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(Ends).options(name="vime-controller")
        with pytest.raises(ray.exceptions.ActorDiedError) as died:
            ray.get(actor.remote().end.remote(), timeout=120)
        said = died_for_good(died.value)
        assert said is not None and said.startswith("Ends (vime-controller): its worker process has died"), said
        unstarted = ray.remote(num_cpus=0)(CannotStart).remote()
        with pytest.raises(ray.exceptions.ActorDiedError) as failed:
            ray.get(unstarted.call.remote(), timeout=120)
        assert died_for_good(failed.value) is None  # its own error says it (the queue's stop, or "failed to start")
        assert died_for_good(OSError(5, "Input/output error")) is None
