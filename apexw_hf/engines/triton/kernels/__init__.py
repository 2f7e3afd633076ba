"""Triton kernels of ApexW (imports torch, triton and the dependency-free ``apexw_hf._random``). Import lazily: the
package works without triton."""

from .launch import INTERPRETED, LaunchPlan, adamw_step_, tensor_key

__all__ = ["INTERPRETED", "LaunchPlan", "adamw_step_", "tensor_key"]
