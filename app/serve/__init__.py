"""`eft serve`: an export answering over an OpenAI-compatible API on Ray Serve: what to serve
(`source`), bearer tokens (`auth`), the API's wire format (`openai_api`), CPU generation (`generate`),
the deployment (`app`) and starting it (`launch`); Serve LLM / vLLM configs for GPU clusters
(`llm_config`)."""
