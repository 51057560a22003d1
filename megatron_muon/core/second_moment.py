"""The adaptive Muon variants' second moment (--optimizer adaptive_muon), on a matrix whose rows
are spread over ranks: emerging-optimizers' AdaptiveMuon second moment and Muon scale
(upstream.apply_moment2_normalization, upstream.apply_muon_scale) on the optimizer, an
AdaptiveMuon, called on what each needs whole.

AdaptiveMuon's step orthogonalizes without Muon's scale, then normalizes by the second moment,
then scales. A variant (a SecondMoment) says where that runs and what travels for it:
- AdaMuon's moment is elementwise: the owner sends back the unscaled Newton-Schulz rows and each
  rank normalizes and scales its own (a HolderSecondMoment); nothing more travels. Its state is
  shaped like the param's, as large as Adam's second moment.
- NorMuon's statistic is a mean over each row (matrices at least as tall as wide) or each column
  (wider ones), and its update is rescaled to the Newton-Schulz output's Frobenius norm: both
  need the whole matrix, so the owner runs it (an OwnerSecondMoment). Its moment is kept beside
  the rows it belongs to, `k` columns per row (a row's mean for a tall matrix, k = 1; the
  [1, cols] column moment of a wide one laid along its rows, ceil(cols / rows) per row,
  zero-padded), so it is sharded as the main weights are and travels with them, k more columns
  each way.
- NAMO scales the whole update by one number from the whole raw gradient's and the whole
  pre-orthogonalization update's Frobenius norms and a scalar moment: the owner runs it, the raw
  gradient's rows travelling beside the update's to the owner (not back: the return carries the
  update and the moment, `Columns.returned`), its moment in the first row's one column (zeros
  below it).
"""

import abc
import dataclasses
import math
from typing import Any, ClassVar, NamedTuple

import torch

from ..compat import upstream
from ..plan import Matrix

WholeShape = tuple[int, int]  # the whole (TP-unsharded) matrix's, which Muon's scale reads


class Columns(NamedTuple):
    """What each row of a matrix carries to its owner, side by side in this order: the update's
    `update` columns, the raw gradient's `grad` columns, the second moment's `moment2` columns.
    The owner sends back `returned`'s: the gradient stays with it."""

    update: int
    grad: int = 0
    moment2: int = 0

    @property
    def beside(self) -> int:
        """The columns travelling beside the update's to the owner: a planned Matrix's
        state_cols (SecondMoment.planned)."""
        return self.grad + self.moment2

    @property
    def returned(self) -> "Columns":
        """The columns the owner sends back (Matrix.returned_state_cols beside the update's)."""
        return self._replace(grad=0)

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(update, raw gradient, second moment) columns of rows laid out as these columns."""
        return rows.split(self, dim=1)


class SecondMoment(abc.ABC):
    """A variant's second moment, as ZeROTensorParallelAdaptiveMuon calls it; a variant implements
    one of the two kinds below. Its hooks, in the order a step calls them:

    - at construction, `held_columns(rows, cols)`: the second moment's columns per row of a
      rows x cols (TP-local) matrix, kept on each rank holding the row ("moment2_buffer", sharded
      as the main weights); `columns(rows, cols)`: what each row carries to the owner (and its
      `returned`, back; the planner sizes the exchanges by them: `planned`);
    - on each rank holding rows, before the exchange, `travelling(grad_rows, moment2_rows)`: the
      columns sent beside the update's rows (None: none);
    - on the owner, after unscaled Newton-Schulz on the whole matrix, `owner_update(optimizer,
      update, orthogonalized, raw_grad, moment2, group, whole_shape)`: the rows sent back, laid
      out as `columns(...).returned` (`update`: the pre-orthogonalization update; `raw_grad`,
      `moment2`: the travelling columns as they came, empty where none travel);
    - on each rank holding rows, `holder_update(optimizer, rows, columns, moment2, group,
      whole_shape)`: the update to apply to its rows, given what the owner sent back (`rows`,
      laid out as `columns`, the returned ones); it keeps the new second moment in `moment2`,
      its rows of the state.

    `optimizer` is the AdaptiveMuon whose methods (upstream.apply_moment2_normalization,
    upstream.apply_muon_scale) compute the variant; `group` its param group; `whole_shape` what
    Muon's scale reads. `moment2_travels`: whether `travelling` reads the second moment's rows and
    `holder_update` only writes them (else only `holder_update` reads and writes them): where the
    state is offloaded (core/state_offload.py), it moves once each way per step.
    """

    name: ClassVar[str]  # OptimizerConfig.adaptive_muon_moment2_method's value
    moment2_travels: ClassVar[bool]

    @abc.abstractmethod
    def held_columns(self, rows: int, cols: int) -> int:
        ...

    def planned(self, matrix: Matrix) -> Matrix:
        """`matrix` as the planner sizes its exchanges and memory: the columns travelling beside
        its rows each way, and held per row."""
        columns = self.columns(*matrix.shape)
        return dataclasses.replace(matrix, state_cols=columns.beside,
                                   returned_state_cols=columns.returned.beside,
                                   moment2_cols=self.held_columns(*matrix.shape))

    @abc.abstractmethod
    def columns(self, rows: int, cols: int) -> Columns:
        ...

    @abc.abstractmethod
    def travelling(self, grad_rows: torch.Tensor,
                   moment2_rows: torch.Tensor) -> torch.Tensor | None:
        ...

    @abc.abstractmethod
    def owner_update(self, optimizer: Any, update: torch.Tensor, orthogonalized: torch.Tensor,
                     raw_grad: torch.Tensor, moment2: torch.Tensor, group: dict,
                     whole_shape: WholeShape) -> torch.Tensor:
        ...

    @abc.abstractmethod
    def holder_update(self, optimizer: Any, rows: torch.Tensor, columns: Columns,
                      moment2: torch.Tensor, group: dict, whole_shape: WholeShape) -> torch.Tensor:
        ...


class HolderSecondMoment(SecondMoment):
    """A second moment each rank computes on its own rows (elementwise statistics): nothing
    travels beside the update, the owner sends back Newton-Schulz's rows unscaled, and
    `holder_update` normalizes and scales them."""

    moment2_travels = False

    def columns(self, rows: int, cols: int) -> Columns:
        return Columns(cols)

    def travelling(self, grad_rows: torch.Tensor,
                   moment2_rows: torch.Tensor) -> torch.Tensor | None:
        return None

    def owner_update(self, optimizer: Any, update: torch.Tensor, orthogonalized: torch.Tensor,
                     raw_grad: torch.Tensor, moment2: torch.Tensor, group: dict,
                     whole_shape: WholeShape) -> torch.Tensor:
        return orthogonalized


class OwnerSecondMoment(SecondMoment):
    """A second moment that needs the whole matrix: it runs on the owner (`owner_update`), its
    state travelling beside the update's rows both ways (and, where `needs_raw_gradient`, the raw
    gradient's rows to the owner); each holder keeps the moment that comes back."""

    needs_raw_gradient: ClassVar[bool] = False
    moment2_travels = True

    def columns(self, rows: int, cols: int) -> Columns:
        return Columns(cols, cols if self.needs_raw_gradient else 0, self.held_columns(rows, cols))

    def travelling(self, grad_rows: torch.Tensor,
                   moment2_rows: torch.Tensor) -> torch.Tensor | None:
        return torch.cat([grad_rows, moment2_rows], dim=1) if self.needs_raw_gradient \
            else moment2_rows

    @staticmethod
    def returned_rows(update: torch.Tensor, moment2: torch.Tensor) -> torch.Tensor:
        """What `owner_update` sends back: the update's columns and the new moment's, laid out as
        Columns.returned."""
        return torch.cat([update, moment2], dim=1)

    def holder_update(self, optimizer: Any, rows: torch.Tensor, columns: Columns,
                      moment2: torch.Tensor, group: dict, whole_shape: WholeShape) -> torch.Tensor:
        update, _, new_moment2 = columns.split(rows)
        moment2.copy_(new_moment2)
        return update


