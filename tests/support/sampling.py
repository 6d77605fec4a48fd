"""Calling a sampling engine directly, as the server's ``/generate`` route does: one request, its sampling
parameters, the pending call back."""

from __future__ import annotations

from typing import Any

from arctic_rl.protocol import GenerateRequest, SamplingParams


def submit(engine: Any, prompts: list[list[int]], **params: Any) -> Any:
    """``engine.submit_generate`` of ``prompts`` with ``SamplingParams(**params)``; returns the pending call."""
    return engine.submit_generate(GenerateRequest(prompts=prompts), SamplingParams(**params))
