"""The sharding engine: one propagation of placements over the tensor-parallel axes, per-op rules,
strategies chosen by cost, and the lowering to per-rank graphs.

Files, in the order they run:
  factors.py    logical dims (factors, classes) shared by every op, refined by reshapes
  rules.py      the one op table: how each op maps its operands' dims to its output's
  strategies.py per node, the ways to run it over one axis (placements in, out), and their prices
  engine.py     builds the table for a graph, and the integer program's inputs
  solve.py      the integer program (scipy's HiGHS): one strategy per node, least predicted time
  lower.py      the choice as graph nodes: collectives, local shards, local sizes
  megatron.py   1D tensor parallelism (and sequence parallelism) as the engine's candidate sets
  describe.py   what was chosen, per layer and block, and one op's candidates (plan.explain)
  tp_plan.py    the per-rank plan the runtime binds (shards, makers, partial gradients)

This room imports cost_model (prices), autosplit.tp (the collectives' graph vocabulary and local
modules) and the passes' helpers (op_dims, op_names); never the runtime.
"""
