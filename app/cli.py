"""`eft`: the command line. Thin: parse, load the config, call one function, print.

Every expected failure (bad config, unreachable storage, missing dataset, bad model dir)
ends as one line on stderr naming what is at fault, and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

EXIT_USAGE = 2
EXIT_FAILED = 1


def _load(args):
    from app.config import load_config

    return load_config(args.config, args.set)


def cmd_config(args) -> int:
    if args.reference:
        from app.config_reference import render_reference

        print(render_reference(), end="")
        return 0
    if not args.config:
        from app.config import ConfigError

        raise ConfigError("config: give a job CONFIG to validate, or --reference")
    from app.config import dump_config

    print(dump_config(_load(args)), end="")
    return 0


def print_env(env: dict[str, str]) -> None:
    # A token in RAY_AUTH_TOKEN would win over the stack's token file.
    print("unset RAY_AUTH_TOKEN")
    for key, value in env.items():
        print(f"export {key}={value}")


def cmd_local(args) -> int:
    from app.dev import local

    state_dir = Path(args.state_dir)
    if args.action == "up":
        state = local.up(state_dir, num_cpus=args.num_cpus, auth_token_path=args.auth_token_path)
        env = local.local_env(state)
        if not args.no_seed:
            from app.dev.demo import cache_dir_for, seed_local_stack
            from app.storage import Store

            os.environ.update(env)
            # The chat base is pre-trained once per bucket; the copy in the state dir serves the next stack.
            seed_local_stack(Store(), cache_dir=Path(args.cache_dir) if args.cache_dir else cache_dir_for(state_dir))
        print(f"# local stack up: S3 {state['s3_endpoint']} (bucket {state['bucket']}), Ray {state['ray_address']}")
        print("# use it in this shell with:  eval \"$(eft local env)\"")
        print_env(env)
    elif args.action == "env":
        state = local.read_state(state_dir)
        if not state:
            print(f"eft: no local stack recorded in {state_dir} (run `eft local up`)", file=sys.stderr)
            return EXIT_FAILED
        print_env(local.local_env(state))
    elif args.action == "down":
        state = local.down(state_dir)
        print("local stack stopped" if state else f"no local stack recorded in {state_dir}")
    else:
        st = local.status(state_dir)
        if not st:
            print(f"no local stack recorded in {state_dir}")
            return EXIT_FAILED
        print(json.dumps(st, indent=2))
        return 0 if st["s3_alive"] and st["ray_alive"] else EXIT_FAILED
    return 0


def cmd_prepare(args) -> int:
    cfg = _load(args)  # before the heavy imports: a config error is one line in well under a second
    if cfg.prepare is None:
        raise ValueError(f"{args.config}: prepare: section missing (needed by `eft prepare`)")
    from app.data.prepare import prepare_dataset

    if args.preview is not None:
        from rich.console import Console

        from app.data.preview import preview_records, render_preview

        tokenizer, records = preview_records(cfg, args.preview)
        render_preview(Console(highlight=False), tokenizer, records, cfg)
        return 0
    if cfg.prepare.format == "prompts":
        from app.rl.prompts import prepare_prompts

        print(describe_prepared(cfg, prepare_prompts(cfg), "prompts"))
        return 0
    print(describe_prepared(cfg, prepare_dataset(cfg), "rows"))
    return 0


def describe_prepared(cfg, manifest: dict, unit: str) -> str:
    """`eft prepare`'s closing line; `already prepared …; nothing to do` when the same recipe was."""
    train, val, unchanged = manifest["splits"]["train"], manifest["splits"].get("validation", {}), manifest.get("unchanged")
    return (f"{'already prepared' if unchanged else 'prepared'} {cfg.data.uri}: {train['rows']} train {unit} / "
            f"{train['tokens']:,} tokens, {val.get('rows', 0)} validation {unit}, "
            f"{manifest['records']['skipped']} records skipped" + ("; nothing to do" if unchanged else ""))


def cmd_train(args) -> int:
    cfg = _load(args)
    if cfg.rl is not None:  # an unimportable reward is one line before storage or Ray is touched
        from app.rl.rewards import build_reward_fn

        build_reward_fn(cfg.rl.weighted_rewards(), cfg.rl.normalize, cfg.rl.answer_regex)
    from app.report import render_summary
    from app.train.launch import run_training

    summary = run_training(cfg, wait_s=args.wait_timeout_s if args.wait else None)
    render_summary(summary)
    return 0


