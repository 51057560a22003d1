"""Collectives that carry out a row layout: learn it once, gather each matrix's rows, and the
owner exchange, its buffers reported to the instrumentation hook (observe.collectives)."""

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import zip_longest
from operator import attrgetter
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..observe.collectives import held
from ..observe.phases import GATHER, NEWTON_SCHULZ, SCATTER, UPDATE, phase
from ..plan import (IN_FLIGHT, Matrix, RowLayout, gather_moves, gather_segments, scatter_moves,
                    scatter_segments)


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """Every rank's list of as many ints (e.g. its row counts), rank-major (one collective).
    `device`: the group's (CUDA for NCCL, CPU for gloo), e.g. that of the params it describes."""
    world = dist.get_world_size(group)
    local = torch.tensor(values, dtype=torch.int64, device=device)
    table = torch.empty(world * len(values), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, local, group=group)
    return table.view(world, len(values)).tolist()


def all_gather_rows(local: torch.Tensor, layout: RowLayout,
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full matrix on every rank from uneven row shards (`local`: this rank's rows).

    Shards are padded to the largest one because gloo's all_gather rejects unequal sizes; the
    padding is trimmed away after the gather. A matrix every rank holds whole needs no collective.
    """
    if len(layout.rows) == 1:
        return local
    padded = local.new_zeros((layout.max_rows, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    gathered = local.new_empty((layout.ranks * layout.max_rows, *local.shape[1:]))
    with held(padded, gathered), phase(GATHER):
        dist.all_gather_into_tensor(gathered, padded, group=group)
        gathered = gathered.view(layout.ranks, layout.max_rows, *local.shape[1:])
        return torch.cat([gathered[layout.holders(shard)[0], :rows]
                          for shard, rows in enumerate(layout.rows)])


class Route(NamedTuple):
    """What this rank sends and receives in one direction of an exchange: segments per peer,
    their element counts, whether any rank moves anything (else no collective is issued), and
    each matrix's elements per row in this direction (Matrix.gather_width or scatter_width)."""

    sends: list
    recvs: list
    send_counts: list[int]
    recv_counts: list[int]
    moves: bool
    width: Callable[[Matrix], int]


class OwnerRoutes:
    """One exchange of an owner plan, as this rank sees it, fixed at construction: its batches
    (each of one shape), the matrices it owns in each, and the routes of both directions (each
    matrix's rows to its owner; the owner's result rows back to every rank holding rows of it,
    replicas too; each direction's rows as wide as it carries them). Rows already on their owner
    never travel."""

    def __init__(self, matrices: Sequence[Matrix], owners: Sequence[int],
                 batches: Sequence[Sequence[int]], rank: int) -> None:
        self.rank, self.matrices = rank, matrices
        self.batches = [list(batch) for batch in batches]
        self.batch = [i for batch in self.batches for i in batch]
        self.gather = self._route(gather_segments, gather_moves, owners, attrgetter("gather_width"))
        self.scatter = self._route(scatter_segments, scatter_moves, owners,
                                   attrgetter("scatter_width"))
        self.owned_batches = [[i for i in batch if owners[i] == rank] for batch in self.batches]
        self.owned = [i for owned in self.owned_batches for i in owned]

    def _route(self, segments_of, moves, owners, width) -> Route:
        # This rank's row and column of the (src, dst) table only: O(world) per exchange, not
        # O(world^2), so a plan at a thousand ranks is built in seconds.
        world = range(self.matrices[self.batch[0]].layout.ranks)
        sends = [segments_of(self.matrices, owners, self.batch, self.rank, dst) for dst in world]
        recvs = [segments_of(self.matrices, owners, self.batch, src, self.rank) for src in world]
        return Route(sends, recvs, [self._elements(width, s) for s in sends],
                     [self._elements(width, s) for s in recvs],
                     moves(self.matrices, owners, self.batch), width)

    def _elements(self, width: Callable[[Matrix], int],
                  segments: Iterable[tuple[int, int, int]]) -> int:
        return sum((stop - start) * width(self.matrices[i]) for i, start, stop in segments)

    def received_pieces(self, route: Route, buffer: torch.Tensor,
                        ) -> Iterator[tuple[tuple[int, int, int], torch.Tensor]]:
        """(segment, its rows) of `route`'s receive buffer, laid out as its recvs' segments."""
        segments = [segment for segments in route.recvs for segment in segments]
        pieces = buffer.split([self._elements(route.width, [segment]) for segment in segments])
        return zip(segments, [piece.view(-1, route.width(self.matrices[i]))
                              for (i, _, _), piece in zip(segments, pieces)])


def _all_to_all(route: Route, send: list[torch.Tensor], like: torch.Tensor, group):
    """(the receive buffer, the payload, the in-flight work or None): one variable-size
    all_to_all_single (gloo and NCCL both take split sizes), none where nothing moves."""
    received = like.new_empty(sum(route.recv_counts))
    if not route.moves:
        return received, None, None
    payload = torch.cat([t.reshape(-1) for t in send]) if send else like.new_empty(0)
    work = dist.all_to_all_single(received, payload, route.recv_counts, route.send_counts,
                                  group=group, async_op=True)
    return received, payload, work



class Gathered(NamedTuple):
    """A gather issued: its receive buffer, its payload (None once the caller let it go: the
    collective keeps what it sends until it ends), its in-flight work (None: nothing moved)."""

    received: torch.Tensor
    payload: torch.Tensor | None
    work: object


def issue_gather(routes: OwnerRoutes, group: dist.ProcessGroup | None,
                 local: dict[int, torch.Tensor]) -> Gathered:
    """An exchange's gather all-to-all issued: this rank's rows of each matrix (`local[i]`) to
    its owner."""
    with phase(GATHER):
        return Gathered(*_all_to_all(
            routes.gather, [local[i] for segments in routes.gather.sends for i, _, _ in segments],
            local[routes.batch[0]], group))


class GatheredPart(NamedTuple):
    """Part of an exchange whose gather was issued apart, before the exchange (the gather inside
    backward): its routes, this rank's rows of each of its matrices (only the owned matrices'
    are read, the others' may be empty) and the gather issued."""

    routes: OwnerRoutes
    local: dict[int, torch.Tensor]
    gathered: Gathered


def owner_exchange(routes: OwnerRoutes, group: dist.ProcessGroup | None, local: dict[int, torch.Tensor],
                   orthogonalize: Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]],
                   apply: Callable[[int, torch.Tensor], None],
                   ahead: GatheredPart | None = None,
                   rest: OwnerRoutes | None = None) -> Iterator[None]:
    """One exchange, as a generator that yields after issuing each of its (at most two)
    collectives, so a driver (run_overlapped) can start others before it resumes this one.

    `local[i]`: this rank's rows of each matrix of the exchange. Its gather carries them to their
    owners; where part of it was gathered `ahead`, only the `rest` (None: nothing more) gathers
    here. The owners assemble their full matrices, `orthogonalize(owned, fulls)` each owned
    batch, and send the result rows back, one scatter for the whole exchange; finally `apply(i,
    rows)` for this rank's rows of every matrix (the rows are views into this exchange's
    buffers, which are freed when the generator ends)."""
    parts = [ahead] if ahead else []
    if ahead is None or rest is not None:
        at_step = rest or routes
        parts.append(GatheredPart(at_step, local, issue_gather(at_step, group, local)))
    with held(*(part.gathered.received for part in parts),
               *(part.gathered.payload for part in parts)):
        yield
        with phase(GATHER):
            full, assembled = _assembled_parts(parts)
    del parts  # freed before Newton-Schulz runs (the work holds its tensors)
    results = {}
    with held(*(full[i] for i in assembled)):
        for owned in routes.owned_batches:
            if owned:  # each batch's assembled matrices freed once it has its results
                with phase(NEWTON_SCHULZ):
                    results.update(zip(owned, orthogonalize(owned, [full.pop(i) for i in owned])))
    with phase(SCATTER):
        returned, payload, work = _all_to_all(
            routes.scatter, [results[i][start:stop] for segments in routes.scatter.sends
                             for i, start, stop in segments], local[routes.batch[0]], group)
    with held(returned, payload, *results.values()):
        yield
        with phase(SCATTER):
            if work is not None:
                work.wait()
        rows = {}
        for i in routes.owned:
            start, stop = routes.matrices[i].layout.row_range(routes.rank)
            rows[i] = results[i][start:stop]
        for (i, _, _), piece in routes.received_pieces(routes.scatter, returned):
            rows[i] = piece
        with phase(UPDATE):  # where this rank holds no rows of one: none, as wide as returned
            for i in routes.batch:
                apply(i, rows[i] if i in rows else
                      local[i].new_empty((0, routes.matrices[i].scatter_width)))


