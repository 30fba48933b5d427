"""`eft serve`: an export answering over an OpenAI-compatible API on Ray Serve: what to serve
(`source`), bearer tokens (`auth`), the API's wire format (`openai_api`), CPU generation (`generate`),
the deployment (`app`) and starting it (`launch`); Ray Serve LLM / vLLM configs (`llm_config`) and
the RayService, serve.yaml and vllm-serve.sh of `eft manifests --serve` (`manifests`)."""