def cmd_export(args) -> int:
    cfg = _load(args)
    from app.export import export_run

    out = export_run(cfg, checkpoint_uri=args.checkpoint, merge=args.merge)
    print(json.dumps(out, indent=2))
    return 0


def cmd_eval(args) -> int:
    cfg = _load(args)  # a config error is one line before anything heavy
    from app.config import ConfigError

    if cfg.eval is None:
        raise ConfigError(f"{args.config}: eval: section missing (eval.uri, eval.sets or eval.harness names "
                          f"what to score)")
    from rich.console import Console

    from app.eval.results import load_results, load_summaries
    from app.eval.run import run_eval
    from app.report import render_eval
    from app.storage import Store

    sets = None if args.sets is None else [] if args.sets == "none" else [n for n in args.sets.split(",") if n]
    store = Store.from_config(cfg.storage)
    summary = run_eval(cfg, store, checkpoint=args.checkpoint, limit=args.limit, sets=sets,
                       harness=not args.no_harness)
    harness = [s for s in load_summaries(store, cfg.run_uri) if s.get("harness")]
    Console(highlight=False).print(render_eval(summary, load_results(store, cfg.run_uri), harness))
    return 0


def cmd_model(args) -> int:
    """`eft model pull hf://… [--to URI]`: mirror a hub model on its own (to feed clusters without
    internet); `eft model ls URI`: the mirrors under a mirror root, with their shas."""
    from app.hub import HubError, default_mirror_root, list_mirrors, mirror_model, parse_hub_uri
    from app.storage import Store

    if args.action == "ls":
        store = Store(interactive=True)
        store.check_reachable(args.target)
        mirrors = list_mirrors(store, args.target)
        if args.json:
            print(json.dumps(mirrors, indent=2))
        elif not mirrors:  # said on stderr: stdout lists mirrors, and there are none
            print(f"eft: no mirrors under {args.target}", file=sys.stderr)
        for m in [] if args.json else mirrors:
            state = f"{m['files']} files, {m['bytes'] / 1e6:.1f} MB" if m["complete"] else "incomplete (cut off: not used)"
            print(f"hf://{m['repo']}@{m['sha']}  {state}  {m['mirror_uri']}")
        return 0
    parse_hub_uri(args.target, key="eft model pull")  # a bad id is one line before anything else
    root = args.to
    if root is None and args.config:
        cfg = _load(args)
        root = cfg.model.mirror_uri or default_mirror_root(cfg.storage.root_uri)
    if root is None:
        raise HubError("eft model pull: where to? give --to s3://bucket/models-mirror (or --config JOB, whose "
                       "model.mirror_uri or storage.root_uri decides)")
    marker = mirror_model(Store(), args.target, root, allow_pickle=args.allow_pickle_weights)
    print(f"hf://{marker['repo']}@{marker['sha']} -> {marker['mirror_uri']}")
    return 0


def cmd_serve(args) -> int:
    """`eft serve CONFIG|EXPORT_URI`: the export answering over the OpenAI API until Ctrl-C."""
    from app.config import ConfigError, load_config
    from app.serve.auth import check_bind, read_token

    # Flags and config first, before storage, Ray or torch is imported: each error is one line.
    token = read_token(args.token_file)
    check_bind(args.host, token)
    if args.target.endswith((".yaml", ".yml")):
        load_config(args.target, args.set)
    if args.detach and not os.environ.get("RAY_ADDRESS"):
        raise ConfigError("--detach: needs a Ray cluster that outlives this command (set RAY_ADDRESS; for the "
                          "local stack: eval \"$(eft local env)\")")
    from app.serve.launch import start_serve

    handle = start_serve(args.target, host=args.host, port=args.port, replicas=args.replicas, token=token,
                         overrides=args.set, model_name=args.model_name, prefer_adapter=args.adapter,
                         engine=args.engine, cpus_per_replica=args.cpus_per_replica, max_tokens=args.max_tokens)
    print(f"model: {handle.model}")
    print(f"url:   {handle.url}", flush=True)
    if args.detach:
        print(f"# detached: the Serve application {handle.app_name!r} keeps running on the cluster "
              f"(`serve shutdown` stops it)")
        return 0
    handle.wait(on_waiting=lambda: print("# serving until Ctrl-C", flush=True))
    return 0


def cmd_demo(args) -> int:
    from app.dev.demo import run_demo

    return run_demo(config_path=args.config, state_dir=Path(args.state_dir), max_steps=args.max_steps,
                    keep_stack=args.keep_stack, allow_remote_bucket=args.allow_remote_bucket)


