"""The adaptive Muon variants' second moment (--optimizer adaptive_muon), on a matrix whose rows
are spread over ranks: emerging-optimizers' AdaptiveMuon second moment and Muon scale
(upstream.apply_moment2_normalization, upstream.apply_muon_scale) on the optimizer, an
AdaptiveMuon, called on what each needs whole.

AdaptiveMuon's step orthogonalizes without Muon's scale, then normalizes by the second moment,
then scales. A variant here says where that runs and what travels for it (`travelling`: the
columns beside each row of the update sent to the owner, which sends as many back):
- AdaMuon's moment is elementwise: the owner sends back the unscaled Newton-Schulz rows and each
  rank normalizes and scales its own (`on_holder`); nothing more travels. Its state is shaped
  like the param's, as large as Adam's second moment.
- NorMuon's statistic is a mean over each row (matrices at least as tall as wide) or each column
  (wider ones), and its update is rescaled to the Newton-Schulz output's Frobenius norm: both
  need the whole matrix, so the owner runs it (`on_owner`). Its moment is kept beside the rows
  it belongs to, `k` columns per row (a row's mean for a tall matrix, k = 1; the [1, cols]
  column moment of a wide one laid along its rows, ceil(cols / rows) per row, zero-padded), so
  it is sharded as the main weights are and travels with them, k more columns each way.
- NAMO scales the whole update by one number from the whole raw gradient's and the whole
  pre-orthogonalization update's Frobenius norms and a scalar moment: the owner runs it, the raw
  gradient's rows travelling beside the update's (and back, unused: an exchange's two directions
  carry rows of one width), its moment in the first row's one column (zeros below it).
"""

import math

import torch

from ..compat import upstream


class AdaMuon:
    """Elementwise second moment ("adamuon")."""

    name = "adamuon"

    @staticmethod
    def travelling_columns(rows: int, cols: int) -> int:
        return 0

    @staticmethod
    def held_columns(rows: int, cols: int) -> int:
        return cols

    @staticmethod
    def travelling(grad_rows, moment2_rows):
        return None

    @staticmethod
    def on_owner(optimizer, update, orthogonalized, state, group, whole_shape) -> torch.Tensor:
        return orthogonalized

    @staticmethod
    def on_holder(optimizer, rows, moment2, group, whole_shape) -> torch.Tensor:
        update = upstream.apply_moment2_normalization(
            optimizer, rows, moment2, group["beta2"], group["eps"])
        return upstream.apply_muon_scale(optimizer, update, *whole_shape)


class NorMuon:
    """Row or column second moment with the Frobenius-norm match ("normuon"), on the owner."""

    name = "normuon"

    @staticmethod
    def travelling_columns(rows: int, cols: int) -> int:
        return 1 if rows >= cols else math.ceil(cols / rows)

    held_columns = travelling_columns

    @staticmethod
    def travelling(grad_rows, moment2_rows):
        return moment2_rows

    @staticmethod
    def on_owner(optimizer, update, orthogonalized, state, group, whole_shape) -> torch.Tensor:
        """The update and the new moment, side by side as they travel back: [rows, cols + k]."""
        rows, cols = orthogonalized.shape
        # A copy: the columns it came in may be read again (the check's reference).
        state = state.clone(memory_format=torch.contiguous_format)
        # AdaptiveMuon's own shape: [rows, 1] when tall, [1, cols] when wide.
        moment2 = state if rows >= cols else state.view(-1)[:cols].view(1, cols)
        update = upstream.apply_moment2_normalization(
            optimizer, orthogonalized, moment2, group["beta2"], group["eps"])
        update = upstream.apply_muon_scale(optimizer, update, *whole_shape)
        return torch.cat([update, state], dim=1)

    @staticmethod
    def on_holder(optimizer, rows, moment2, group, whole_shape) -> torch.Tensor:
        cols = rows.shape[1] - moment2.shape[1]
        moment2.copy_(rows[:, cols:])
        return rows[:, :cols]


class NAMO:
    """Scalar adaptive scale from whole-matrix norms ("namo"), on the owner."""

    name = "namo"

    @staticmethod
    def travelling_columns(rows: int, cols: int) -> int:
        return cols + 1

    @staticmethod
    def held_columns(rows: int, cols: int) -> int:
        return 1

    @staticmethod
    def travelling(grad_rows, moment2_rows):
        return torch.cat([grad_rows, moment2_rows], dim=1)

    @staticmethod
    def on_owner(optimizer, update, orthogonalized, state, group, whole_shape) -> torch.Tensor:
        """The update, the raw gradient's rows as they came and the new moment (first row)."""
        cols = orthogonalized.shape[1]
        raw_grad = state[:, :cols].contiguous()
        moment2 = state[:, cols:].clone(memory_format=torch.contiguous_format)
        result = upstream.apply_moment2_normalization(
            optimizer, orthogonalized, moment2.view(-1)[:1], group["beta2"], group["eps"],
            raw_grad=raw_grad, pre_orth_grad=update)
        result = upstream.apply_muon_scale(optimizer, result, *whole_shape)
        return torch.cat([result, raw_grad, moment2], dim=1)

    @staticmethod
    def on_holder(optimizer, rows, moment2, group, whole_shape) -> torch.Tensor:
        moment2.copy_(rows[:, -1:])
        return rows[:, :(rows.shape[1] - 1) // 2]


SECOND_MOMENTS = {variant.name: variant for variant in (AdaMuon, NorMuon, NAMO)}
