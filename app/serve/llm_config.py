"""An export served by Ray Serve LLM (vLLM): the `LLMConfig` that `eft serve --engine vllm` runs,
the Serve application config that a KubeRay RayService (`serveConfigV2`) or `serve deploy` runs,
and the equivalent `vllm serve` command line for serving outside Ray. One description of the
model feeds all three, so they serve the same weights under the same name in the same format.

- **The merged export** (default): `model_source` is the export's `merged/` tree; clients ask for
  the run's name.
- **The base plus the run's adapters** (`serve.adapter`, `eft serve --adapter`): `model_source` is
  the base (its hub mirror, for an `hf://` run) and `lora_config.dynamic_lora_loading_path` is
  `<run>/adapters`, where each export publishes its adapter (app/export.py). Serve LLM loads one
  when a request names it: clients ask for `<name>-base:<checkpoint>`.
- **The chat template** the run trained with goes in explicitly (vLLM's `chat_template`), read from
  the tree whose tokenizer `eft serve` uses: requests are rendered in the training format even
  when a base's own tokenizer carries another template.

Nothing here imports vLLM or Ray Serve LLM: the dicts are plain data; `build_llm_config` makes
Ray's public `LLMConfig`, which needs vLLM installed, and `check_llm_config` validates a dict
against Ray's own model where vLLM is absent (app/compat.py).
"""

from __future__ import annotations

import shlex
from typing import Optional

from app.serve.auth import MIN_TOKEN_CHARS
from app.serve.source import ServedModel

SERVE_LLM_IMPORT_PATH = "ray.serve.llm:build_openai_app"
SERVE_APP_NAME = "eft"
SERVE_PORT = 8000
# vLLM's accepted --max-lora-rank values (vllm.config.lora.MaxLoRARanks, 0.29).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Weights fill at most this share of a GPU's memory; the rest is vLLM's KV cache and activations.
WEIGHTS_SHARE = 0.5
GIB = 1 << 30


class LLMConfigError(ValueError):
    """What is asked cannot be served by Serve LLM as it stands; one line."""


def base_model_id(name: str) -> str:
    """The model id of the base under the adapters: clients ask for `<this>:<checkpoint>`."""
    return f"{name}-base"


def served_model_ids(served: ServedModel) -> list[str]:
    """The ids clients put in requests: the merged model's, or the base's and this export's adapter."""
    if served.kind != "adapter":
        return [served.name]
    return [base_model_id(served.name), f"{base_model_id(served.name)}:{served.adapter_id}"]


def pick_tensor_parallel(weight_bytes: int, gpu_memory_gib: float, gpus_per_node: int) -> int:
    """The fewest GPUs (a power of two, within one node) whose memory holds the weights in
    WEIGHTS_SHARE of it."""
    size = 1
    while size <= gpus_per_node:
        if weight_bytes <= WEIGHTS_SHARE * size * gpu_memory_gib * GIB:
            return size
        size *= 2
    raise LLMConfigError(f"the weights ({weight_bytes / GIB:.0f} GiB) do not fit one node's {gpus_per_node} GPUs "
                         f"of {gpu_memory_gib:g} GiB with room for the KV cache; pick a larger --node-type or set "
                         f"serve.tensor_parallel_size")


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts for --max-lora-rank that holds adapters of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise LLMConfigError(f"lora.r {rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; serve the merged "
                         f"model instead (serve.adapter: false)")


def check_adapter_export(served: ServedModel, lora_rank: Optional[int]) -> int:
    """What serving the export's adapter needs: it published in Serve LLM's layout, and its rank.
    Returns the --max-lora-rank vLLM is to start with."""
    if not served.adapters_uri or not served.adapter_id:
        raise LLMConfigError(f"{served.export_uri}: this export did not publish its adapter for Serve LLM "
                             f"(<run>/adapters/<checkpoint>/); export it again with this eft")
    if lora_rank is None:
        raise LLMConfigError(f"{served.export_uri}: serving adapters needs the run's lora.r")
    return max_lora_rank(lora_rank)


