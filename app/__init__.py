"""CPU-only LLM inference appliance.

`from app import LLM, SamplingParams` is the offline API; the rest (spec, topology, placement,
kernels, model, engine) lives in the subpackages. Imports are lazy so that the CLI stays quick.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from app.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from app.engine.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'app' has no attribute {name!r}")
