"""vLLM as a Tandem runtime on a worker: its cached CPU install, `tandem worker --runtime vllm`, `tandem up --runtime vllm`."""
