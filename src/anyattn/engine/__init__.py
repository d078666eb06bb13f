"""A small inference engine (nano-vllm style) that drives anyattn's attention layer end to end."""
