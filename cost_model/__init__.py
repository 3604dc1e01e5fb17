"""Cost model: per-node FLOPs / bytes / saved activations, device profiles, roofline and comm times.

Terms: see device.py (profile), profiles.py (named profiles), flops.py (NodeCost fields), kernels.py (what kernels
reach), roofline.py (op time), comm.py (collectives by node span), step_time.py (the step, plan.predicted_step),
measured.py (measured fits), model_fit.py (fits rescaled to a model).
"""
from autosplit.cost_model.annotate import AnnotateCosts
from autosplit.cost_model.calibrate import calibrate, measure_link
from autosplit.cost_model.comm import (all_gather_time, all_reduce_time, collective_time, p2p_time,
                                       reduce_scatter_time)
from autosplit.cost_model.device import A100, H100, H200, DeviceProfile
from autosplit.cost_model.flops import NodeCost, node_cost
from autosplit.cost_model.model_fit import ModelFit, fit_to_model
from autosplit.passes.op_names import op_name
from autosplit.cost_model.profiles import get_profile, profile_for_gpu
from autosplit.cost_model.roofline import graph_time, op_time

__all__ = ["A100", "H100", "H200", "profile_for_gpu", "DeviceProfile", "get_profile", "calibrate", "measure_link", "NodeCost",
           "node_cost", "op_name", "AnnotateCosts", "op_time", "graph_time", "p2p_time", "all_reduce_time",
           "all_gather_time", "reduce_scatter_time", "collective_time", "fit_to_model", "ModelFit"]
