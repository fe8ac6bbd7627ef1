"""Device kernels of the decode path, each with a torch reference beside it."""

from .fetch import FetchPlan, fetch_blocks, fetch_blocks_ref, plan_fetch

__all__ = ["FetchPlan", "fetch_blocks", "fetch_blocks_ref", "plan_fetch"]
