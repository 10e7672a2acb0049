"""The method layer: policies, schedule, caches and per-call decisions. Imports no ComfyUI code."""
