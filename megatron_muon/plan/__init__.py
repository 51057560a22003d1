"""plan: pure functions on shapes and ranks, shared by the optimizer (through planner/) and the
scale estimate (estimate/): rows held (layouts), what travels (traffic), owners (owners), working
memory and budgets (budget), matrices split over teams (team_split), one exchange group's plan
from shapes alone (owner_plan), the offloaded state (offload). No communication, no tensors:
unit-tested without processes. Imports nothing else of megatron_muon; what it offers is what this
module imports.

"A plan" means one thing throughout: what one exchange group's step does (its matrices' owners,
batches and exchanges). plan/ makes it from shapes (owner_plan.OwnerPlan); planner/ makes it
for an optimizer's params (planner.group_plan.GroupPlan), which the optimizer carries out."""

from .budget import (IN_FLIGHT, MAX_EXCHANGE_BYTES, ExchangeMemory, alone_working, batch_bytes,
                     batch_matrices, batches_ahead, exchange_batches, fewest_exchanges,
                     largest_alone, newton_schulz_bytes, owner_bytes, per_exchange_bytes,
                     rank_budgets, state_saved, step_headroom, working_memory)
from .layouts import (Matrix, Nodes, QKVRows, RowLayout, TeamBlock, applies_gram_twice, cost_key,
                      orthogonalization_key, qkv_row_blocks, row_layouts, split_matrices)
from .newton_schulz import GramSchedule, gram_counts, matrix_ns_flops, ns_flops
from .newton_schulz import refusal as gram_refusal
from .offload import OffloadFigures, offload_figures, offloaded
from .owner_plan import (OwnedBatches, OwnerPlan, final_first, owned_batches, owner_plan,
                         packed_beside, packed_plan, step_collectives)
from .owners import (BYTE_SLACK, StepCost, TeamRule, choose_owners, choose_owners_by_time,
                     estimated_seconds, newton_schulz_seconds, rank_loads, whole_matrix_owners)
from .team_split import (TEAM_ABOVE, TeamCost, all_reduce_seconds, block_sizes, can_split,
                         flops_cost, newton_schulz_flops, ring_bytes, team_all_reduces, team_blocks,
                         team_members, team_sizes, team_step_cost, tiered_seconds, with_teams)
from .traffic import (gather_moves, gather_segments, gather_traffic, layout_min_bytes,
                      matrix_traffic, owner_traffic, scatter_moves, scatter_segments,
                      scatter_traffic)