def cmd_manifests(args) -> int:
    from app.config import ConfigError

    if args.check:
        from app import kube

        count, violations = kube.check_path(args.check, args.crd_dir)
        # Errors on stdout (one line each, as before); warnings on stderr: they do not fail the check.
        for violation in violations:
            print(violation, file=sys.stdout if violation.severity == kube.ERROR else sys.stderr)
        if errors := kube.errors_of(violations):
            # The one line a user reads names where the first problem is and what it is.
            print(f"eft: {len(errors)} violation(s) in {count} manifest(s), the first: {errors[0]}", file=sys.stderr)
            return EXIT_FAILED
        print(f"ok: {count} manifest(s) pass the KubeRay and Kubeflow CRD schemas and the policy checks")
        return 0
    if not args.config:
        raise ConfigError("manifests: give a job CONFIG to render, or --check DIR")
    if not args.out:
        raise ConfigError("--out: required (the directory to write the manifests to)")
    if args.export and not args.serve:
        raise ConfigError("--export: only with --serve (the export the RayService serves)")
    if args.kubeflow and args.serve:
        raise ConfigError("--kubeflow: not with --serve (serving runs on Ray Serve: a RayService)")
    cfg = _load(args)
    if args.serve:
        return write_serve_manifests(cfg, args)
    from app import kube

    if args.kubeflow:
        manifests, warnings = kube.render_kubeflow_checked(cfg, args.kubeflow, args.overlay, args.image,
                                                           args.node_type, args.crd_dir)
    else:
        manifests, warnings = kube.render_checked(cfg, args.overlay, args.image, args.node_type, args.crd_dir)
    # The same image warning holds for every container: say it once.
    for message in dict.fromkeys(w.message for w in warnings):
        print(f"eft: warning: {message}", file=sys.stderr)
    print(f"eft: {kube.describe_worker_fabric(manifests)}", file=sys.stderr)
    for path in kube.write_manifests(manifests, args.out):
        print(path)
    return 0


def write_serve_manifests(cfg, args) -> int:
    """`eft manifests CONFIG --serve`: a RayService serving the run's export, its Serve config and
    the equivalent `vllm serve` script."""
    from pathlib import Path

    from app import kube
    from app.serve.manifests import render_serve

    rendered = render_serve(cfg, args.config, args.export, args.overlay, args.image, args.node_type, args.crd_dir)
    for message in dict.fromkeys(w.message for w in rendered.warnings):
        print(f"eft: warning: {message}", file=sys.stderr)
    s = cfg.serve
    print(f"eft: serving {rendered.served.export_uri} as {' / '.join(rendered.model_ids)}: {s.min_replicas}-"
          f"{s.max_replicas} replica(s) of {rendered.tensor_parallel_size} GPU(s) on {rendered.node}; clients "
          f"labelled {kube.SERVE_CLIENT_LABEL}=true reach http://{kube.build_service_name(cfg)}-serve-svc:"
          f"{kube.SERVE_PORT}/v1", file=sys.stderr)
    for path in kube.write_manifests(rendered.manifests, args.out):
        print(path)
    for name, text in rendered.files.items():
        path = Path(args.out) / name
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)
        print(path)
    return 0


def cmd_plan(args) -> int:
    cfg = _load(args)
    from app.plan import plan_job, render_plan

    plan, source = plan_job(cfg, node_type=args.node_type)
    if args.json:
        print(json.dumps({"config": args.config, "gpu_memory_from": source, **plan.to_dict()}, indent=2))
    else:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:
            # Piped or logged, rich would squash the 14 columns into 80; keep them readable.
            console = Console(width=max(console.width, 130))
        console.print(render_plan(cfg, plan, source))
        console.print(f"training.parallelism auto -> {plan.choice}: {plan.why}", highlight=False)
        if plan.reference:
            console.print(plan.reference, highlight=False)
    return 0


def cmd_status(args) -> int:
    from rich.console import Console

    from app.report import build_status, load_run, render_status
    from app.storage import Store

    status = build_status(load_run(Store(interactive=True), args.run_uri))
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        Console().print(render_status(status))
        if status.get("eval") and status["eval"]["grid"]["rows"]:
            from app.report import build_grid_table

            Console().print(build_grid_table(status["eval"]["grid"]))
    return 0


def cmd_report(args) -> int:
    from app.report import load_run, save_report
    from app.storage import Store

    store = Store(interactive=True)
    for uri in save_report(store, load_run(store, args.run_uri), out_uri=args.out):
        print(uri)
    return 0