class AdaMuon(HolderSecondMoment):
    """Elementwise second moment ("adamuon")."""

    name = "adamuon"

    def held_columns(self, rows: int, cols: int) -> int:
        return cols

    def holder_update(self, optimizer: Any, rows: torch.Tensor, columns: Columns,
                      moment2: torch.Tensor, group: dict, whole_shape: WholeShape) -> torch.Tensor:
        update = upstream.apply_moment2_normalization(
            optimizer, rows, moment2, group["beta2"], group["eps"])
        return upstream.apply_muon_scale(optimizer, update, *whole_shape)


class NorMuon(OwnerSecondMoment):
    """Row or column second moment with the Frobenius-norm match ("normuon"), on the owner."""

    name = "normuon"

    def held_columns(self, rows: int, cols: int) -> int:
        return 1 if rows >= cols else math.ceil(cols / rows)

    def owner_update(self, optimizer: Any, update: torch.Tensor, orthogonalized: torch.Tensor,
                     raw_grad: torch.Tensor, moment2: torch.Tensor, group: dict,
                     whole_shape: WholeShape) -> torch.Tensor:
        rows, cols = orthogonalized.shape
        # A copy: the columns it came in may be read again (the check's reference).
        moment2 = moment2.clone(memory_format=torch.contiguous_format)
        # AdaptiveMuon's own shape: [rows, 1] when tall, [1, cols] when wide.
        laid_out = moment2 if rows >= cols else moment2.view(-1)[:cols].view(1, cols)
        result = upstream.apply_moment2_normalization(
            optimizer, orthogonalized, laid_out, group["beta2"], group["eps"])
        result = upstream.apply_muon_scale(optimizer, result, *whole_shape)
        return self.returned_rows(result, moment2)


class NAMO(OwnerSecondMoment):
    """Scalar adaptive scale from whole-matrix norms ("namo"), on the owner."""

    name = "namo"
    needs_raw_gradient = True

    def held_columns(self, rows: int, cols: int) -> int:
        return 1

    def owner_update(self, optimizer: Any, update: torch.Tensor, orthogonalized: torch.Tensor,
                     raw_grad: torch.Tensor, moment2: torch.Tensor, group: dict,
                     whole_shape: WholeShape) -> torch.Tensor:
        raw_grad = raw_grad.contiguous()
        moment2 = moment2.clone(memory_format=torch.contiguous_format)
        result = upstream.apply_moment2_normalization(
            optimizer, orthogonalized, moment2.view(-1)[:1], group["beta2"], group["eps"],
            raw_grad=raw_grad, pre_orth_grad=update)
        result = upstream.apply_muon_scale(optimizer, result, *whole_shape)
        return self.returned_rows(result, moment2)


SECOND_MOMENTS: dict[str, SecondMoment] = {
    variant.name: variant for variant in (AdaMuon(), NorMuon(), NAMO())}
