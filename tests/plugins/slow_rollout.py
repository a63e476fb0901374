"""tests/plugins/digit_rollout.py's function, holding its leased groups longer than a lease: the test that uses it
runs with --rollout-queue-lease-seconds 2, so the groups come back accepted only if the rollout worker's heartbeat
renews the leases of the groups a --rollout-function-path call holds (a multi-turn agent's call can take longer
than the default 120 s)."""

import time

from tests.plugins.digit_rollout import generate_rollout as answer_digits

HOLD_SECONDS = 2.5


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    output = answer_digits(args, rollout_id, data_source, evaluation)
    time.sleep(HOLD_SECONDS)
    return output
