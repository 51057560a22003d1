"""What travels when a matrix is assembled on its owner and its result sent back: bytes per rank,
and the row segments each pair of ranks exchanges."""

from typing import Sequence

from .layouts import Matrix


def layout_min_bytes(matrices: Sequence[Matrix], element_bytes: int) -> int:
    """The least any exact owner-compute exchange can move (all ranks together): every matrix
    owned by a rank holding most of its rows."""
    return sum(m.least_bytes(element_bytes) for m in matrices)


def gather_traffic(matrix: Matrix, owner: int, element_bytes: int) -> dict[int, list[int]]:
    """{rank: [bytes received, bytes sent]} of assembling one matrix on `owner`: it gets the
    rows it lacks, every shard from one holder (the one in its replica)."""
    layout, row_bytes = matrix.layout, matrix.gather_width * element_bytes
    traffic: dict[int, list[int]] = {}
    for shard, rows in layout.nonempty_shards:
        if shard != layout.shard_of[owner]:
            traffic.setdefault(layout.source(shard, owner), [0, 0])[1] += rows * row_bytes
            traffic.setdefault(owner, [0, 0])[0] += rows * row_bytes
    return traffic


def scatter_traffic(matrix: Matrix, owner: int, element_bytes: int) -> dict[int, list[int]]:
    """{rank: [bytes received, bytes sent]} of returning one matrix's result: the owner sends
    every other rank holding rows (replicas too) its rows."""
    layout, row_bytes = matrix.layout, matrix.scatter_width * element_bytes
    traffic: dict[int, list[int]] = {}
    for shard, rows in layout.nonempty_shards:
        for rank in layout.holders(shard):
            if rank != owner:
                traffic.setdefault(rank, [0, 0])[0] += rows * row_bytes
                traffic.setdefault(owner, [0, 0])[1] += rows * row_bytes
    return traffic


def matrix_traffic(matrix: Matrix, owner: int, element_bytes: int) -> dict[int, list[int]]:
    """{rank: [bytes received, bytes sent]} of the ranks one matrix moves bytes for with `owner`:
    gather_traffic and scatter_traffic together."""
    traffic = gather_traffic(matrix, owner, element_bytes)
    for rank, (into, out) in scatter_traffic(matrix, owner, element_bytes).items():
        both = traffic.setdefault(rank, [0, 0])
        both[0] += into
        both[1] += out
    return traffic


def owner_traffic(matrices: Sequence[Matrix], owners: Sequence[int], element_bytes: int,
                  direction=matrix_traffic) -> tuple[list[int], list[int]]:
    """(bytes received, bytes sent) by each rank in an owner step (matrix_traffic, summed), or
    in one `direction` of it (gather_traffic, scatter_traffic)."""
    world = matrices[0].layout.ranks if matrices else 0
    received, sent = [0] * world, [0] * world
    for matrix, owner in zip(matrices, owners):
        for rank, (into, out) in direction(matrix, owner, element_bytes).items():
            received[rank] += into
            sent[rank] += out
    return received, sent


def gather_segments(matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int],
                    src: int, dst: int) -> list[tuple[int, int, int]]:
    """(matrix, first row, end row) of the rows `src` sends `dst` to assemble the batch matrices
    `dst` owns, in batch order: each shard the owner lacks comes from one holder, the one in the
    owner's replica."""
    segments = []
    for i in batch:
        layout = matrices[i].layout
        shard = layout.shard_of[src]
        if (owners[i] == dst and layout.held(src) and shard != layout.shard_of[dst]
                and layout.source(shard, dst) == src):
            segments.append((i, *layout.row_range(src)))
    return segments


def gather_moves(matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int]) -> bool:
    """Whether gathering the batch moves any rows: some owner lacks rows of its matrix."""
    return any(matrices[i].layout.held(owners[i]) < matrices[i].layout.num_rows for i in batch)


def scatter_moves(matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int]) -> bool:
    """Whether scattering the batch's results moves any rows: a rank besides some matrix's owner
    holds rows of it."""
    return any(matrices[i].layout.held_by_all > matrices[i].layout.held(owners[i]) for i in batch)


def scatter_segments(matrices: Sequence[Matrix], owners: Sequence[int], batch: Sequence[int],
                     src: int, dst: int) -> list[tuple[int, int, int]]:
    """(matrix, first row, end row) of the result rows `src` sends `dst`: every rank gets its own
    rows of each batch matrix from the matrix's owner."""
    if src == dst:
        return []
    return [(i, *matrices[i].layout.row_range(dst)) for i in batch
            if owners[i] == src and matrices[i].layout.held(dst)]
