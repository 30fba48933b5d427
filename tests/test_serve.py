"""`eft serve` against a real export on the session's Ray: Ray Serve on loopback, asked through
the real `openai` client, answers as `generate` on the export answers with the export's chat
template (greedy); streams whose deltas join to the same text; refuses a wrong or absent token.
The fast tier checks what is refused before any work: a bind beyond loopback without a token, a
config or URI with no export, a short token.

The export is the real format, written by `export_run` from a checkpoint written as training
writes one (tests/test_export.py), of a tiny chat base with ChatML's template; no training run.
One Serve application serves every cluster test of the module; it is deleted, and Serve shut
down, at the module's end. The one test that needs a Serve of its own (one listening on every
interface, as a RayService's does) runs before it, and shuts its Serve down.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import urllib.error
import urllib.request

import pytest
import torch

from app.cli import main
from app.config import build_config
from app.dev.tiny import add_chat_template, build_corpus, build_tiny_model, build_tiny_tokenizer
from app.export import export_run
from app.storage import Store, join
from test_export import build_trained_model, write_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

RUNS = "s3://eft/serve-test-runs"
TOKEN = secrets.token_hex(16)
QUESTIONS = ["What is a list?", "Explain the import statement.", "How do loops work?"]
MAX_TOKENS = 12


def make_cfg(name: str, base_uri: str):
    return build_config({
        "name": name, "model": {"uri": base_uri}, "data": {"uri": "s3://eft/data/unused"},
        "prepare": {"input_uri": "s3://eft/raw/unused.jsonl", "format": "chat"},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]},
        "training": {"max_steps": 10}, "storage": {"root_uri": RUNS},
    })


@pytest.fixture(scope="module")
def exported(s3):
    """A LoRA run of a tiny ChatML base, its checkpoint at step 4 exported with merge=True."""
    store = Store()
    tokenizer = add_chat_template(build_tiny_tokenizer(build_corpus(max_docs=200), vocab_size=384))
    model = build_tiny_model(tokenizer, initializer_range=0.5)
    base_uri = "s3://eft/models/serve-chat"
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        store.upload_dir(tmp, base_uri, last=("config.json",))
    cfg = make_cfg("serve-run", base_uri)
    trained, optim = build_trained_model(cfg, seed=3)
    write_checkpoint(store, cfg.run_uri, trained, optim, step=4, trainable_only=True)
    return cfg, export_run(cfg, merge=True, store=store)


@pytest.fixture(scope="module")
def reference(exported):
    """The merged export loaded by transformers, and its greedy answer: `apply_chat_template` with
    the export's template, `generate`, cut at EOS or <|im_end|>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Store().cache_locally(exported[1]["merged_uri"])
    tokenizer = AutoTokenizer.from_pretrained(local)
    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def answer(ids: list[int], max_new_tokens: int = MAX_TOKENS) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                                 pad_token_id=tokenizer.pad_token_id)
        tokens = out[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(tokens) if t in stop), len(tokens))
        return tokenizer.decode(tokens[:cut], skip_special_tokens=True)

    def chat(messages: list[dict]) -> str:
        return answer(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         return_dict=True)["input_ids"]))

    def complete(prompt: str) -> str:
        # What training put before a text document: BOS, then the text's tokens.
        return answer([tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"])

    return chat, complete


def test_a_serve_already_listening_on_every_interface_gets_no_model_without_a_token(ray_cluster, exported,
                                                                                     monkeypatch):
    """Serve's proxy is the cluster's, and keeps the address it started with: a later `eft serve`
    on the loopback default, without a token, must not deploy onto one that listens on 0.0.0.0
    (the readiness probe to 127.0.0.1 would pass, and the model would answer anyone). Runs before
    the module's `served` fixture starts its own Serve."""
    from ray import serve

    from app import compat
    from app.cluster import find_free_port
    from app.serve.auth import ServeAuthError
    from app.serve.launch import start_serve

    monkeypatch.delenv("EFT_SERVE_TOKEN", raising=False)
    port = find_free_port("127.0.0.1")
    serve.start(http_options={"host": "0.0.0.0", "port": port})  # as a RayService's Serve, or `--host 0.0.0.0`
    try:
        assert compat.serve_http_address() == ("0.0.0.0", port), "another Serve was already running"
        with pytest.raises(ServeAuthError, match=rf"^Serve already runs on this Ray cluster at 0\.0\.0\.0:{port}, "
                                                 r"beyond this machine, not 127\.0\.0\.1:"):
            start_serve(exported[1]["export_uri"], port=port)
        assert "eft" not in serve.status().applications  # refused before the model was deployed
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def served(ray_cluster, exported):
    """One Serve application on loopback (a free port) serving the export, with a bearer token."""
    from ray import serve

    from app.serve.launch import start_serve

    handle = start_serve(exported[1]["export_uri"], port=None, token=TOKEN, max_tokens=64)
    yield handle
    handle.stop()
    serve.shutdown()


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served.url, api_key=TOKEN, max_retries=0, timeout=60)


# -- through the served model ------------------------------------------------------------------


def test_chat_completions_answer_as_generate_with_the_exports_chat_template(served, client, reference):
    chat, _ = reference
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS] + [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is None?"}]]
    expected = [chat(m) for m in conversations]
    assert len(set(expected)) > 1, "a model that answers everything alike cannot tell rendering bugs apart"
    for messages, want in zip(conversations, expected):
        reply = client.chat.completions.create(model=served.model, messages=messages, temperature=0,
                                               max_tokens=MAX_TOKENS)
        assert reply.choices[0].message.content == want
        assert reply.choices[0].message.role == "assistant" and reply.model == served.model
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens <= MAX_TOKENS and reply.usage.prompt_tokens > 0


def test_completions_answer_a_raw_prompt_as_generate(served, client, reference):
    _, complete = reference
    prompt = "The return statement leaves"
    reply = client.completions.create(model=served.model, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].text == complete(prompt)
    assert reply.object == "text_completion"


def test_streamed_deltas_join_to_the_non_streamed_text(served, client):
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    whole = client.chat.completions.create(model=served.model, messages=messages, temperature=0, max_tokens=40)
    chunks = list(client.chat.completions.create(model=served.model, messages=messages, temperature=0,
                                                 max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    prompt = "A class definition"
    text = client.completions.create(model=served.model, prompt=prompt, temperature=0, max_tokens=30).choices[0].text
    streamed = client.completions.create(model=served.model, prompt=prompt, temperature=0, max_tokens=30, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_a_stop_sequence_ends_the_answer_before_it(served, client):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    full = client.chat.completions.create(model=served.model, messages=messages, temperature=0,
                                          max_tokens=40).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.chat.completions.create(model=served.model, messages=messages, temperature=0, max_tokens=40,
                                         stop=[stop])
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=served.model, messages=messages, temperature=0, max_tokens=40,
                                              stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:full.index(stop)]


def test_sampling_with_a_seed_repeats_and_unsupported_parameters_are_refused(served, client):
    import openai

    messages = [{"role": "user", "content": QUESTIONS[2]}]
    first, second = (client.chat.completions.create(model=served.model, messages=messages, temperature=0.9,
                                                    top_p=0.9, seed=7, max_tokens=MAX_TOKENS)
                     for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.chat.completions.create(model=served.model, messages=messages, n=2)
    with pytest.raises(openai.BadRequestError, match="over this server's limit of 64"):
        client.chat.completions.create(model=served.model, messages=messages, max_tokens=65)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="another-model", messages=messages)


def test_the_token_is_required_and_the_right_one_works(served):
    import openai

    assert [m.id for m in openai.OpenAI(base_url=served.url, api_key=TOKEN, max_retries=0).models.list()] == [
        served.model]
    wrong = openai.OpenAI(base_url=served.url, api_key=TOKEN[:-1] + "x", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # Every route of the app, through Serve's proxy, with no Authorization header at all; the
    # body (not JSON) is not even read.
    root = served.url.removesuffix("/v1")
    routes = list_routes()
    assert {("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")} <= set(routes)
    for method, path in routes:
        request = urllib.request.Request(root + path, data=b"not json" if method == "POST" else None, method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 401, (method, path)
        assert json.loads(info.value.read())["error"]["code"] == "invalid_api_key", (method, path)


def list_routes() -> list[tuple[str, str]]:
    """(method, path) of every operation of the serving app, from FastAPI's own OpenAPI walk of
    its routes (the app serves no OpenAPI page; the schema is built here, from the routes)."""
    from fastapi.openapi.utils import get_openapi

    from app.serve.app import api

    schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
    return [(method.upper(), path) for path, operations in schema["paths"].items() for method in operations]


def call_app(method: str, path: str, authorization: str | None = None) -> tuple[int, dict]:
    """One request to the serving app as an ASGI call, in this process: (status, JSON body)."""
    import asyncio

    from app.serve.app import api

    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 40000)}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"not json", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(api(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


def test_the_token_is_one_dependency_of_the_whole_app():
    """Every operation carries the bearer check, declared once on the app (so a route added later
    has it too), and each refuses a request without the right token before its body is read. The
    digest a replica holds is what the check compares with; outside a replica, FastAPI's
    dependency override gives it."""
    from app.serve.app import api, read_replica_token_digest
    from app.serve.auth import token_digest
    from fastapi.openapi.utils import get_openapi

    routes = list_routes()
    schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
    assert len(routes) >= 3
    for method, path in routes:
        assert schema["paths"][path][method.lower()].get("security") == [{"HTTPBearer": []}], (method, path)
    api.dependency_overrides[read_replica_token_digest] = lambda: token_digest(TOKEN)
    try:
        for method, path in routes:
            for authorization in (None, f"Bearer {TOKEN[:-1]}x", f"Basic {TOKEN}", "Bearer "):
                status, body = call_app(method, path, authorization)
                assert (status, body["error"]["code"]) == (401, "invalid_api_key"), (method, path, authorization)
    finally:
        api.dependency_overrides.clear()


# -- refused before any work -------------------------------------------------------------------


def run_cli(capsys, *args: str) -> tuple[int, str]:
    """`eft serve ARGS` in this process: its exit status and its one line on stderr (what the
    session's Ray replicas log lands on the same stderr, and is not eft's)."""
    rc = main(["serve", *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eft:")]
    assert len(lines) == 1, lines
    return rc, lines[0]


def test_a_bind_beyond_loopback_without_a_token_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("EFT_SERVE_TOKEN", raising=False)
    rc, err = run_cli(capsys, "s3://nowhere/export", "--host", "0.0.0.0")
    assert rc == 2 and err.count("\n") == 0
    assert err.startswith("eft: error: --host 0.0.0.0 listens beyond this machine") and "token" in err


def test_a_short_or_empty_token_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("EFT_SERVE_TOKEN", "zq9-tok")
    rc, err = run_cli(capsys, "s3://nowhere/export")
    assert rc == 2 and "EFT_SERVE_TOKEN: the token is shorter than 16 characters" in err and "zq9-tok" not in err
    (tmp_path / "token").write_text("\n")
    rc, err = run_cli(capsys, "s3://nowhere/export", "--token-file", str(tmp_path / "token"))
    assert rc == 2 and "the token is empty" in err


@pytest.mark.parametrize("flag,value,expected", [
    ("--port", "70000", "expected a TCP port, 1 to 65535, got '70000'"),
    ("--port", "0", "expected a TCP port, 1 to 65535, got '0'"),
    ("--replicas", "0", "expected a whole number of at least 1, got '0'"),
    ("--max-tokens", "-5", "expected a whole number of at least 1, got '-5'"),
    ("--cpus-per-replica", "0", "expected a number above 0, got '0'"),
])
def test_out_of_range_flags_are_refused_by_the_parser_naming_the_flag(capsys, flag, value, expected):
    with pytest.raises(SystemExit) as info:
        main(["serve", "s3://nowhere/export", flag, value])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"eft serve: error: argument {flag}: {expected}"


@pytest.mark.parametrize("host,port,actual,with_token,refused", [
    ("127.0.0.1", 8000, ("0.0.0.0", 8000), False, "at 0.0.0.0:8000, beyond this machine, not 127.0.0.1:8000"),
    ("127.0.0.1", 8000, ("10.1.2.3", 8000), False, "at 10.1.2.3:8000, beyond this machine"),
    ("127.0.0.1", 8000, ("0.0.0.0", 8000), True, None),  # the token every request must carry is set
    ("127.0.0.1", 8000, ("::1", 8000), False, None),  # loopback still
    ("0.0.0.0", 8000, ("127.0.0.1", 8000), True, None),  # narrower than asked: served there, warned
    ("127.0.0.1", 8000, ("127.0.0.1", 9000), True, "at 127.0.0.1:9000, not 127.0.0.1:8000 as asked"),
    ("127.0.0.1", None, ("127.0.0.1", 9000), False, None),  # any port asked for
    ("127.0.0.1", None, ("0.0.0.0", 9000), False, "at 0.0.0.0:9000, beyond this machine"),
])
def test_a_running_serves_address_is_held_to_the_bind_rule(host, port, actual, with_token, refused, caplog):
    from app.serve.auth import ServeAuthError, check_proxy_address

    token = TOKEN if with_token else None
    if refused is None:
        with caplog.at_level("WARNING", logger="eft.serve"):
            check_proxy_address(host, port, actual, token)
        assert (f"at {actual[0]}:{actual[1]}" in caplog.text) == (actual[0] != host)
    else:
        with pytest.raises(ServeAuthError) as info:
            check_proxy_address(host, port, actual, token)
        assert refused in str(info.value) and "\n" not in str(info.value)


def test_a_token_over_plain_http_beyond_loopback_is_warned_of_once(caplog):
    from app.serve.auth import warn_token_in_clear

    with caplog.at_level("WARNING", logger="eft.serve"):
        for host, token in (("127.0.0.1", TOKEN), ("::1", TOKEN), ("0.0.0.0", None), ("0.0.0.0", TOKEN)):
            warn_token_in_clear(host, token)
    [record] = caplog.records
    assert "plain HTTP to 0.0.0.0" in record.getMessage() and TOKEN not in caplog.text


# A handle whose stop() says so instead of deleting a Serve application: what `eft serve` runs
# after "# serving until Ctrl-C", without Ray.
WAIT_FOR_A_SIGNAL = """
import sys
from app.serve.launch import ServeHandle

class Handle(ServeHandle):
    def stop(self):
        print("stopped", flush=True)

Handle(url="http://127.0.0.1:1/v1", model="m", app_name="eft", engine="transformers",
       started_ray=False).wait(on_waiting=lambda: print("waiting", flush=True))
"""


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_serve_stops_on_ctrl_c_or_sigterm_even_when_started_with_sigint_ignored(signum):
    """A non-interactive shell starts a background job (`eft serve … &`, a CI runner's steps)
    with SIGINT ignored, and Python keeps an ignored SIGINT ignored: `eft serve` sets its own."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.Popen([sys.executable, "-c", WAIT_FOR_A_SIGNAL], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout.readline().strip() == "waiting"
        proc.send_signal(getattr(signal, signum))
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "stopped", (proc.returncode, out)


def test_bad_inputs_fail_in_one_line_before_serve_starts(s3, exported, capsys, tmp_path):
    cfg, summary = exported
    rc, err = run_cli(capsys, str(tmp_path / "missing.yaml"))
    assert rc == 2 and err == f"eft: error: {tmp_path / 'missing.yaml'}: config file not found"
    rc, err = run_cli(capsys, "s3://eft/serve-test-runs/nothing-here")
    assert rc == 1 and err.startswith("eft: error: s3://eft/serve-test-runs/nothing-here: no export here")
    rc, err = run_cli(capsys, summary["merged_uri"])
    assert rc == 1 and "that is a tree of an export: give the directory above it" in err
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps({**json.loads(cfg.model_dump_json()), "name": "never-exported"}))
    rc, err = run_cli(capsys, str(config))
    assert rc == 1 and "no export of run s3://eft/serve-test-runs/never-exported" in err and "\n" not in err


def test_a_config_serves_its_runs_latest_export(s3, exported, tmp_path):
    from app.serve.source import resolve_served_model

    cfg, summary = exported
    config = tmp_path / "job.yaml"
    config.write_text(cfg.model_dump_json())
    served = resolve_served_model(str(config))
    assert (served.export_uri, served.kind, served.model_uri) == (summary["export_uri"], "merged", summary["merged_uri"])
    assert served.name == "serve-run" and served.step == 4
    adapter = resolve_served_model(summary["export_uri"], prefer_adapter=True)
    assert (adapter.kind, adapter.model_uri, adapter.adapter_uri) == ("adapter", cfg.model.uri, summary["adapter_uri"])


def test_the_adapter_on_its_base_answers_as_the_merged_export(s3, exported, reference):
    """The base plus the adapter, as a replica loads it, renders and answers like the merged tree."""
    from app.serve.generate import Sampling, TextGenerator, iter_pieces, join_pieces
    from app.serve.source import resolve_served_model

    chat, _ = reference
    generator = TextGenerator(resolve_served_model(exported[1]["export_uri"], prefer_adapter=True), 64)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    text, finish, _, completion = join_pieces(list(iter_pieces(
        generator, generator.chat_ids(messages), Sampling(MAX_TOKENS, 0.0, 1.0, (), None))))
    assert text == chat(messages) and finish in ("stop", "length") and completion <= MAX_TOKENS


# -- on a cluster: `eft manifests --serve` -----------------------------------------------------


def render_serve_cli(capsys, cfg, out, *extra: str) -> tuple[int, str]:
    """`eft manifests CONFIG --serve` in this process, the config as a file; (exit status, stderr)."""
    config = out.parent / f"{out.name}-job.yaml"
    config.write_text(cfg.model_dump_json())
    rc = main(["manifests", str(config), "--serve", "--overlay", "eks-spot", "--out", str(out), *extra])
    return rc, capsys.readouterr().err


def test_an_export_publishes_its_adapter_where_serve_llm_loads_adapters(s3, exported):
    """<run>/adapters/<checkpoint>/: the same files as the export's adapter tree, which PEFT loads."""
    from peft import PeftConfig

    cfg, summary = exported
    store = Store()
    published = join(summary["adapters_uri"], summary["adapter_id"])
    assert (summary["adapters_uri"], summary["adapter_id"]) == (join(cfg.run_uri, "adapters"), "checkpoint-00000004")
    assert store.list_file_sizes(published) == store.list_file_sizes(summary["adapter_uri"])
    assert store.read_bytes(join(published, "adapter_model.safetensors")) == \
        store.read_bytes(join(summary["adapter_uri"], "adapter_model.safetensors"))
    assert PeftConfig.from_pretrained(str(store.cache_locally(published))).r == 4


def test_manifests_serve_render_a_rayservice_of_the_merged_export_that_passes_the_checks(s3, exported, tmp_path,
                                                                                          capsys):
    import yaml
    from transformers import AutoTokenizer

    from app.serve.llm_config import check_llm_config

    cfg, summary = exported
    out = tmp_path / "serve"
    rc, err = render_serve_cli(capsys, cfg, out, "--node-type", "p4de.24xlarge")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "networkpolicy-serve.yaml", "poddisruptionbudget-serve.yaml", "rayservice.yaml",
        "serve.yaml", "serviceaccount.yaml", "vllm-serve.sh"]
    assert f"serving {summary['export_uri']} as serve-run: 1-4 replica(s) of 1 GPU(s) on p4de.24xlarge" in err
    # The whole directory passes the strict CRD schemas and the policy, as a user would check it.
    assert main(["manifests", "--check", str(out)]) == 0

    service = yaml.safe_load((out / "rayservice.yaml").read_text())
    app = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert app == yaml.safe_load((out / "serve.yaml").read_text())
    [llm] = app["applications"][0]["args"]["llm_configs"]
    check_llm_config(llm)
    assert app["applications"][0]["import_path"] == "ray.serve.llm:build_openai_app"
    assert llm["model_loading_config"] == {"model_id": "serve-run", "model_source": summary["merged_uri"]}
    assert "lora_config" not in llm
    # The template is the export's own, the one training rendered with.
    tokenizer = AutoTokenizer.from_pretrained(Store().cache_locally(summary["merged_uri"]))
    assert llm["engine_kwargs"]["chat_template"] == tokenizer.chat_template == \
        (out / "chat_template.jinja").read_text()
    assert llm["deployment_config"]["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                                              "target_ongoing_requests": 16}
    # The endpoint is the config's (none here): this shell's AWS_ENDPOINT_URL (loopback) stays out of the
    # cluster's manifests, and the replicas never reach for the hub.
    assert llm["runtime_env"]["env_vars"] == {"HF_HUB_OFFLINE": "1"}
    assert service["metadata"]["annotations"]["eft/export-uri"] == summary["export_uri"]
    # 4 replicas of 1 GPU fit one 8-GPU node: one pod, whatever the load.
    group = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 1)
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"

    script = (out / "vllm-serve.sh").read_text()
    assert f"aws s3 sync --only-show-errors {summary['merged_uri']}" in script
    assert "--served-model-name serve-run" in script and '--chat-template "$here/chat_template.jinja"' in script
    assert "--enable-lora" not in script and (out / "vllm-serve.sh").stat().st_mode & 0o111
    check_shell(out / "vllm-serve.sh")


def check_shell(path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    shellcheck = Path(sys.executable).parent / "shellcheck"
    result = subprocess.run([str(shellcheck), "-s", "bash", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_manifests_serve_with_adapters_load_the_runs_adapters_on_demand(s3, exported, tmp_path, capsys):
    import yaml

    cfg, summary = exported
    out = tmp_path / "serve-adapter"
    rc, err = render_serve_cli(capsys, cfg, out, "--set", "serve.adapter=true", "--set", "serve.max_replicas=16",
                               "--node-type", "g5.12xlarge")
    assert rc == 0, err
    assert "as serve-run-base / serve-run-base:checkpoint-00000004" in err
    assert main(["manifests", "--check", str(out)]) == 0
    service = yaml.safe_load((out / "rayservice.yaml").read_text())
    [llm] = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["llm_configs"]
    assert llm["model_loading_config"] == {"model_id": "serve-run-base", "model_source": cfg.model.uri}
    assert llm["lora_config"] == {"dynamic_lora_loading_path": summary["adapters_uri"],
                                  "max_num_adapters_per_replica": 16}
    assert llm["engine_kwargs"]["enable_lora"] is True and llm["engine_kwargs"]["max_lora_rank"] == 8  # r = 4
    # 16 replicas of 1 GPU on 4-GPU nodes: 1 to 4 pods as Serve scales.
    group = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 4)
    script = (out / "vllm-serve.sh").read_text()
    assert "--enable-lora" in script and "--lora-modules serve-run-base:checkpoint-00000004=" in script
    assert f"aws s3 sync --only-show-errors {summary['adapter_uri']}" in script
    check_shell(out / "vllm-serve.sh")


def test_manifests_serve_bad_inputs_are_one_line_before_anything_is_written(s3, exported, tmp_path, capsys):
    cfg, _ = exported
    never = cfg.model_copy(update={"name": "never-exported"})
    rc, err = render_serve_cli(capsys, never, tmp_path / "a")
    assert rc == 1 and "no export of run s3://eft/serve-test-runs/never-exported" in err
    rc, err = render_serve_cli(capsys, cfg, tmp_path / "b", "--node-type", "m6i.2xlarge")
    assert rc == 2 and "m6i.2xlarge has no GPUs" in err
    rc, err = render_serve_cli(capsys, cfg, tmp_path / "c", "--set", "serve.tensor_parallel_size=3")
    assert rc == 2 and "serve.tensor_parallel_size: 3 GPUs per replica do not divide" in err
    rc, err = render_serve_cli(capsys, cfg, tmp_path / "d", "--export", "s3://eft/serve-test-runs/nothing")
    assert rc == 1 and "s3://eft/serve-test-runs/nothing: no export here" in err
    assert not any((tmp_path / d).exists() for d in "abcd")
    rc = main(["manifests", "jobs/configs/tiny-cpu.yaml", "--export", "s3://x/y", "--out", str(tmp_path / "e")])
    assert rc == 2 and "--export: only with --serve" in capsys.readouterr().err


def test_the_llm_config_of_an_adapter_export_written_before_adapters_were_published_is_refused(exported):
    from dataclasses import replace

    from app.serve.llm_config import LLMConfigError, build_llm_config_dict
    from app.serve.source import resolve_served_model

    served = replace(resolve_served_model(exported[1]["export_uri"], prefer_adapter=True), adapters_uri=None)
    with pytest.raises(LLMConfigError, match="did not publish its adapter for Serve LLM"):
        build_llm_config_dict(served, lora_rank=4)


# -- vllm-serve.sh: who may call plain vLLM ----------------------------------------------------

FAKE_VLLM = """#!/usr/bin/env bash
# Stands in for vLLM: records what it was started with, and the key it would check.
printf '%s\\n' "$@" > "$FAKE_VLLM_OUT/argv"
printf '%s' "${VLLM_API_KEY-}" > "$FAKE_VLLM_OUT/key"
"""


@pytest.fixture
def vllm_script(tmp_path):
    """vllm-serve.sh for a merged export on local disk (linked in place, nothing fetched), and a
    fake `vllm` first on PATH; runs the script, returning (exit status, stderr, argv or None, key)."""
    import os
    import subprocess

    from app.serve.llm_config import build_vllm_script
    from app.serve.source import ServedModel

    (tmp_path / "export" / "merged").mkdir(parents=True)
    merged = str(tmp_path / "export" / "merged")
    served = ServedModel(name="serve-run", export_uri=str(tmp_path / "export"), kind="merged", model_uri=merged,
                         adapter_uri=None, tokenizer_uri=merged, step=4, endpoint=None, region="us-east-1")
    script = tmp_path / "vllm-serve.sh"
    script.write_text(build_vllm_script(served, chat_template="{{ messages }}"))
    script.chmod(0o755)
    check_shell(script)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm").write_text(FAKE_VLLM)
    (tmp_path / "bin" / "vllm").chmod(0o755)

    def run(*args: str, **env: str) -> tuple[int, str, list[str] | None, str]:
        for name in ("argv", "key"):
            (tmp_path / name).unlink(missing_ok=True)
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("EFT_VLLM_", "VLLM_"))}
        environ.update(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", FAKE_VLLM_OUT=str(tmp_path), **env)
        done = subprocess.run([str(script), *args], env=environ, capture_output=True, text=True, timeout=60)
        ran = (tmp_path / "argv").exists()
        return (done.returncode, done.stderr, (tmp_path / "argv").read_text().splitlines() if ran else None,
                (tmp_path / "key").read_text() if ran else "")

    run.trees = tmp_path / "trees"
    return run


def test_vllm_serve_sh_listens_on_loopback_by_default(vllm_script):
    rc, err, argv, key = vllm_script()
    assert rc == 0 and err == ""
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and key == ""


def test_vllm_serve_sh_refuses_a_wider_bind_without_a_key_before_fetching(vllm_script, tmp_path):
    rc, err, argv, _ = vllm_script(EFT_VLLM_HOST="0.0.0.0")
    assert rc == 2 and argv is None and not vllm_script.trees.exists()
    assert err == ("vllm-serve.sh: EFT_VLLM_HOST=0.0.0.0 listens beyond this machine: give the API key every request "
                   "must carry (EFT_VLLM_API_KEY_FILE=FILE), or serve on 127.0.0.1\n")
    # The host cannot come in past the check as vLLM's own flag either.
    rc, err, argv, _ = vllm_script("--host=0.0.0.0")
    assert rc == 2 and argv is None and err.startswith("vllm-serve.sh: --host=0.0.0.0: set EFT_VLLM_HOST")
    short = tmp_path / "short-key"
    short.write_text("abc\n")
    rc, err, argv, _ = vllm_script(EFT_VLLM_HOST="0.0.0.0", EFT_VLLM_API_KEY_FILE=str(short))
    assert rc == 2 and argv is None and "the key is empty or shorter than 16 characters" in err and "abc" not in err
    rc, err, argv, _ = vllm_script(EFT_VLLM_API_KEY_FILE=str(tmp_path / "missing"))
    assert rc == 2 and argv is None and f"EFT_VLLM_API_KEY_FILE {tmp_path / 'missing'}: no such file" in err


def test_vllm_serve_sh_with_a_key_file_binds_wider_and_keeps_the_key_off_the_command_line(vllm_script, tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text(f"\n  {TOKEN}  \n")
    rc, err, argv, key = vllm_script(EFT_VLLM_HOST="0.0.0.0", EFT_VLLM_API_KEY_FILE=str(key_file))
    assert rc == 0 and key == TOKEN and not any(TOKEN in a for a in argv)
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert err == "vllm-serve.sh: warning: the API key travels over plain HTTP to 0.0.0.0; put a TLS gateway in front\n"
