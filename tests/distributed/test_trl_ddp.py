"""`lmloss.integrations.trl.patch` on a ``trl.GRPOTrainer``, a ``DPOTrainer`` and a ``KTOTrainer`` whose model
DDP wraps: 2 gloo ranks, the trainer's own accelerate state (MULTI_CPU, ``DistributedDataParallel``). GRPO: the
tiny Llama, tokenizer and reward of tests/test_integrations_trl.py, two optimizer steps on one generation batch
per rank (the ranks draw different prompts, so their local gradients differ). DPO / KTO: the fp32 tiny Llama,
its reference and the datasets of tests/preference_support.py, two SGD steps (the distributed sampler gives
each rank its own pairs / completions). All in one spawned run (a process group start costs seconds).

One run trains twice on each rank, from the same saved model:
  patched   - the patch as shipped: the fused head runs as DDP's forward (`run_as_forward`)
  bypassed  - the patch with `run_as_forward` replaced by a direct call of the inner model (what Liger's fused
              DPO / KTO path did, TRL #7245): DDP never arms its gradient all-reduce
After each, every parameter of both ranks is compared: bitwise equal for `patched`, and `bypassed` shows the
test would catch a skipped sync (the parameters differ across the ranks). GRPO and DPO run both ways, KTO
patched only (its path to the head is DPO's, `trl_preference._score`). The values against TRL's own path are
tests/test_integrations_trl.py's and tests/test_preference_trl_patch.py's (one process).
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from dist_utils import run_ranks  # noqa: E402

import preference_support as S  # noqa: E402
from lmloss.integrations import hf as lmloss_hf  # noqa: E402
from lmloss.integrations import trl as lmloss_trl  # noqa: E402
from test_integrations_trl import VOCAB, reward, tiny_llama, tokenizer  # noqa: E402

WORLD = 2


def _train(model_dir: str, out_dir: str, mode: str) -> dict[str, torch.Tensor]:
    """Two GRPO steps of this rank's share of 4 prompts (4 generations each); the parameters after them."""
    prompts = [" ".join(f"t{(7 * i + j) % (VOCAB - 8) + 8}" for j in range(2 + i % 3)) for i in range(4)]
    args = trl.GRPOConfig(
        output_dir=os.path.join(out_dir, mode), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=2, num_iterations=2, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", report_to="none", use_cpu=True, logging_steps=1, save_strategy="no",
        beta=0.0, seed=0, disable_tqdm=True, bf16=False,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model_dir, reward_funcs=reward, args=args, processing_class=tokenizer(),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
    )  # fmt: skip
    return _train_patched(trainer)


def _train_preference(out_dir: str, kind: str, mode: str) -> dict[str, torch.Tensor]:
    """Two SGD steps of this rank's share of 8 DPO pairs (2 a step) or 12 KTO completions (3 a step)."""
    ctx = S.quiet()
    try:
        model = S.tiny_llama(torch.float32)
        common = S.common_args(os.path.join(out_dir, f"{kind}-{mode}"), max_steps=2,
                               per_device_train_batch_size=2 if kind == "dpo" else 3)  # fmt: skip
        if kind == "dpo":
            args, data = trl.DPOConfig(**common, loss_type=["sigmoid"]), S.paired_dataset(8)
            trainer = trl.DPOTrainer(model=model, ref_model=S.reference_of(model), args=args,
                                     processing_class=S.tokenizer(), train_dataset=data)  # fmt: skip
        else:
            args = trl.KTOConfig(**common, train_sampling_strategy="sequential")
            trainer = trl.KTOTrainer(model=model, ref_model=S.reference_of(model), args=args,
                                     processing_class=S.tokenizer(), train_dataset=S.unpaired_dataset(12))  # fmt: skip
    finally:
        ctx.__exit__(None, None, None)
    return _train_patched(trainer)


