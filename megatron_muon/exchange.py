"""Collectives that carry out a row layout: learn it once, gather each matrix's rows."""

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from .plan import Matrix, RowLayout, gather_moves, gather_segments, scatter_moves, scatter_segments


def all_gather_ints(values: list[int], group, device: torch.device) -> list[list[int]]:
    """Every rank's list of as many ints (e.g. its row counts), rank-major (one collective).
    `device`: the group's (CUDA for NCCL, CPU for gloo), e.g. that of the params it describes."""
    world = dist.get_world_size(group)
    local = torch.tensor(values, dtype=torch.int64, device=device)
    table = torch.empty(world * len(values), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, local, group=group)
    return table.view(world, len(values)).tolist()


def all_gather_rows(local: torch.Tensor, layout: RowLayout, group) -> torch.Tensor:
    """The full matrix on every rank from uneven row shards (`local`: this rank's rows).

    Shards are padded to the largest one because gloo's all_gather rejects unequal sizes; the
    padding is trimmed away after the gather. A matrix every rank holds whole needs no collective.
    """
    if len(layout.rows) == 1:
        return local
    padded = local.new_zeros((layout.max_rows, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    gathered = local.new_empty((layout.ranks * layout.max_rows, *local.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    gathered = gathered.view(layout.ranks, layout.max_rows, *local.shape[1:])
    return torch.cat([gathered[layout.holders(shard)[0], :rows]
                      for shard, rows in enumerate(layout.rows)])


class Route(NamedTuple):
    """What this rank sends and receives in one direction of a batch: segments per peer, their
    element counts, and whether any rank moves anything (else no collective is issued)."""

    sends: list
    recvs: list
    send_counts: list[int]
    recv_counts: list[int]
    moves: bool


class OwnerExchange:
    """One exchange of an owner plan: each matrix's rows to its owner, the owner's results back
    to every rank holding rows of it, for several batches (each of one shape) at once.

    One variable-size all_to_all_single per direction (gloo and NCCL both take split sizes);
    rows already on their owner never travel, and a direction in which nothing moves for the
    exchange issues no collective at all (every rank knows that from the plan).
    """

    def __init__(self, matrices: Sequence[Matrix], owners: Sequence[int],
                 batches: Sequence[Sequence[int]], rank: int, group):
        self.rank, self.group, self.matrices = rank, group, matrices
        self.batches = [list(batch) for batch in batches]
        self.batch = [i for batch in self.batches for i in batch]
        self.gather = self._route(gather_segments, gather_moves, matrices, owners, self.batch)
        self.scatter = self._route(scatter_segments, scatter_moves, matrices, owners, self.batch)
        # This rank's matrices of each batch, in batch order.
        self.owned_batches = [[i for i in batch if owners[i] == rank] for batch in self.batches]
        self.owned = [i for owned in self.owned_batches for i in owned]
        self._work = None

    def _route(self, segments_of, moves, matrices, owners, batch) -> Route:
        # This rank's row and column of the (src, dst) table only: O(world) per exchange, not
        # O(world^2), so a plan at a thousand ranks is built in seconds.
        world = range(matrices[batch[0]].layout.ranks)
        sends = [segments_of(matrices, owners, batch, self.rank, dst) for dst in world]
        recvs = [segments_of(matrices, owners, batch, src, self.rank) for src in world]
        return Route(sends, recvs, [self._elements(s) for s in sends],
                     [self._elements(s) for s in recvs], moves(matrices, owners, batch))

    def _elements(self, segments) -> int:
        return sum((stop - start) * self.matrices[i].cols for i, start, stop in segments)

    def _all_to_all(self, route: Route, send: list[torch.Tensor], like: torch.Tensor):
        received = like.new_empty(sum(route.recv_counts))
        if not route.moves:
            return received
        payload = torch.cat([t.reshape(-1) for t in send]) if send else like.new_empty(0)
        self._work = dist.all_to_all_single(received, payload, route.recv_counts, route.send_counts,
                                            group=self.group, async_op=True)
        return received

    def _wait(self):
        if self._work is not None:
            self._work.wait()
            self._work = None

    def start_gather(self, local: dict[int, torch.Tensor]) -> None:
        """Send this rank's rows of each batch matrix (`local[i]`) to that matrix's owner."""
        send = [local[i] for segments in self.gather.sends for i, _, _ in segments]
        self._local = local
        self._received = self._all_to_all(self.gather, send, local[self.batch[0]])

    def finish_gather(self) -> list[torch.Tensor]:
        """The full matrices this rank owns, in batch order."""
        self._wait()
        full = {}
        for i in self.owned:
            layout = self.matrices[i].layout
            if layout.held(self.rank) == layout.num_rows:
                full[i] = self._local[i]  # held whole: nothing to assemble
                continue
            full[i] = self._local[i].new_empty(self.matrices[i].shape)
            start, stop = layout.row_range(self.rank)
            full[i][start:stop] = self._local[i]
        for (i, start, stop), piece in self._pieces(self._received, self.gather.recvs):
            full[i][start:stop] = piece
        self._received = None
        return [full[i] for i in self.owned]

    def start_scatter(self, results: list[torch.Tensor]) -> None:
        """Send each owned matrix's result rows to the other ranks that hold them."""
        self._results = dict(zip(self.owned, results))
        send = [self._results[i][start:stop] for segments in self.scatter.sends
                for i, start, stop in segments]
        self._returned = self._all_to_all(self.scatter, send, self._local[self.batch[0]])

    def finish_scatter(self) -> dict[int, torch.Tensor]:
        """This rank's rows of every batch matrix's result."""
        self._wait()
        rows = {}
        for i in self.owned:
            start, stop = self.matrices[i].layout.row_range(self.rank)
            rows[i] = self._results[i][start:stop]
        for (i, _, _), piece in self._pieces(self._returned, self.scatter.recvs):
            rows[i] = piece
        for i in self.batch:  # matrices of which this rank holds no rows
            rows.setdefault(i, self._local[i])
        # The rows are views: the buffers live until the caller has applied them, no longer.
        self._local = self._results = self._returned = None
        return rows

    def _pieces(self, buffer: torch.Tensor, per_rank):
        """(segment, its rows) of a received buffer laid out as `per_rank`'s segments."""
        segments = [segment for segments in per_rank for segment in segments]
        pieces = buffer.split([self._elements([segment]) for segment in segments])
        return zip(segments, [piece.view(-1, self.matrices[i].cols)
                              for (i, _, _), piece in zip(segments, pieces)])
