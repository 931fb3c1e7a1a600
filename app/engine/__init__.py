"""The engine: KV cache manager, scheduler, model runner, sampler and the step loop."""
