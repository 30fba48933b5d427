"""Starting `eft serve`: every check first (bind address and token, engine, what to serve), then
Ray, Serve's HTTP proxy and the application, then a wait until the API answers at its URL.

Ray is the one eft's other commands use (app/cluster.py): the cluster RAY_ADDRESS names, with
Ray's token auth, else a Ray started in this process (token auth on) that ends with it. Serve's
proxy binds `host:port` for the whole cluster, once: a Serve already running there keeps its own
address (a RayService's 0.0.0.0:8000, an earlier `eft serve --host 0.0.0.0`). So the address the
proxy really listens on is read back before the application is deployed, and held to the bind
rule (app/serve/auth.py `check_proxy_address`): a token-less model never lands on a proxy that
listens beyond this machine, and the URL printed is where the proxy is.

Engines: `transformers` (app/serve/app.py: `generate` in each replica, on CPU) and `vllm`, Ray
Serve LLM's OpenAI app over the LLMConfig that app/serve/llm_config.py's `build_llm_config`
builds (model ids: the run's name, or `<name>-base:<checkpoint>` with --adapter); `auto` takes
vllm when it is installed and the cluster has GPUs.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

from app.cluster import find_free_port
from app.serve.auth import check_bind, check_proxy_address, warn_token_in_clear
from app.serve.source import ServedModel, resolve_served_model

log = logging.getLogger("eft.serve")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_APP = "eft"
DEFAULT_MAX_TOKENS = 256
ENGINES = ("auto", "transformers", "vllm")
ANY_ADDRESS = ("0.0.0.0", "::", "")
# After serve.run returns the replicas are up; the proxy's routes follow within a second or two.
READY_TIMEOUT_S = 30.0


class ServeError(RuntimeError):
    """`eft serve` cannot start as asked; one line."""


@dataclass
class ServeHandle:
    """A running `eft serve` application: where its API is and which model it answers as."""

    url: str  # the OpenAI base URL, ending in /v1
    model: str
    app_name: str
    engine: str
    started_ray: bool  # this process started the Ray it runs on; stop() ends that Ray too

    def stop(self) -> None:
        """Delete the application; shut Serve down when no other application is left (so its
        proxy's port is free again)."""
        from ray import serve

        try:
            serve.delete(self.app_name)
            if not serve.status().applications:
                serve.shutdown()
        finally:
            if self.started_ray:
                import ray

                ray.shutdown()

    def wait(self, on_waiting: Optional[Callable[[], None]] = None) -> None:
        """Block until Ctrl-C (SIGINT) or SIGTERM, then stop. Both are set here, not inherited: a
        process started in the background by a non-interactive shell (`eft serve … &` in a script,
        or under a CI runner) inherits SIGINT ignored, and would otherwise never stop on it.
        `on_waiting` runs once the handlers are set, so whoever reacts to what it says (a script
        that waits for the line, then signals) cannot signal into the window before them."""
        previous = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if on_waiting is not None:
                on_waiting()
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            log.info("stopping %s", self.app_name)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop()


def raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def check_engine_installed(engine: str) -> None:
    if engine not in ENGINES:
        raise ServeError(f"--engine {engine}: one of {', '.join(ENGINES)}")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ServeError("--engine vllm: vLLM is not installed (pip install 'eft[serve-gpu]'), or use "
                         "--engine transformers")


def start_serve(target: str, *, host: str = DEFAULT_HOST, port: Optional[int] = DEFAULT_PORT, replicas: int = 1,
                token: Optional[str] = None, overrides: Optional[list[str]] = None, model_name: Optional[str] = None,
                prefer_adapter: bool = False, engine: str = "auto", cpus_per_replica: float = 1.0,
                max_tokens: int = DEFAULT_MAX_TOKENS, app_name: str = DEFAULT_APP) -> ServeHandle:
    """Serve `target` (a job CONFIG: its latest export; or an export URI) and return once its API
    answers. `port=None` takes a free one. Does not block: `handle.wait()` does, `handle.stop()` ends it."""
    check_bind(host, token)  # before any work: no model read, no Ray started
    check_engine_installed(engine)
    if port is not None and not 1 <= port <= 65535:
        raise ServeError(f"--port {port}: a TCP port, 1 to 65535")
    if replicas < 1:
        raise ServeError(f"--replicas {replicas}: at least 1")
    if max_tokens < 1:
        raise ServeError(f"--max-tokens {max_tokens}: at least 1")
    if not cpus_per_replica > 0:
        raise ServeError(f"--cpus-per-replica {cpus_per_replica}: more than 0")
    served = resolve_served_model(target, overrides, model_name, prefer_adapter)
    import ray

    from app.cluster import init_ray
    from app.serve.auth import token_digest

    started_ray = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    init_ray()
    handle = None
    try:
        engine = pick_engine(engine, token)
        if engine == "vllm":
            application = build_vllm_app(served, replicas)
        else:
            from app.serve.app import build_app

            application = build_app(served, token_digest(token), replicas, cpus_per_replica, max_tokens)
        host, port = start_proxy(host, port, token)
        handle = deploy(application, served, host, port, app_name, engine, started_ray)
        wait_ready(handle, probe_url(host, port), token)
    except BaseException:
        clean_up(handle, started_ray)
        raise
    log.info("serving %s (%s, %d replica(s), %s engine) at %s", served.name, served.kind, replicas, engine, handle.url)
    return handle


def clean_up(handle: Optional[ServeHandle], started_ray: bool) -> None:
    """After a failed start: the application gone, and the Ray this process started."""
    if handle is not None:
        try:
            handle.stop()
        except Exception as err:  # noqa: BLE001: the error that ended the start is the one to report
            log.warning("could not delete the %s application: %s", handle.app_name, first_line(err))
    if started_ray:
        import ray

        ray.shutdown()


def pick_engine(engine: str, token: Optional[str]) -> str:
    """vllm when asked, or under `auto` when it is installed and the cluster has GPUs; else transformers."""
    if engine == "transformers":
        return engine
    import ray

    has_vllm = importlib.util.find_spec("vllm") is not None
    gpus = ray.cluster_resources().get("GPU", 0)
    if engine == "vllm":
        if not gpus:
            raise ServeError("--engine vllm: the Ray cluster has no GPUs (use --engine transformers)")
        if token is not None:
            raise ServeError("--engine vllm: Serve LLM's OpenAI app does not check eft's bearer token; serve it on "
                             "loopback without one, or use --engine transformers")
        return engine
    if has_vllm and gpus and token is not None:
        log.warning("engine auto: vLLM and GPUs are here, but Serve LLM's app does not check the bearer token; "
                    "serving with the transformers engine")
        return "transformers"
    return "vllm" if has_vllm and gpus else "transformers"


def build_vllm_app(served: ServedModel, replicas: int):
    """Ray Serve LLM's OpenAI app over the export (app/serve/llm_config.py): the merged tree, or
    the base with the run's adapters loaded on demand; the training chat template either way."""
    from ray.serve.llm import build_openai_app

    from app.serve.llm_config import build_llm_config
    from app.serve.source import read_chat_template, read_lora_rank
    from app.storage import Store

    store = Store(served.endpoint, served.region, interactive=True)
    rank = read_lora_rank(store, served.adapter_uri) if served.kind == "adapter" else None
    template = read_chat_template(store, served.tokenizer_uri)
    config = build_llm_config(served, num_replicas=replicas, chat_template=template, lora_rank=rank)
    return build_openai_app({"llm_configs": [config]})


def start_proxy(host: str, port: Optional[int], token: Optional[str]) -> tuple[str, int]:
    """Serve's HTTP proxy at `host:port` (`port` None: a free one), or the one already running on
    the cluster, which keeps its own address: that address, once it passes the bind rule."""
    from ray import serve

    from app.compat import serve_http_address

    port_asked = port or find_free_port(DEFAULT_HOST if host in ANY_ADDRESS else host)
    serve.start(http_options={"host": host, "port": port_asked})
    actual = serve_http_address()
    if actual is None:
        raise ServeError("Serve did not start on this Ray cluster (`serve status` says why)")
    check_proxy_address(host, port, actual, token)
    warn_token_in_clear(actual[0], token)
    return actual


def deploy(application, served: ServedModel, host: str, port: int, app_name: str, engine: str,
           started_ray: bool) -> ServeHandle:
    """The application on the running proxy, at route `/`."""
    from ray import serve

    try:
        serve.run(application, name=app_name, route_prefix="/")
    except Exception as err:  # a replica that failed to start: its first line says why
        serve.delete(app_name)
        raise ServeError(f"{served.export_uri}: the {app_name!r} application did not start "
                         f"({first_line(err)})") from None
    return ServeHandle(url=public_url(host, port), model=served.name, app_name=app_name, engine=engine,
                       started_ray=started_ray)


def public_url(host: str, port: int) -> str:
    if host in ANY_ADDRESS:
        import ray

        host = ray.util.get_node_ip_address()
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def probe_url(host: str, port: int) -> str:
    local = DEFAULT_HOST if host in ANY_ADDRESS else host
    return f"http://{f'[{local}]' if ':' in local else local}:{port}/v1/models"


def wait_ready(handle: ServeHandle, url: str, token: Optional[str], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until GET /v1/models lists the model: the proxy routes to the replicas."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                listed = [m.get("id") for m in json.loads(response.read()).get("data", [])]
                if handle.model in listed:
                    return
                last = f"it lists {listed}"
        except urllib.error.HTTPError as err:
            last = f"HTTP {err.code}"
        except (OSError, ValueError) as err:
            last = type(err).__name__
        time.sleep(0.25)
    raise ServeError(f"{url}: the application started but does not answer there ({last})")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
