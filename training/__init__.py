"""Training tools for vllm-clover (installed as `vllm_clover_training`)."""
