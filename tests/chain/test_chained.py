"""Phase 1: FSDPMuonChainedOptimizer's step contract, with stand-ins for models and optimizer."""

import pytest

from megatron_muon.chain.chained import FSDPMuonChainedOptimizer
from megatron_muon.chain.model_chunks import find_megatron_fsdp


class FakeMegatronFSDP:
    def __init__(self, log, name, auto_sync=False):
        self.log, self.name, self.model_auto_sync = log, name, auto_sync

    def finish_grad_sync(self, **kwargs):
        self.log.append(f"sync {self.name}")

    def install_optimized_model_weights(self):
        self.log.append(f"install {self.name}")

    def start_param_sync(self, force_sync=False):
        self.log.append(f"param sync {self.name}")

    def zero_grad_buffer(self):
        self.log.append(f"zero buffer {self.name}")


class FakeCoreFSDPWrapper:
    """megatron-core's FullyShardedDataParallel: exposes finish_grad_sync, holds MegatronFSDP."""

    def __init__(self, inner):
        self.module = inner
        self.finish_grad_sync = inner.finish_grad_sync


class FakeOptimizer:
    def __init__(self, log, successful=True):
        self.log, self.successful = log, successful
        self.param_groups = [{"lr": 0.1, "params": []}]

    def step(self):
        self.log.append("inner step")
        return self.successful, 1.5, None

    def zero_grad(self, set_to_none=True):
        self.log.append(f"inner zero_grad {set_to_none}")

    def get_lr(self):
        return 0.1


def test_step_syncs_grads_steps_then_installs_and_syncs_params_once_per_chunk():
    log = []
    a, b = FakeMegatronFSDP(log, "a"), FakeMegatronFSDP(log, "b")
    opt = FSDPMuonChainedOptimizer(FakeOptimizer(log), [FakeCoreFSDPWrapper(a), b])
    assert opt.step() == (True, 1.5, None)
    # As DistributedOptimizer: every chunk's weights installed, then every chunk's param sync.
    assert log == ["sync a", "sync b", "inner step", "install a", "install b", "param sync a",
                   "param sync b"]


def test_auto_sync_models_are_not_synced_again():
    log = []
    opt = FSDPMuonChainedOptimizer(FakeOptimizer(log), [FakeMegatronFSDP(log, "a", auto_sync=True)])
    opt.step()
    assert log == ["inner step", "install a", "param sync a"]


def test_grads_synced_by_finalize_model_grads_are_not_reduced_twice():
    log = []
    chunk = FakeCoreFSDPWrapper(FakeMegatronFSDP(log, "a"))
    opt = FSDPMuonChainedOptimizer(FakeOptimizer(log), [chunk])
    chunk.finish_grad_sync(force_all_reduce=False)  # what finalize_model_grads does
    opt.step()
    opt.step()  # the next step has no finalize before it: sync again
    assert log == ["sync a", "inner step", "install a", "param sync a"] * 2


def test_failed_update_installs_nothing():
    log = []
    opt = FSDPMuonChainedOptimizer(FakeOptimizer(log, successful=False), [FakeMegatronFSDP(log, "a")])
    assert opt.step()[0] is False
    assert log == ["sync a", "inner step"]


def test_zero_grad_also_zeroes_the_fsdp_grad_buffers():
    log = []
    opt = FSDPMuonChainedOptimizer(FakeOptimizer(log), [FakeMegatronFSDP(log, "a")])
    opt.zero_grad(set_to_none=False)
    assert log == ["inner zero_grad False", "zero buffer a"]


def test_everything_else_delegates_to_the_inner_optimizer():
    inner = FakeOptimizer([])
    opt = FSDPMuonChainedOptimizer(inner, [FakeMegatronFSDP([], "a")])
    assert opt.param_groups is inner.param_groups
    assert opt.get_lr() == 0.1  # state_dict is the chain's own (its checkpoint format)


def test_chunks_without_megatron_fsdp_are_refused():
    plain = type("Plain", (), {"module": None})()
    with pytest.raises(ValueError, match=r"chunks \[1\] of 2 are not wrapped by Megatron-FSDP"):
        FSDPMuonChainedOptimizer(FakeOptimizer([]), [FakeMegatronFSDP([], "a"), plain])
    with pytest.raises(ValueError, match="needs Megatron-FSDP model chunks"):
        FSDPMuonChainedOptimizer(FakeOptimizer([]), [])


def test_find_megatron_fsdp_unwraps_nested_modules():
    inner = FakeMegatronFSDP([], "a")
    assert find_megatron_fsdp(FakeCoreFSDPWrapper(inner)) is inner
    assert find_megatron_fsdp(object()) is None