def _assembled_parts(parts: list[GatheredPart]) -> tuple[dict, list[int]]:
    """The full matrices this rank owns from each part's gather, and those assembled anew (not
    held whole already)."""
    full, assembled = {}, []
    for part in parts:
        full.update(_assembled(part.routes, part.local, part.gathered.received,
                               part.gathered.work))
        assembled += [i for i in part.routes.owned if full[i] is not part.local[i]]
    return full, assembled


def _assembled(routes: OwnerRoutes, local: dict, received: torch.Tensor, work) -> dict:
    """The full matrices this rank owns, once the gather's rows have arrived."""
    if work is not None:
        work.wait()
    full = {}
    for i in routes.owned:
        layout = routes.matrices[i].layout
        if layout.held(routes.rank) == layout.num_rows:
            full[i] = local[i]  # held whole: nothing to assemble
            continue
        full[i] = local[i].new_empty((layout.num_rows, routes.matrices[i].gather_width))
        start, stop = layout.row_range(routes.rank)
        full[i][start:stop] = local[i]
    for (i, start, stop), piece in routes.received_pieces(routes.gather, received):
        full[i][start:stop] = piece
    return full


def exchange_rounds(streams: Sequence[Iterable[Iterator[None]]]) -> Iterator[Iterator[None]]:
    """Several groups' exchanges (each stream: one group's, in order, as owner_exchange makes
    them) in rounds, for run_overlapped: round k is every stream's k-th exchange as one
    (_exchange_round); a stream's exchange is made when its round is reached (its rows asked
    for then, as run_overlapped takes it). Each group still has at most two exchanges in flight
    (plan.working_memory counts them per group)."""
    for exchanges in zip_longest(*streams):
        present = [exchange for exchange in exchanges if exchange is not None]
        yield present[0] if len(present) == 1 else _exchange_round(present)


