"""Like steady_rollout, but the first attempt of every even prompt claims its tokens came from
weight version 0: once training has moved on, such groups are too stale to train and must be
regenerated (their task ids start with "r"), never trained and never lost."""

from tests.plugins import steady_rollout


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    output = steady_rollout.generate_rollout(args, rollout_id, data_source, evaluation)
    for group in output.samples:
        for sample in group:
            if sample.session_id.startswith("g") and sample.prompt_index % 2 == 0:
                sample.weight_versions = [0] * sample.response_length
    return output