def build_llm_config_dict(served: ServedModel, *, tensor_parallel_size: int = 1, chat_template: Optional[str] = None,
                          num_replicas: Optional[int] = None, min_replicas: int = 1, max_replicas: int = 1,
                          target_ongoing_requests: int = 16, max_model_len: Optional[int] = None,
                          lora_rank: Optional[int] = None, max_adapters_per_replica: int = 16,
                          accelerator_type: Optional[str] = None) -> dict:
    """A Serve LLM `LLMConfig` as plain data. `num_replicas` fixes the count; otherwise Serve's
    autoscaler keeps between `min_replicas` and `max_replicas`. `served.kind == "adapter"` serves
    the base with dynamic LoRA loading from the run's adapters (`lora_rank`: the run's lora.r)."""
    adapter = served.kind == "adapter"
    engine_kwargs: dict = {"tensor_parallel_size": tensor_parallel_size}
    if max_model_len is not None:
        engine_kwargs["max_model_len"] = max_model_len
    if chat_template is not None:
        engine_kwargs["chat_template"] = chat_template
    config: dict = {"model_loading_config": {"model_id": served_model_ids(served)[0],
                                             "model_source": served.model_uri}}
    if adapter:
        engine_kwargs.update(enable_lora=True, max_lora_rank=check_adapter_export(served, lora_rank))
        config["lora_config"] = {"dynamic_lora_loading_path": served.adapters_uri,
                                 "max_num_adapters_per_replica": max_adapters_per_replica}
    config["engine_kwargs"] = engine_kwargs
    if accelerator_type is not None:
        config["accelerator_type"] = accelerator_type
    if num_replicas is not None:
        config["deployment_config"] = {"num_replicas": num_replicas}
    else:
        config["deployment_config"] = {"autoscaling_config": {
            "min_replicas": min_replicas, "max_replicas": max_replicas,
            "target_ongoing_requests": target_ongoing_requests}}
    # The replicas read the export through the same S3 endpoint eft does; never any credential.
    env = {"HF_HUB_OFFLINE": "1"}
    if served.endpoint:
        env["AWS_ENDPOINT_URL"] = served.endpoint
    config["runtime_env"] = {"env_vars": env}
    return config


def build_llm_config(served: ServedModel, num_replicas: int, chat_template: Optional[str] = None,
                     lora_rank: Optional[int] = None):
    """Ray Serve LLM's `LLMConfig` for `eft serve --engine vllm` (vLLM installed, GPUs on the cluster)."""
    from ray.serve.llm import LLMConfig

    return LLMConfig(**build_llm_config_dict(served, num_replicas=num_replicas, chat_template=chat_template,
                                             lora_rank=lora_rank))


def check_llm_config(config: dict) -> None:
    """`config` as Ray's own LLMConfig model reads it; LLMConfigError naming the first problem."""
    from pydantic import ValidationError

    from app.compat import validate_llm_config

    try:
        validate_llm_config(config)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise LLMConfigError(f"Ray Serve LLM refuses the LLMConfig: {where}: {first['msg']}") from None


def build_serve_app_config(llm_configs: list[dict], app_name: str = SERVE_APP_NAME, port: int = SERVE_PORT) -> dict:
    """The Serve config file (`serve deploy serve.yaml`, a RayService's `serveConfigV2`): Serve
    LLM's OpenAI app over the configs, its proxy on every node at `port`."""
    return {"proxy_location": "EveryNode",
            "http_options": {"host": "0.0.0.0", "port": port},
            "applications": [{"name": app_name, "route_prefix": "/", "import_path": SERVE_LLM_IMPORT_PATH,
                              "args": {"llm_configs": llm_configs}}]}


def check_serve_app_config(config: dict) -> None:
    """The Serve config as `serve deploy` reads it (Ray's public ServeDeploySchema)."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as err:
        first = err.errors()[0]
        raise LLMConfigError(f"serve.yaml: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None


TEMPLATE_FILE = "chat_template.jinja"


# The guard at the top of vllm-serve.sh, before anything is fetched: vLLM's own default host is
# every interface with no key, so the script binds to loopback unless EFT_VLLM_HOST says otherwise,
# and a wider bind needs the key from EFT_VLLM_API_KEY_FILE, the rule `eft serve` keeps
# (app/serve/auth.py). The key goes to vLLM as VLLM_API_KEY, which it reads when --api-key is not
# given: an argument would show in every `ps` listing on the machine.
VLLM_GUARD = r"""host="${EFT_VLLM_HOST:-127.0.0.1}"
loopback='^(127\.[0-9]+\.[0-9]+\.[0-9]+|::1|localhost)$'
for arg in "$@"; do
    case "$arg" in
        --host | --host=* | --api-key | --api-key=*)
            echo "vllm-serve.sh: $arg: set EFT_VLLM_HOST or EFT_VLLM_API_KEY_FILE instead" >&2
            exit 2 ;;
    esac
