"""`make serve` as a newcomer meets it: the deployment it starts, the admin token it saves, a
second deployment on its ports, the README's commands run as written against it, and the
`microserve` command line's help.

The deployment is the one `make serve` starts (its command as `make -n serve` prints it, on
free ports), with the admin token it makes for itself: saved while it runs, removed when it
stops. A second `microserve up` whose router or engine port is taken exits with an error naming
the port and leaves the running deployment's token file as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest
from conftest import DAEMON_LOGS
from deployments import Up, stop_and_check, with_engine_key

from launcher.cli import parser
from launcher.credentials import admin_token
from launcher.deployment import load_deployment
from router.settings import RouterSettings

ROOT = Path(__file__).resolve().parent.parent
LOCAL_PORT = 8000  # the port the README's commands name


# ---- the admin token's file, without processes ----------------------------------------------

def test_a_generated_admin_token_lives_in_its_file_while_the_block_runs(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = tmp_path / "microserve" / "admin-token-8123"
    with admin_token(None, 8123) as token:
        assert path.read_text() == token + "\n" and len(token) == 43
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not path.exists()
    assert capsys.readouterr().out.count(token) == 1  # printed once


def test_a_given_admin_token_writes_no_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with admin_token("chosen", 8123) as token:
        assert token == "chosen"
        assert not (tmp_path / "microserve").exists()
    assert capsys.readouterr().out == ""


def test_a_token_file_another_router_replaced_is_left_to_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = tmp_path / "microserve" / "admin-token-8123"
    with admin_token(None, 8123):
        path.write_text("another router's token\n")
    assert path.read_text() == "another router's token\n"


def test_admin_token_command_prints_the_saved_token_or_names_the_missing_file(tmp_path):
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "launcher.cli", "admin-token", "--port", "8123"]
    missing = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    path = tmp_path / "microserve" / "admin-token-8123"
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr == (f"microserve: error: no admin token saved for port 8123 ({path} "
                              "does not exist): is a router running there that was started "
                              "without --admin-token?\n")
    path.parent.mkdir()
    path.write_text("the-token\n")
    found = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert (found.returncode, found.stdout, found.stderr) == (0, "the-token\n", "")


def test_a_router_on_a_busy_port_exits_before_it_writes_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_ADMIN_TOKEN"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "launcher.cli", "router", "--port",
                               str(port)], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"microserve: error: port {port} on 127.0.0.1 (for the router) is "
                           "already in use, by another microserve deployment or another "
                           "program: stop it, or choose another port (--port)\n")
    assert list(tmp_path.iterdir()) == []


# ---- make serve -------------------------------------------------------------------------------

def free_ports(n: int) -> int:
    """A port P with P .. P+n-1 all free (`up` puts the engines on the router's port + 1, + 2)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65536:
            continue
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {n} consecutive free ports")


def make_serve_argv(port: int) -> list[str]:
    """`make serve`'s command on `port`, as `make -n` prints it, with this interpreter running
    the `microserve` it names."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-s", "-n", "--no-print-directory", "serve", f"PORT={port}"],
                         cwd=ROOT, env=env, check=True, capture_output=True,
                         text=True).stdout.replace("\\\n", " ")
    [line] = [line for line in out.splitlines() if "microserve up " in line]
    argv = shlex.split(line)
    assert argv[0].endswith("bin/microserve"), line
    return [sys.executable, "-m", "launcher.cli", *argv[1:]]


class MakeServe(Up):
    """`make serve`'s deployment in a child process, run from the repository's root."""

    def __init__(self, port: int, run_dir: Path, log_path: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.engine_urls = {name: f"http://127.0.0.1:{port + i}"
                            for i, name in enumerate(("prefill-0", "decode-0"), start=1)}
        self.log_path = log_path
        self.env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_ADMIN_TOKEN"}
        self.env["XDG_RUNTIME_DIR"] = str(run_dir)
        self.env["XDG_DATA_HOME"] = str(run_dir / "data")  # its batch data, not in $HOME
        self.token_file = run_dir / "microserve" / f"admin-token-{port}"
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(make_serve_argv(port), cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, env=with_engine_key(self.env))


@pytest.fixture(scope="module")
def serve(smollm2_dir, tmp_path_factory):
    """`make serve` on free ports; at the end, Ctrl-C: every process gone, the token file too."""
    tmp = tmp_path_factory.mktemp("serve")
    deployment = MakeServe(free_ports(3), tmp / "run", tmp / "up.log")
    try:
        deployment.wait_ready()
        yield deployment
    finally:
        if deployment.proc.poll() is None:
            stop_and_check(deployment)
            assert not deployment.token_file.exists(), "the admin-token file outlived up"


@pytest.fixture(autouse=True)
def logs_on_failure(request):
    if "serve" in request.fixturenames:
        request.node.stash[DAEMON_LOGS] = [request.getfixturevalue("serve").log_path]
    yield


@pytest.mark.slow
def test_make_serve_saves_its_admin_token_and_it_opens_admin(serve):
    token = serve.token_file.read_text().strip()
    assert stat.S_IMODE(serve.token_file.stat().st_mode) == 0o600
    assert serve.log().count(token) == 1
    r = httpx.get(serve.url + "/admin/strategy", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.json()["active"]["class"] == "PrefillDecode"


def busy_router_config(tmp_path: Path, serve: MakeServe) -> tuple[list[str], int, str]:
    """`up` of a file whose router port is the running deployment's: argv, the port, what."""
    port = int(serve.url.rsplit(":", 1)[1])
    return [str(ROOT / "deploy" / "local-cpu.toml"), "--port", str(port)], port, "the router"


def busy_engine_config(tmp_path: Path, serve: MakeServe) -> tuple[list[str], int, str]:
    """`up` of a file with a free router port and one engine on the running decode engine's."""
    port = int(serve.engine_urls["decode-0"].rsplit(":", 1)[1])
    config = tmp_path / "second.toml"
    config.write_text(f'[router]\nport = {free_ports(1)}\n\n'
                      f'[[engines]]\nname = "second-0"\nport = {port}\n')
    return [str(config)], port, "engine second-0"


@pytest.mark.slow
@pytest.mark.parametrize("busy", [busy_router_config, busy_engine_config])
def test_a_second_deployment_on_a_busy_port_leaves_the_running_one_alone(serve, tmp_path, busy):
    token_before = serve.token_file.read_text()
    mtime_before = serve.token_file.stat().st_mtime_ns
    args, port, what = busy(tmp_path, serve)
    second = subprocess.run([sys.executable, "-m", "launcher.cli", "up", *args], cwd=ROOT,
                            env=serve.env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stderr == (f"microserve: error: port {port} on 127.0.0.1 (for {what}) is "
                             "already in use, by another microserve deployment or another "
                             "program: stop it, or choose another port (--port)\n")
    assert "admin token" not in second.stdout
    assert sorted(p.name for p in serve.token_file.parent.iterdir()) == [serve.token_file.name]
    assert serve.token_file.read_text() == token_before
    assert serve.token_file.stat().st_mtime_ns == mtime_before
    token = token_before.strip()
    r = httpx.get(serve.url + "/admin/engines", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    assert {e["name"]: e["state"] for e in r.json()["engines"]} == {"prefill-0": "up",
                                                                    "decode-0": "up"}


# ---- the README's commands --------------------------------------------------------------------

def readme_blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def on_port(command: str, port: int) -> str:
    """The README's command for a deployment on `port`, run by this interpreter."""
    command = re.sub(rf"(?<=:){LOCAL_PORT}\b|(?<=--port ){LOCAL_PORT}\b", str(port), command)
    return command.replace(".venv/bin/microserve", f"{shlex.quote(sys.executable)} -m launcher.cli")


def json_values(text: str) -> list:
    """The JSON values printed one after another in `text`."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's commands need curl")
def test_the_readmes_commands_work_against_make_serve_as_written(serve):
    port = int(serve.url.rsplit(":", 1)[1])
    shell = [block for block in readme_blocks("bash") if "curl " in block]
    python = [block for block in readme_blocks("python") if "OpenAI(" in block]
    assert len(shell) == 2 and len(python) == 1, "the README's examples changed: update this test"
    try_it, swap = shell
    # Each curl prints its answer; an HTTP error fails the script, showing the answer.
    prelude = 'set -euo pipefail\ncurl() { command curl -sS --fail-with-body "$@"; echo; }\n'

    def run_shell(block: str) -> str:
        done = subprocess.run(["bash", "-c", prelude + on_port(block, port)], cwd=ROOT,
                              env=serve.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{block}\nexit {done.returncode}:\n{done.stdout}{done.stderr}"
        return done.stdout

    [answer] = json_values(run_shell(try_it))
    assert answer["object"] == "chat.completion" and answer["model"] == "smollm2-135m-instruct"
    assert "Paris" in answer["choices"][0]["message"]["content"]
    streamed = subprocess.run([sys.executable, "-c", on_port(python[0], port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert streamed.returncode == 0 and streamed.stdout.strip(), streamed.stderr

    now, balanced, mine = json_values(run_shell(swap))
    assert now["active"]["class"] == "PrefillDecode"
    assert balanced["class"] == "BalancedPD" and balanced["args"] == {"ratio": 0.2}
    assert mine["class"] == "ShortLocalLongSplit" and mine["args"] == {"threshold": 16}
    # The swapped-in strategy splits the same chat across both engines: the same greedy answer.
    [again] = json_values(run_shell(try_it))
    assert again["choices"][0]["message"] == answer["choices"][0]["message"]
    token = serve.token_file.read_text().strip()
    r = httpx.get(serve.url + "/admin/strategy", headers={"Authorization": f"Bearer {token}"})
    assert r.json()["active"]["class"] == "ShortLocalLongSplit"
    assert r.json()["active"]["finished"] == 1


# ---- every curl in the docs carries the token it needs ----------------------------------------

DOC_FILES = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))),
             *(f"deploy/{p.name}" for p in sorted((ROOT / "deploy").glob("*.toml")))]


def curl_commands(text: str) -> list[str]:
    """The curl commands in `text`: inline code (which may wrap), and lines of code blocks or
    comments (continued by a final backslash)."""
    inline = re.findall(r"`(curl [^`]*)`", text)
    text = re.sub(r"`curl [^`]*`", "", text).replace("\\\n", " ")
    lines = [line.strip().lstrip("#").strip() for line in text.splitlines()]
    return [" ".join(c.split()) for c in inline] + [line for line in lines
                                                     if line.startswith("curl ")]


def test_every_curl_to_admin_or_microserving_in_the_docs_carries_a_token():
    guarded = {}
    for name in DOC_FILES:
        for command in curl_commands((ROOT / name).read_text()):
            if "/admin" in command or "/microserving/" in command:
                guarded.setdefault(name, []).append(command)
                assert '-H "Authorization: Bearer $' in command, f"{name}: {command}"
    assert {name: len(commands) for name, commands in guarded.items()} == {
        "README.md": 3, "deploy/local-cpu.toml": 1, "docs/deploy.md": 2,
        "docs/microserving.md": 3, "docs/router.md": 1, "docs/lora.md": 3,
        "deploy/local-cpu-lora.toml": 1}


def test_the_example_strategy_is_the_one_docs_router_md_shows():
    doc = (ROOT / "docs" / "router.md").read_text()
    [shown] = re.findall(r"^```python\n# my_strategy.py\n(.*?)^```", doc, flags=re.S | re.M)
    assert shown in (ROOT / "examples" / "strategies" / "my_strategy.py").read_text()


# ---- the command line -------------------------------------------------------------------------

def commands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_microserve_help_describes_each_command_on_its_own_line():
    text = parser().format_help()
    assert list(commands()) == ["up", "engine", "serve", "router", "drain", "batch", "chat",
                                "ab", "admin-token", "model-path", "quantize"]
    for name, command in commands().items():
        assert re.search(rf"^    {name}\s", text, flags=re.M), name
        assert command.description, name


def test_microserve_version(capsys):
    with pytest.raises(SystemExit) as raised:
        parser().parse_args(["--version"])
    assert raised.value.code == 0
    assert capsys.readouterr().out == f"microserve {version('microserve')}\n"


def test_every_engine_option_says_what_it_does_and_its_default():
    engine = commands()["engine"]
    formatter = engine._get_formatter()
    for action in engine._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        assert flag or "default" in formatter._get_help_string(action), action.option_strings


def test_a_vllm_serve_command_line_parses(tmp_path):
    """vLLM's flags for what microserve always does are accepted (and change nothing), its
    --no-enable-prefix-caching is --no-prefix-cache, and its --chat-template and
    --generation-config reach the engine's frontend."""
    from launcher.options import engine_config

    args = parser().parse_args([
        "engine", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--enable-prefix-caching", "--enable-chunked-prefill", "--disable-log-requests",
        "--trust-remote-code", "--chat-template", "t.jinja", "--generation-config", "vllm",
        "--reasoning-parser", "deepseek_r1"])
    assert (args.chat_template, args.generation_config) == ("t.jinja", "vllm")
    assert args.reasoning_parser == "deepseek_r1"
    assert parser().parse_args(["engine"]).reasoning_parser is None
    with pytest.raises(SystemExit):
        parser().parse_args(["engine", "--reasoning-parser", "qwen3"])
    assert engine_config(args, str(tmp_path)).enable_prefix_cache
    off = parser().parse_args(["engine", "--no-enable-prefix-caching", "--block-size", "32",
                               "--uvicorn-log-level", "warning"])
    assert not engine_config(off, str(tmp_path)).enable_prefix_cache
    assert (engine_config(off, str(tmp_path)).page_size, off.log_level) == (32, "warning")


def test_serve_takes_the_model_first_as_vllm_serve_does(monkeypatch):
    import launcher.cli as cli

    ran = []
    monkeypatch.setattr(cli, "_run_engine", lambda args: ran.append(args.model))
    for argv, model in ((["serve", "m1", "--port", "9"], "m1"), (["serve"], None),
                        (["serve", "--model", "m2"], "m2"),
                        (["serve", "m3", "--model", "m3"], "m3")):
        cli._run_serve(parser().parse_args(argv))
        assert ran.pop() == model, argv
    with pytest.raises(ValueError, match="the model is given twice: 'a' and --model 'b'"):
        cli._run_serve(parser().parse_args(["serve", "a", "--model", "b"]))
    # the device: cuda when the driver sees a GPU (asked in a child process), else cpu; as given
    # when given (`engine` keeps cpu as its default)
    monkeypatch.setattr(cli, "_run_engine", lambda args: ran.append(args.device))
    for visible, argv, device in ((True, ["serve"], "cuda"), (False, ["serve"], "cpu"),
                                  (True, ["serve", "--device", "cpu"], "cpu")):
        monkeypatch.setattr(cli, "cuda_visible", lambda visible=visible: visible)
        cli._run_serve(parser().parse_args(argv))
        assert ran.pop() == device, (visible, argv)
    assert parser().parse_args(["engine"]).device == "cpu"


def test_cuda_visible_agrees_with_torch():
    """The driver's answer, asked without torch in this process, is torch's."""
    import torch

    import launcher.cli as cli

    assert cli.cuda_visible() == torch.cuda.is_available()


def test_help_never_shows_a_secret_from_the_environment(monkeypatch):
    for name in ("MICROSERVE_API_KEY", "MICROSERVE_ADMIN_TOKEN", "MICROSERVE_ENGINE_API_KEY"):
        monkeypatch.setenv(name, f"secret-{name}")
    for name, command in commands().items():
        assert "secret-" not in command.format_help(), name


def test_up_host_overrides_the_routers_address_only():
    args = parser().parse_args(["up", "deploy/local-cpu.toml", "--host", "0.0.0.0"])
    deployment = load_deployment(ROOT / args.config, host=args.host)
    assert deployment.host == "0.0.0.0"
    assert [e.host for e in deployment.engines] == ["127.0.0.1", "127.0.0.1"]
    assert load_deployment(ROOT / args.config).host == "127.0.0.1"


def test_the_liveness_timeout_comes_from_the_file_or_the_command_line(tmp_path):
    """[router] liveness_timeout_s, overridden by --liveness-timeout-s; unset, the router's
    own default (5 s); RouterConfig refuses what a core's 0.2 s heartbeat cannot meet."""
    from router.engines import LIVENESS_TIMEOUT_S
    from router.server import RouterConfig

    config = tmp_path / "deploy.toml"
    base = '[[engines]]\nname = "e"\n'
    config.write_text(base)
    assert load_deployment(config).liveness_timeout_s is None
    assert RouterConfig("t", "m", (), engines_from_dns=("x",)).liveness_timeout_s == 5.0
    assert LIVENESS_TIMEOUT_S == 5.0
    config.write_text(base + '[router]\nliveness_timeout_s = 2\n')
    assert load_deployment(config).liveness_timeout_s == 2.0
    args = parser().parse_args(["up", str(config), "--liveness-timeout-s", "1.5"])
    assert load_deployment(config, liveness_timeout_s=args.liveness_timeout_s
                           ).liveness_timeout_s == 1.5
    router = parser().parse_args(["router", "--engine", "e=http://h:1", "--liveness-timeout-s",
                                  "3"])
    assert router.liveness_timeout_s == 3.0
    config.write_text(base + '[router]\nliveness_timeout_s = "2"\n')
    with pytest.raises(ValueError, match=r"\[router\] liveness_timeout_s must be a number of "
                                         "seconds, got '2'"):
        load_deployment(config)
    with pytest.raises(ValueError, match=r"liveness_timeout_s 0.1 must be in \[0.5, 300\]"):
        RouterConfig("t", "m", (), engines_from_dns=("x",), liveness_timeout_s=0.1)


def test_model_path_prints_the_embedded_models_directory(smollm2_dir):
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "model-path"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, smollm2_dir + "\n", "")
    assert (Path(smollm2_dir) / "tokenizer.json").is_file()


def test_the_routers_settings_are_its_options_and_its_deployment_keys(tmp_path):
    """router/settings.py declares each setting once: `microserve router`'s defaults are its,
    a deployment file sets it by name, and an unknown key is an error naming it."""
    from router.settings import RouterSettings

    router = parser().parse_args(["router", "--engine", "e=http://h:1"])
    defaults = RouterSettings()
    for name, value in defaults.settings().items():
        if name != "http_limits":
            assert getattr(router, name) == value, name
    config = tmp_path / "deploy.toml"
    engines = '[[engines]]\nname = "e"\n'
    config.write_text('[router]\nqueue_timeout_s = 5\nhealth_timeout_s = 7\n' + engines)
    deployment = load_deployment(config)
    assert (deployment.router.queue_timeout_s, deployment.router.health_timeout_s) == (5.0, 7.0)
    assert load_deployment(config, queue_timeout_s=9.0).router.queue_timeout_s == 9.0
    # the top-level ones: how the router renders and samples for every engine
    config.write_text('chat_template = "t.jinja"\ngeneration_config = "openai"\n' + engines)
    top = load_deployment(config).router
    assert (top.chat_template, top.generation_config) == ("t.jinja", "openai")
    assert (RouterSettings().chat_template, RouterSettings().generation_config) == (None, "auto")
    config.write_text('generation_config = "model"\n' + engines)
    with pytest.raises(ValueError, match="generation_config 'model' is not one of auto, openai"):
        load_deployment(config)
    config.write_text('reasoning_parser = "deepseek_r1"\n' + engines)
    assert load_deployment(config).router.reasoning_parser == "deepseek_r1"
    assert RouterSettings().reasoning_parser is None
    config.write_text('reasoning_parser = "qwen3"\n' + engines)
    with pytest.raises(ValueError, match="reasoning_parser 'qwen3' is not one of deepseek_r1"):
        load_deployment(config)
    config.write_text('[router]\nqueue_timeout = 5\n' + engines)
    with pytest.raises(ValueError, match=r"\[router\]: unknown key\(s\) queue_timeout \(known: "):
        load_deployment(config)
    config.write_text('[router]\nqueue_timeout_s = 0\n' + engines)
    with pytest.raises(ValueError, match=r"queue_timeout_s 0.0 must be in \(0, 3600\]"):
        load_deployment(config)


def test_engine_args_are_parsed_when_the_deployment_loads(tmp_path):
    """Each engine's args become its EngineConfig when the file is read; a bad one is an error
    then, naming the engine and the option."""
    config = tmp_path / "deploy.toml"
    config.write_text('[[engines]]\nname = "e"\nargs = ["--device", "cuda:1", "--page-size", '
                      '"32"]\n')
    [engine] = load_deployment(config).engines
    assert (engine.config.device, engine.config.page_size) == ("cuda:1", 32)
    config.write_text('[[engines]]\nname = "e"\nargs = ["--scheduling-policy", "mlfq", '
                      '"--scheduling-starvation-s", "2.5", "--mlfq-levels", "4", '
                      '"--background-max-seqs", "0", "--background-prompt-every", "8"]\n')
    [engine] = load_deployment(config).engines
    assert (engine.config.scheduling_policy, engine.config.scheduling_starvation_s,
            engine.config.mlfq_levels, engine.config.mlfq_base_quantum_s) == ("mlfq", 2.5, 4, None)
    assert (engine.config.background_priority, engine.config.background_max_seqs,
            engine.config.background_max_tokens, engine.config.background_prompt_every
            ) == (1_000_000, 0, 32, 8)
    # an engine's own /v1 queue bound: the router's default unless given
    assert engine.config.queue_timeout_s == RouterSettings().queue_timeout_s == 60.0
    config.write_text('[[engines]]\nname = "e"\nargs = ["--queue-timeout-s", "2.5"]\n')
    assert load_deployment(config).engines[0].config.queue_timeout_s == 2.5
    # a prompt-only step's budget: 8,192 on CUDA, the step budget on CPU, never below it
    for args, budgets in [('[]', (512, 512)), ('["--device", "cuda"]', (2048, 8192)),
                          ('["--device", "cuda", "--max-num-batched-tokens", "16384"]',
                           (16384, 16384)),
                          ('["--max-prefill-step-tokens", "4096"]', (512, 4096))]:
        config.write_text(f'[[engines]]\nname = "e"\nargs = {args}\n')
        engine_config = load_deployment(config).engines[0].config
        assert (engine_config.max_num_batched_tokens,
                engine_config.max_prefill_step_tokens) == budgets, args
    for args, message in [('["--page-size", "x"]',
                           "argument --page-size/--block-size: invalid int value"),
                          ('["--page-size", "0"]', "page_size must be >= 1, got 0"),
                          ('["--launch-ahead-layers", "-1"]',
                           r"launch_ahead_layers must be 0 \(off\) to 1024, got -1"),
                          ('["--few-rows-gemm", "17"]',
                           r"few_rows_gemm must be 0 \(off\) to 16 rows, got 17"),
                          ('["--piecewise-bucket-step", "0"]',
                           "piecewise_bucket_step must be 1 to 2048 tokens, got 0"),
                          ('["--mixed-graph-tokens", "300"]',
                           r"mixed_graph_tokens must be 0 \(off\) to 256, got 300"),
                          ('["--background-prompt-every", "0"]',
                           r"background_prompt_every must be in \[1, 1024\], got 0"),
                          ('["--no-such-option"]', "unrecognized arguments: --no-such-option"),
                          ('["--scheduling-policy", "sjf"]',
                           "argument --scheduling-policy: invalid choice: 'sjf'"),
                          ('["--scheduling-starvation-s", "0"]',
                           r"scheduling_starvation_s must be in \(0, 86400\] s, got 0.0"),
                          ('["--background-max-tokens", "-1"]',
                           "background_max_seqs and background_max_tokens must be >= 0, got 4 "
                           "and -1"),
                          ('["--background-priority", "4294967296"]',
                           r"background_priority must be in \[-2147483648, 2147483647\], got "
                           "4294967296"),
                          ('["--max-num-batched-tokens", "4096", "--max-prefill-step-tokens", '
                           '"2048"]', r"max_prefill_step_tokens \(2048\) must be >= "
                                      r"max_num_batched_tokens \(4096\)"),
                          ('["--queue-timeout-s", "nan"]',
                           r"queue_timeout_s must be in \(0, 3600\] s, got nan")]:
        config.write_text(f'[[engines]]\nname = "e"\nargs = {args}\n')
        with pytest.raises(ValueError, match=rf"engines\[0\] \(e\): {message}"):
            load_deployment(config)


def test_the_engines_of_a_host_split_its_cores_unless_their_args_choose(tmp_path, monkeypatch):
    """CPU and GPU engines alike get cores // engines torch threads (at least one); an engine
    whose args set --cpu-threads keeps its own."""
    from launcher.deployment import with_cpu_threads

    config = tmp_path / "deploy.toml"
    config.write_text('[[engines]]\nname = "a"\nargs = ["--device", "cuda:0"]\n'
                      '[[engines]]\nname = "b"\nargs = ["--device", "cuda:1"]\n'
                      '[[engines]]\nname = "c"\nargs = ["--cpu-threads", "3"]\n')
    engines = load_deployment(config).engines
    monkeypatch.setattr("os.cpu_count", lambda: 32)
    threads = [e.config.cpu_threads for e in with_cpu_threads(engines)]
    assert threads == [10, 10, 3]
    assert with_cpu_threads(engines)[0].args[-2:] == ("--cpu-threads", "10")
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert [e.config.cpu_threads for e in with_cpu_threads(engines)] == [1, 1, 3]


def test_engines_whose_shares_of_one_gpu_add_up_to_more_than_it_are_refused(tmp_path):
    """A TP 2 engine on cuda:0 takes cuda:0 and cuda:1: an engine on cuda:1 beside it at the
    default 0.9 would run out of memory at start, so the file is refused naming the GPU, the
    engines and their shares. Shares that fit, and engines numbering GPUs their own way
    (CUDA_VISIBLE_DEVICES), pass."""
    config = tmp_path / "deploy.toml"

    def engines(share: str = "", env: str = "") -> str:
        return ('model = "random:llama-3.1-8b"\n'
                '[[engines]]\nname = "p"\nargs = ["--device", "cuda:0", '
                f'"--tensor-parallel-size", "2"{share}]\n'
                f'[[engines]]\nname = "d"\nargs = ["--device", "cuda:1"{share}]\n{env}')

    config.write_text(engines())
    with pytest.raises(ValueError, match=r"GPU cuda:1 is shared by p 0.9, d 0.9 "
                                         r"\(--gpu-memory-utilization\), 1.8 of its memory in "
                                         r"all; .* \(e.g. 0.50 each\)"):
        load_deployment(config)
    config.write_text(engines(', "--gpu-memory-utilization", "0.45"'))
    assert [e.name for e in load_deployment(config).engines] == ["p", "d"]
    config.write_text(engines(env='env = {CUDA_VISIBLE_DEVICES = "2"}\n'))
    assert len(load_deployment(config).engines) == 2