def _train_patched(trainer) -> dict[str, torch.Tensor]:
    lmloss_trl.patch(trainer)
    wrapped = []

    class Wrapped(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            wrapped.append(type(trainer.model_wrapped).__name__)

    trainer.add_callback(Wrapped())
    trainer.train()
    assert wrapped and set(wrapped) == {"DistributedDataParallel"}, wrapped  # the patch ran on the wrapped model
    return {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}


def _rank(rank: int, world: int, model_dir: str, out_dir: str):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate.state import AcceleratorState, PartialState

    # a forked rank inherits the test process's one-process accelerate state: start from none
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    shipped, wrapped = lmloss_hf.run_as_forward, []

    def counted(model, inner, compute, *a, **k):  # the fused head ran; with gradients, on the wrapped model
        wrapped.append((torch.is_grad_enabled(), model is not inner))
        return shipped(model, inner, compute, *a, **k)

    lmloss_hf.run_as_forward = counted
    try:
        out = {"patched": _train(model_dir, out_dir, "patched"), "wrapped_calls": wrapped[:]}
        for kind in ("dpo", "kto"):
            wrapped.clear()
            out[f"{kind}-patched"] = _train_preference(out_dir, kind, "patched")
            out[f"{kind}-wrapped_calls"] = wrapped[:]
        lmloss_hf.run_as_forward = lambda model, inner, compute, *a, **k: compute(inner, *a, **k)
        out["bypassed"] = _train(model_dir, out_dir, "bypassed")
        out["dpo-bypassed"] = _train_preference(out_dir, "dpo", "bypassed")
    finally:
        lmloss_hf.run_as_forward = shipped
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_ddp")
    tiny_llama().save_pretrained(tmp / "model")
    return run_ranks(_rank, WORLD, str(tmp / "model"), str(tmp), deadline_s=300.0)


def test_patched_grpo_under_ddp_keeps_every_parameter_bitwise_equal_across_ranks(ranks):
    first, second = ranks
    for got in ranks:  # the fused head scored the two loss steps through DDP's forward (the old policy's
        # log-probs, without gradients, TRL scores with the unwrapped model)
        calls = got["wrapped_calls"]
        assert [w for grad, w in calls if grad] == [True, True] and len(calls) == 3, calls
    assert first["patched"].keys() == second["patched"].keys()
    for name in first["patched"]:
        assert torch.equal(first["patched"][name], second["patched"][name]), name
    initial = tiny_llama().state_dict()  # the steps trained
    assert not torch.equal(first["patched"]["lm_head.weight"], initial["lm_head.weight"])


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_patched_preference_trainer_under_ddp_keeps_every_parameter_bitwise_equal_across_ranks(ranks, kind):
    first, second = ranks
    for got in ranks:  # the policy's loss step: the fused head ran with gradients as DDP's forward, once a step
        # (the reference model is not wrapped; KTO's KL term scores the policy without gradients)
        calls = got[f"{kind}-wrapped_calls"]
        assert [w for grad, w in calls if grad] == [True, True], calls
    params = first[f"{kind}-patched"]
    assert params.keys() == second[f"{kind}-patched"].keys()
    for name in params:
        assert torch.equal(params[name], second[f"{kind}-patched"][name]), name
    initial = S.tiny_llama(torch.float32).state_dict()  # the steps trained
    assert not torch.equal(params["lm_head.weight"], initial["lm_head.weight"])


@pytest.mark.parametrize("kind", ["grpo", "dpo"])
def test_the_check_fails_when_the_fused_head_bypasses_ddps_forward(ranks, kind):
    """TRL #7245's bug reproduced: without DDP's forward no gradient is all-reduced, and the ranks' parameters
    part after the first step."""
    key = "bypassed" if kind == "grpo" else f"{kind}-bypassed"
    first, second = ranks[0][key], ranks[1][key]
    differ = [name for name in first if not torch.equal(first[name], second[name])]
    assert "lm_head.weight" in differ and len(differ) >= len(first) // 2, differ