done
if [[ -n "${EFT_VLLM_API_KEY_FILE:-}" ]]; then
    if [[ ! -f "$EFT_VLLM_API_KEY_FILE" ]]; then
        echo "vllm-serve.sh: EFT_VLLM_API_KEY_FILE $EFT_VLLM_API_KEY_FILE: no such file" >&2
        exit 2
    fi
    # The first line that is not blank, without surrounding whitespace (as eft serve's --token-file).
    key="$(awk 'NF { sub(/^[[:space:]]+/, ""); sub(/[[:space:]]+$/, ""); print; exit }' "$EFT_VLLM_API_KEY_FILE")"
    if (( ${#key} < MIN_CHARS )); then
        echo "vllm-serve.sh: EFT_VLLM_API_KEY_FILE $EFT_VLLM_API_KEY_FILE: the key is empty or shorter than MIN_CHARS characters; use a long random one (openssl rand -hex 32)" >&2
        exit 2
    fi
    export VLLM_API_KEY="$key"
    unset key
elif [[ ! "$host" =~ $loopback ]]; then
    echo "vllm-serve.sh: EFT_VLLM_HOST=$host listens beyond this machine: give the API key every request must carry (EFT_VLLM_API_KEY_FILE=FILE), or serve on 127.0.0.1" >&2
    exit 2
fi
if [[ -n "${VLLM_API_KEY:-}" && ! "$host" =~ $loopback ]]; then
    echo "vllm-serve.sh: warning: the API key travels over plain HTTP to $host; put a TLS gateway in front" >&2
fi""".replace("MIN_CHARS", str(MIN_TOKEN_CHARS))


def build_vllm_script(served: ServedModel, *, chat_template: Optional[str],
                      tensor_parallel_size: int = 1, max_model_len: Optional[int] = None,
                      lora_rank: Optional[int] = None, port: int = SERVE_PORT) -> str:
    """A shell script that fetches the served trees and runs `vllm serve` on them, outside Ray:
    the same model ids, template and parallelism as the Serve LLM config. vLLM reads local
    directories, so the trees are copied down first (`aws s3 sync`; a local export is used in place).
    It listens on 127.0.0.1 unless EFT_VLLM_HOST says otherwise, which needs an API key (VLLM_GUARD)."""
    adapter = served.kind == "adapter"
    ids = served_model_ids(served)
    lines = ["#!/usr/bin/env bash",
             f"# Serve {served.name} ({served.export_uri}) with plain vLLM, outside Ray: the same model, name and",
             "# chat template as the RayService. Needs vLLM (pip install vllm) and, for s3:// trees, the AWS CLI.",
             "# Clients: an OpenAI base URL of http://HOST:PORT/v1 and a model of " +
             " or ".join(ids) + ".",
             "# Listens on 127.0.0.1; EFT_VLLM_HOST=ADDRESS for another, which needs EFT_VLLM_API_KEY_FILE=FILE",
             f"# (its first line, {MIN_TOKEN_CHARS} characters at least, is the key clients send as their API key).",
             "# vLLM speaks plain HTTP and checks the key on /v1 only: beyond loopback, put a gateway in front",
             "# that terminates TLS and passes only /v1 (docs/serving.md).",
             "set -euo pipefail",
             VLLM_GUARD,
             'here="$(cd "$(dirname "$0")" && pwd)"',
             'trees="${EFT_VLLM_DIR:-$here/trees}"']
    if served.endpoint:
        lines.append(f"export AWS_ENDPOINT_URL={shlex.quote(served.endpoint)}")
    model_dir = '"$trees/base"' if adapter else '"$trees/model"'
    lines += fetch_lines(served.model_uri, model_dir)
    args = [f"vllm serve {model_dir}", f"--served-model-name {shlex.quote(ids[0])}",
            '--host "$host"', f"--port {port}", f"--tensor-parallel-size {tensor_parallel_size}"]
    if max_model_len is not None:
        args.append(f"--max-model-len {max_model_len}")
    if chat_template is not None:
        args.append(f'--chat-template "$here/{TEMPLATE_FILE}"')
    if adapter:
        rank = check_adapter_export(served, lora_rank)
        lines += fetch_lines(served.adapter_uri, '"$trees/adapter"')
        args += ["--enable-lora", f'--lora-modules {shlex.quote(ids[1])}="$trees/adapter"', f"--max-lora-rank {rank}"]
    lines.append('exec ' + " \\\n    ".join(args) + ' "$@"')
    return "\n".join(lines) + "\n"


def fetch_lines(uri: str, local: str) -> list[str]:
    if uri.startswith("s3://"):
        return [f'mkdir -p {local}', f"aws s3 sync --only-show-errors {shlex.quote(uri)} {local}"]
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return [f'mkdir -p "$(dirname {local})"', f"ln -sfn {shlex.quote(path)} {local}"]
