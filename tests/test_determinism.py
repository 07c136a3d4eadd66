"""``train.deterministic``: it reaches megatron's config, torch and the workers' environment, it is refused
where it cannot hold (naming the fix), and two straight runs with it are bit-identical (on a CPU here;
benchmarks/gpu_determinism.sh shows it on a GPU, with kill -9 and resume and each label against none)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_trainer, compose, gradients, train_in_process

from recipes.errors import ConfigError
from recipes.run.workers import worker_environment
from recipes.run.world import use_deterministic
from recipes.validate import validate
from recipes.validate.run import DETERMINISTIC_ENV

ENV = tuple(DETERMINISTIC_ENV)


@pytest.fixture
def clean_env(monkeypatch):
    """No deterministic setting inherited from the shell; torch's flag back to its default afterwards."""
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    yield monkeypatch
    torch.use_deterministic_algorithms(False)


def test_the_workers_environment_carries_cublas_nccl_and_te_settings(clean_env):
    env = worker_environment(compose("train.deterministic=true"))
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert env["NCCL_ALGO"] == "Ring"
    assert env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    plain = worker_environment(compose())
    assert not set(ENV) & set(plain), "off, the environment is the user's"
    clean_env.setenv("NCCL_ALGO", "Tree")  # another algorithm Megatron-LM accepts is kept
    assert worker_environment(compose("train.deterministic=true"))["NCCL_ALGO"] == "Tree"


def test_a_built_trainer_runs_under_megatron_and_torch_deterministic_modes(megatron_world, clean_env):
    import torch._inductor.config as inductor

    trainer = build_trainer(compose("train.deterministic=true"))
    try:
        assert trainer.config.deterministic_mode is True
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert inductor.deterministic is True
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8", "in-process runs get it before CUDA starts"
    finally:
        trainer.close()
    trainer = build_trainer(compose())  # the next trainer of the process is back to torch's default
    try:
        assert trainer.config.deterministic_mode is False
        assert not torch.are_deterministic_algorithms_enabled()
        assert inductor.deterministic is False
    finally:
        trainer.close()


@pytest.mark.parametrize("family", ["gdn", "gdn_moe"])
def test_gated_delta_net_is_refused_with_the_fix(family):
    with pytest.raises(ConfigError) as err:
        validate(compose(f"model={family}", "train.deterministic=true"), num_gpus=0)
    assert err.value.option == "train.deterministic"
    assert "fla" in err.value.problem and "model=standard_attn" in err.value.fix
    validate(compose(f"model={family}"), num_gpus=0)  # off, the same model is fine


@pytest.mark.parametrize("key, bad", [("NCCL_ALGO", "NVLS"), ("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
                                      ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")])
def test_an_environment_that_breaks_it_is_refused_before_launch_and_in_process(clean_env, key, bad):
    clean_env.setenv(key, bad)
    cfg = compose("train.deterministic=true")
    with pytest.raises(ConfigError) as err:
        validate(cfg, num_gpus=0)
    assert err.value.option == "train.deterministic"
    assert f"{key}={bad}" in err.value.problem and f"unset {key}" in err.value.fix
    with pytest.raises(ConfigError):  # a benchmark or test that builds its own world is refused the same way
        use_deterministic(cfg)
    validate(compose(), num_gpus=0)  # off, the variable is the user's business


#: Four steps of the tiny model: enough for the optimizer's state to feed back into the losses.
RUN = ("train.deterministic=true", "train.train_iters=4", "measure.start_step=2", "measure.profile=none",
       "measure.ledger=false")


@pytest.mark.parametrize("family", ["standard_attn", "mla", "moe"])
def test_two_straight_runs_are_bit_identical(megatron_world, clean_env, family):
    """Losses and grad norms of every step, and one step's gradients, equal bit for bit across two runs."""
    cfg = compose(f"model={family}", *RUN)
    first, second = train_in_process(cfg), train_in_process(cfg)
    assert first["loss"] == second["loss"] and len(first["loss"]) == 4
    assert first["grad_norm"] == second["grad_norm"]
    loss0, grads0, _, _ = gradients(cfg, record_ledger=False)
    loss1, grads1, _, _ = gradients(cfg, record_ledger=False)
    assert loss0 == loss1 and grads0.keys() == grads1.keys()
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name
