"""The plan: pure functions on shapes and ranks, shared by the optimizer and the scale model
(benchmarks/scale_model.py). Which rows of each matrix each rank holds (layouts), what travels
(traffic), who owns each matrix (owners), how much working memory an exchange holds and what
budget it fits (budget), which matrices a team of ranks splits (teams), one exchange group's
plan from them (owner_plan), and what offloading the state to host memory keeps there and
streams (offload). No communication, no tensors: unit-tested without processes. Imports nothing
else of megatron_muon."""

from .budget import (IN_FLIGHT, MAX_EXCHANGE_BYTES, ExchangeMemory, alone_working, batch_bytes,
                     batch_matrices, exchange_batches, fewest_exchanges, largest_alone,
                     newton_schulz_bytes, owner_bytes, per_exchange_bytes, rank_budgets,
                     state_saved, step_headroom, working_memory)
from .layouts import (Matrix, QKVRows, RowLayout, TeamBlock, applies_gram_twice, cost_key,
                      ns_flops, orthogonalization_key, qkv_row_blocks, row_layouts, split_matrices)
from .offload import OffloadFigures, offload_figures, offloaded
from .owner_plan import (OwnedBatches, OwnerPlan, owned_batches, owner_plan, packed_beside,
                         packed_plan)
from .owners import (BYTE_SLACK, StepCost, choose_owners, choose_owners_by_time, estimated_seconds,
                     newton_schulz_seconds, rank_loads, whole_matrix_owners)
from .teams import (TEAM_ABOVE, TeamCost, all_reduce_seconds, block_sizes, can_split,
                    flops_cost, newton_schulz_flops, ring_bytes, team_all_reduces, team_blocks,
                    team_members, team_sizes, team_step_cost, with_teams)
from .traffic import (gather_moves, gather_segments, gather_traffic, layout_min_bytes,
                      matrix_traffic, owner_traffic, scatter_moves, scatter_segments,
                      scatter_traffic)

__all__ = ["BYTE_SLACK", "ExchangeMemory", "IN_FLIGHT", "MAX_EXCHANGE_BYTES", "Matrix",
           "OffloadFigures", "OwnedBatches", "OwnerPlan", "QKVRows", "RowLayout", "StepCost",
           "TEAM_ABOVE", "TeamBlock", "TeamCost", "all_reduce_seconds", "block_sizes",
           "can_split", "flops_cost", "newton_schulz_flops", "ring_bytes", "team_all_reduces",
           "team_blocks", "team_members", "team_sizes", "team_step_cost", "with_teams",
           "alone_working", "applies_gram_twice", "batch_bytes", "batch_matrices", "choose_owners",
           "choose_owners_by_time", "cost_key", "estimated_seconds", "exchange_batches",
           "fewest_exchanges", "gather_moves", "gather_segments", "gather_traffic",
           "largest_alone", "layout_min_bytes", "matrix_traffic", "newton_schulz_bytes",
           "newton_schulz_seconds", "ns_flops", "offload_figures", "offloaded",
           "orthogonalization_key", "owned_batches", "owner_bytes", "owner_plan", "packed_beside",
           "packed_plan", "owner_traffic", "per_exchange_bytes", "qkv_row_blocks", "rank_budgets",
           "rank_loads", "row_layouts", "scatter_moves", "scatter_segments", "scatter_traffic",
           "split_matrices", "state_saved", "step_headroom", "whole_matrix_owners",
           "working_memory"]