# argparse types: argparse turns their ArgumentTypeError into "argument --FLAG: <message>", so
# the message says what the flag takes, whatever the flag counts (records, seconds, tokens).
def positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {value!r}")
    return number


def parse_int_in(value: str, low: int, high: float, expected: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    return number


def positive_int(value: str) -> int:
    return parse_int_in(value, 1, float("inf"), "a whole number of at least 1")


def parse_port(value: str) -> int:
    return parse_int_in(value, 1, 65535, "a TCP port, 1 to 65535")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eft", description="Ray-native elastic LLM fine-tuning")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("config", help="job YAML")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set training.max_steps=200")
        return p

    p = sub.add_parser("config", help="validate and print the resolved config, or --reference: every key")
    p.add_argument("config", nargs="?", help="job YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--reference", action="store_true",
                   help="print the config reference (Markdown, generated from the models: docs/config.md)")
    p.set_defaults(fn=cmd_config)
    p = sub.add_parser("local", help="the embedded S3 endpoint + Ray head on loopback")
    p.add_argument("action", choices=["up", "down", "status", "env"])
    p.add_argument("--state-dir", default=".eft", help="where the stack records its PIDs (default .eft)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs for the Ray head")
    p.add_argument("--auth-token-path", default=None, metavar="FILE",
                   help="the Ray token the head requires (default: a new one, <state-dir>/auth_token, mode 0600)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where the pre-trained tiny chat base is kept between stacks (default: <state-dir>/cache)")
    p.add_argument("--no-seed", action="store_true",
                   help="do not seed the tiny demo model and corpus into the local bucket")
    p.set_defaults(fn=cmd_local)
    p = with_config(sub.add_parser("prepare", help="raw JSONL/Parquet → packed shards + manifest"))
    p.add_argument("--preview", type=positive_int, default=None, metavar="N",
                   help="show the first N records as tokens, trained and masked, and write nothing")
    p.set_defaults(fn=cmd_prepare)
    p = with_config(sub.add_parser("train", help="fine-tune; re-run with the same name to resume"))
    p.add_argument("--wait", action="store_true",
                   help="if another driver holds the run's lease, wait for it to end (or to die and its "
                        "lease to expire) instead of refusing")
    p.add_argument("--wait-timeout-s", type=positive_float, default=3600.0, metavar="S",
                   help="with --wait: give up after this many seconds (default 3600)")
    p.set_defaults(fn=cmd_train)
    p = with_config(sub.add_parser("export", help="checkpoint → PEFT adapter / merged model"))
    p.add_argument("--checkpoint", default=None, help="checkpoint URI (default: latest complete)")
    p.add_argument("--merge", action="store_true", help="also write the merged full model")
    p.set_defaults(fn=cmd_export)
    p = with_config(sub.add_parser("eval", help="score a checkpoint, an export or the base on the eval sets "
                                                "and lm-eval harness tasks"))
    p.add_argument("--checkpoint", default="latest", metavar="latest|base|STEP|URI",
                   help="what to score: the latest complete checkpoint (default), the base model, the "
                        "checkpoint of a step, or a checkpoint / export / model URI")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="score the first N records only")
    p.add_argument("--sets", default=None, metavar="A,B|none",
                   help="score only these sets of eval.sets (eval.uri is `default`); `none`: no set (default: all)")
    p.add_argument("--no-harness", action="store_true", help="skip eval.harness's lm-eval tasks")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("model", help="mirror a hub model to storage (pull), or list the mirrors (ls)")
    p.add_argument("action", choices=["pull", "ls"])
    p.add_argument("target", metavar="hf://ORG/NAME[@REV]|URI", help="pull: the hub id; ls: a mirror root URI")
    p.add_argument("--to", default=None, metavar="URI", help="pull: the mirror root (<URI>/<org>/<name>/<sha>/)")
    p.add_argument("--config", default=None, help="pull: a job YAML whose model.mirror_uri (or storage.root_uri) "
                                                  "is the mirror root")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--allow-pickle-weights", action="store_true",
                   help="pull: mirror a repo that has only pickled weights (loading them runs code)")
    p.add_argument("--json", action="store_true", help="ls: print the mirrors as JSON")
    p.set_defaults(fn=cmd_model)
    p = sub.add_parser("serve", help="an export answering over an OpenAI-compatible API (Ray Serve)")
    p.add_argument("target", metavar="CONFIG|EXPORT_URI",
                   help="a job YAML (its run's latest export) or an export's URI (the directory with export.json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other needs a token)")
    p.add_argument("--port", type=parse_port, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--replicas", type=positive_int, default=1, help="model replicas (default 1)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="the bearer token every request must carry (default: $EFT_SERVE_TOKEN, else none)")
    p.add_argument("--model-name", default=None, help="the model name clients ask for (default: the run's name)")
    p.add_argument("--adapter", action="store_true",
                   help="serve the base plus the adapter even when the export has a merged model")
    p.add_argument("--engine", default="auto", choices=["auto", "transformers", "vllm"],
                   help="transformers generate, or Ray Serve LLM (vLLM, GPU); auto: vllm when installed and the "
                        "cluster has GPUs")
    p.add_argument("--cpus-per-replica", type=positive_float, default=1.0, metavar="N",
                   help="Ray CPUs per replica (transformers engine; default 1)")
    p.add_argument("--max-tokens", type=positive_int, default=256, metavar="N",
                   help="the most tokens one request may generate (default 256; chat's default)")
    p.add_argument("--detach", action="store_true",
                   help="return once serving, leaving the application on the cluster (needs RAY_ADDRESS)")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("demo", help="the whole pipeline on the embedded local stack")
    p.add_argument("--config", default=None, help="job YAML (default: jobs/configs/tiny-cpu.yaml)")
    p.add_argument("--state-dir", default=".eft")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--keep-stack", action="store_true", help="leave the local stack running afterwards")
    p.add_argument("--allow-remote-bucket", action="store_true",
                   help="write the demo's s3:// URIs on a non-loopback endpoint (only for a bucket you own)")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("manifests", help="render KubeRay RayJob/RayCluster/ConfigMap (--serve: a RayService "
                                         "serving the export; --kubeflow: a TrainJob or PyTorchJob under "
                                         "torchrun), or --check manifests")
    p.add_argument("config", nargs="?", help="job YAML to render")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--overlay", default=None, help="eks-spot, gke-spot, kueue or base")
    p.add_argument("--image", default=None,
                   help="container image built from the Dockerfile, pinned by digest (a tag warns); with --serve, "
                        "default Ray's LLM image (rayproject/ray-llm, vLLM included)")
    p.add_argument("--node-type", default=None, help="worker node type (default: per overlay)")
    p.add_argument("--serve", action="store_true",
                   help="render a RayService serving the run's latest export with Ray Serve LLM (vLLM), its "
                        "serve.yaml and a vllm-serve.sh; the serve section of the config sizes it")
    p.add_argument("--export", default=None, metavar="URI",
                   help="with --serve: the export to serve (default: the run's latest)")
    p.add_argument("--kubeflow", default=None, metavar="trainjob|pytorchjob",
                   help="render the run under torchrun for Kubeflow instead of KubeRay: a TrainJob (Kubeflow "
                        "Trainer v2) on a TrainingRuntime of its own, or an elastic PyTorchJob (Training Operator v1)")
    p.add_argument("--out", default=None, help="directory to write configmap/rayjob/raycluster YAML to")
    p.add_argument("--check", default=None, metavar="DIR", help="validate every YAML under DIR (or a file)")
    p.add_argument("--crd-dir", default=None, help="CRD directory (default: the KubeRay v1.7.0, Kubeflow Trainer "
                                                   "v2.3.0 and Training Operator v1.9.4 CRDs that ship with eft)")
    p.set_defaults(fn=cmd_manifests)
    p = with_config(sub.add_parser("plan", help="memory per GPU for DDP and FSDP2 at each world size, and "
                                                "the parallelism auto picks"))
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--node-type", default=None,
                   help="plan for this node type's GPUs (default: scaling.gpu_memory_gib, else p4d.24xlarge)")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("status", help="state, progress, losses and restarts of a run")
    p.add_argument("run_uri", help="the run, e.g. s3://eft/runs/tiny-cpu")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("report", help="loss plot + Markdown summary of a run")
    p.add_argument("run_uri", help="the run, e.g. s3://eft/runs/tiny-cpu")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where to write loss.png and report.md (default: <run_uri>/report/)")
    p.set_defaults(fn=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    from app.config import ConfigError

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [eft] %(message)s")
    # boto3 logs where it found credentials at INFO on every client: noise on stderr, which
    # should hold nothing but the one-line error when a command fails.
    logging.getLogger("botocore.credentials").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as err:
        print(f"eft: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("eft: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # expected failures carry one-line messages; anything else too
        if args.traceback:
            raise
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"eft: error: {msg}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
