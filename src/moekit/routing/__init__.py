"""Routing: the router (torch and Triton backends) and synthetic routing scenarios."""

from moekit.routing.router import ROUTER_BACKENDS, route, topk_softmax

__all__ = ["ROUTER_BACKENDS", "route", "topk_softmax"]
from moekit.routing.scenarios import (
    SCENARIOS,
    balanced,
    busiest_over_mean,
    collapse,
    expert_loads,
    from_file,
    hot,
    make_scenario,
    random_router,
    save_trace,
    zipf,
)

__all__ += [
    "SCENARIOS",
    "balanced",
    "busiest_over_mean",
    "collapse",
    "expert_loads",
    "from_file",
    "hot",
    "make_scenario",
    "random_router",
    "save_trace",
    "zipf",
]