def _exchange_round(exchanges: Sequence[Iterator[None]]) -> Iterator[None]:
    """Exchanges of different groups as one, yielding as owner_exchange does: every gather
    issued; then each one's Newton-Schulz run and its scatter issued; then every scatter
    awaited. No group's scatter is awaited before this rank has computed all of them, so a
    rank owning a large matrix of one group and little of another waits for no one between."""
    for _ in range(2):
        for exchange in exchanges:
            next(exchange, None)
        yield
    for exchange in exchanges:
        deque(exchange, maxlen=0)


def run_overlapped(exchanges: Iterable[Iterator[None]], in_flight: int = IN_FLIGHT) -> None:
    """Carry out exchanges (generators yielding at each collective, as owner_exchange) in order,
    `in_flight` at a time: exchange k+1's gather is issued before exchange k computes, and
    exchange k is finished (its rows applied) before exchange k+2 is taken from `exchanges`, so
    at most `in_flight` exchanges hold buffers at once (plan.working_memory counts them). The
    order of collectives depends only on the plan, so every rank issues the same ones."""
    running: deque = deque()
    pending = iter(exchanges)
    while True:
        if len(running) == in_flight:
            deque(running.popleft(), maxlen=0)  # to its end
        exchange = next(pending, None)
        if exchange is None:
            break
        next(exchange, None)  # its gather issued
        running.append(exchange)
        if len(running) == in_flight:
            next(running[0], None)  # the oldest computes and issues its scatter
    for exchange in running:
        deque(exchange, maxlen=0)
