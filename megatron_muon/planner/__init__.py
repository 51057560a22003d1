"""planner: an optimizer's params turned into group plans, once, at construction: its exchange
groups, each param's row layout, matrices, batches, measured rates, owners and exchanges
(group_planner: a GroupPlan per group, group_plan), the dense and expert parts planned and
stepped together (interleaving), Megatron's tags on the params (param_tags). It plans
core.zero_muon.ZeROTensorParallelMuon, which sits above it, typed by what it reads of it
(planned_muon's and interleaving's Protocols). Imports the layers below it."""
