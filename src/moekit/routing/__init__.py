"""Routing: the router (torch and Triton backends) and synthetic routing scenarios."""

from moekit.routing.router import ROUTER_BACKENDS, route, topk_softmax

__all__ = ["ROUTER_BACKENDS", "route", "topk_softmax"]
