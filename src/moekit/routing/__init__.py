"""Routing: the router (torch and Triton backends). Synthetic routing scenarios live with the lab
(`moekit.bench.scenarios`)."""

from moekit.routing.router import ROUTER_BACKENDS, check_router_backend, route, topk_softmax

__all__ = ["ROUTER_BACKENDS", "check_router_backend", "route", "topk_softmax"]
