"""The step skip of FSDPMuonChainedOptimizer: a step whose gradients hold a NaN or Inf on any rank
is skipped on every rank, and a run that keeps skipping stops."""

import functools
import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


class NonfiniteSkip:
    """Decides, once per step and alike on every rank, whether the gradients hold a NaN or Inf
    (then the step is skipped: parameters, momentum and Adam's moments stay as they were), and
    counts such steps in a row: `max_consecutive` of them (0: never) raise instead, so a diverged
    run stops rather than train nothing for hours.

    Where the chain steps as megatron-core's optimizers do (`step`: `get_grad_norm`, then
    `step_with_ready_grads`), the decision is taken between the two from the norm, reduced over
    every rank that holds a shard (a NaN or Inf anywhere makes it non-finite everywhere): no
    collective of its own. Elsewhere, or where a step computed no norm, it reduces a flag."""

    def __init__(self, chain, max_consecutive: int):
        if max_consecutive < 0:
            raise ValueError("max_consecutive_skipped_steps (--muon-max-consecutive-skipped-steps) "
                             f"must be at least 0, got {max_consecutive}")
        self.chain, self.max_consecutive = chain, max_consecutive
        self.consecutive = self.skipped = 0  # in a row; in all
        self.nonfinite = None  # this step's verdict, once taken
        self.decides_inside_the_chain = self._decide_inside(chain)

    def begin_step(self) -> bool:
        """Whether to skip calling the chain: decided now, unless the chain decides inside."""
        self.nonfinite = None if self.decides_inside_the_chain else self._any_rank_has_nonfinite()
        return bool(self.nonfinite)

    def end_step(self) -> bool:
        """Whether this step was skipped; counts it (every rank comes here together, the verdict
        being reduced, so all stop together)."""
        if not self.nonfinite:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped += 1
        count, limit = self.consecutive, self.max_consecutive
        if limit and count >= limit:
            raise RuntimeError(
                f"{count} optimizer steps in a row were skipped: the gradients hold NaN or Inf "
                f"(the run has diverged; try a lower --lr or check the data). The limit is "
                f"--muon-max-consecutive-skipped-steps={limit} (0: never stop).")
        if not dist.is_initialized() or dist.get_rank() == 0:
            stops = f"; the run stops at {limit}" if limit else ""
            logger.warning("optimizer step skipped: NaN or Inf in the gradients "
                           f"({count} in a row{stops})")
        return True

    def _decide_inside(self, chain) -> bool:
        if not (callable(getattr(chain, "get_grad_norm", None))
                and callable(getattr(chain, "step_with_ready_grads", None))):
            return False
        get_grad_norm, step_with_ready_grads = chain.get_grad_norm, chain.step_with_ready_grads

        @functools.wraps(get_grad_norm)
        def get_grad_norm_and_decide(*args, **kwargs):
            norm = get_grad_norm(*args, **kwargs)
            self.nonfinite = not math.isfinite(norm)
            return norm

        @functools.wraps(step_with_ready_grads)
        def step_unless_nonfinite(*args, **kwargs):
            if self.nonfinite is None:
                self.nonfinite = self._any_rank_has_nonfinite()
            return not self.nonfinite and step_with_ready_grads(*args, **kwargs)

        chain.get_grad_norm = get_grad_norm_and_decide
        chain.step_with_ready_grads = step_unless_nonfinite
        return True

    def _any_rank_has_nonfinite(self) -> bool:
        """Whether a NaN or Inf is in any rank's gradient shard. Reduced over every rank, so all
        skip the step together (a rank skipping alone would leave the others waiting in its
        collectives). One pass per grad: its min and max are finite exactly when all of it is
        (both propagate NaN), and one host sync for all of them."""
        extremes = []
        device = torch.device("cpu")  # without params (stand-ins in tests)
        for group in self.chain.param_groups:
            for p in group["params"]:
                device = p.device  # a DTensor's is its local shard's
                grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
                if grad is not None:
                    grad = grad.to_local() if isinstance(grad, DTensor) else grad
                    if grad.numel():  # an empty shard has no min or max
                        extremes.append(torch.stack(torch.aminmax(grad)))
        flag = torch.zeros(1, device=device)  # on the params' device, as their process group's
        if extremes:
            flag[0] = torch.cat(extremes).isfinite().all().logical_not()
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
