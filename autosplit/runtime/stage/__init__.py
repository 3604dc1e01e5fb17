"""Stage modules: what one pipeline stage's module is made of, before anything communicates.

  checkpointing.py  a stage split into its layers; activation checkpointing of them
  params.py         parameters in graph order; keeping the objects an optimizer holds

May import: the graph side (passes, model_layers, meta_init); of the runtime, this room only.
"""
