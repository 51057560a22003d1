"""Collectives that carry out a row layout: learn it once, gather each matrix's rows."""

from typing import Sequence

import torch
import torch.distributed as dist

from .plan import Matrix, RowLayout, rows_sent


def all_gather_row_counts(local_rows: list[int], group) -> list[list[int]]:
    """Every rank's local row counts for the same list of matrices, rank-major (one collective)."""
    world = dist.get_world_size(group)
    local = torch.tensor(local_rows, dtype=torch.int64)
    table = torch.empty(world * len(local_rows), dtype=torch.int64)
    dist.all_gather_into_tensor(table, local, group=group)
    return table.view(world, len(local_rows)).tolist()


def all_gather_rows(local: torch.Tensor, layout: RowLayout, group) -> torch.Tensor:
    """The full matrix on every rank from uneven row shards.

    Shards are padded to the largest one because gloo's all_gather rejects unequal sizes; the
    padding is trimmed away after the gather.
    """
    world = len(layout.rows)
    padded = local.new_zeros((layout.max_rows, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    gathered = local.new_empty((world * layout.max_rows, *local.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    gathered = gathered.view(world, layout.max_rows, *local.shape[1:])
    return torch.cat([gathered[rank, :rows] for rank, rows in enumerate(layout.rows)])


class OwnerExchange:
    """One batch of an owner plan: each matrix's rows to its owner, the owner's results back.

    One variable-size all_to_all_single per direction (gloo and NCCL both take split sizes);
    rows already on their owner never travel, and a batch whose matrices all sit whole on their
    owners issues no collective at all (every rank knows that from the plan).
    """

    def __init__(self, matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int],
                 rank: int, group):
        world = len(matrices[batch[0]].layout.rows)
        self.rank, self.group, self.batch, self.matrices = rank, group, list(batch), matrices
        self.cols = matrices[batch[0]].cols
        self.sends = [rows_sent(matrices, owners, batch, rank, dst) for dst in range(world)]
        self.recvs = [rows_sent(matrices, owners, batch, src, rank) for src in range(world)]
        self.send_counts = [self._elements(segments) for segments in self.sends]
        self.recv_counts = [self._elements(segments) for segments in self.recvs]
        self.owned = [i for i in batch if owners[i] == rank]
        self.moves_rows = any(rows_sent(matrices, owners, batch, src, dst)
                              for src in range(world) for dst in range(world))
        self._work = None

    def _elements(self, segments) -> int:
        return sum(stop - start for _, start, stop in segments) * self.cols

    def _all_to_all(self, send: list[torch.Tensor], send_counts, recv_counts, like: torch.Tensor):
        received = like.new_empty(sum(recv_counts))
        if not self.moves_rows:
            return received
        payload = torch.cat([t.reshape(-1) for t in send]) if send else like.new_empty(0)
        self._work = dist.all_to_all_single(received, payload, recv_counts, send_counts,
                                            group=self.group, async_op=True)
        return received

    def _wait(self):
        if self._work is not None:
            self._work.wait()
            self._work = None

    def start_gather(self, local: dict[int, torch.Tensor]) -> None:
        """Send this rank's rows of each batch matrix (`local[i]`) to that matrix's owner."""
        like = local[self.batch[0]]
        send = [local[i] for segments in self.sends for i, _, _ in segments]
        self._local = local
        self._received = self._all_to_all(send, self.send_counts, self.recv_counts, like)

    def finish_gather(self) -> list[torch.Tensor]:
        """The full matrices this rank owns, in batch order."""
        self._wait()
        full = {}
        for i in self.owned:
            if self.matrices[i].layout.rows[self.rank] == self.matrices[i].layout.num_rows:
                full[i] = self._local[i]  # held whole: nothing to assemble
                continue
            full[i] = self._local[i].new_empty(self.matrices[i].shape)
            start, stop = self.matrices[i].layout.row_range(self.rank)
            full[i][start:stop] = self._local[i]
        received = zip(self._segments(self.recvs), self._pieces(self._received, self.recvs))
        for (i, start, stop), piece in received:
            full[i][start:stop] = piece
        self._received = None
        return [full[i] for i in self.owned]

    def start_scatter(self, results: list[torch.Tensor]) -> None:
        """Send each owned matrix's result rows back to the ranks that hold them."""
        self._results = dict(zip(self.owned, results))
        send = [self._results[i][start:stop] for i, start, stop in self._segments(self.recvs)]
        like = self._local[self.batch[0]]
        self._returned = self._all_to_all(send, self.recv_counts, self.send_counts, like)

    def finish_scatter(self) -> dict[int, torch.Tensor]:
        """This rank's rows of every batch matrix's result."""
        self._wait()
        rows = {}
        for i in self.owned:
            start, stop = self.matrices[i].layout.row_range(self.rank)
            rows[i] = self._results[i][start:stop]
        for (i, _, _), piece in zip(self._segments(self.sends), self._pieces(self._returned, self.sends)):
            rows[i] = piece
        for i in self.batch:  # matrices of which this rank holds no rows
            rows.setdefault(i, self._local[i])
        # The rows are views: the buffers live until the caller has applied them, no longer.
        self._local = self._results = self._returned = None
        return rows

    @staticmethod
    def _segments(per_rank):
        return [segment for segments in per_rank for segment in segments]

    def _pieces(self, buffer: torch.Tensor, per_rank):
        sizes = [(stop - start) * self.cols for _, start, stop in self._segments(per_rank)]
        return [piece.view(-1, self.cols) for piece in buffer.split(sizes)]
