"""The Files and Batches API end to end: the official `openai` client against a real
`microserve router` (with --data-dir and --api-key) over a real engine of the tiny model.

Output lines equal the same requests made directly (greedy); bad lines land in the error file
and never fail the batch; cancel keeps what finished; and a router killed mid-batch and started
again on the same data directory loses no line and runs none twice (counted exactly: the rows
done before the kill plus the requests the new router served equal the lines)."""

from __future__ import annotations

import http.client
import json
import os
import pty
import select
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
from daemons import ENGINE_KEY, Daemon, serve
from deployments import RouterProcess, write_config
from openai import OpenAI

pytestmark = pytest.mark.slow

KEY = "batch-test-key"
ENGINE_ARGS = ("--num-pages", "256", "--max-model-len", "256", "--api-key", ENGINE_KEY)
SHARED = [1, 7, 7, 9, 11, 13, 17, 19]  # a "template" several lines share


@pytest.fixture(scope="module")
def engine(tiny_served_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("batch-engine") / "daemon.log"
    yield from serve(Daemon(tiny_served_dir, log, "e", *ENGINE_ARGS))


def start_router(model_dir, engine, data_dir, log_path, *args) -> RouterProcess:
    process = RouterProcess(model_dir, {"e": engine.url}, log_path, "--api-key", KEY,
                            "--data-dir", str(data_dir), *args)
    process.wait_ready()
    return process


@pytest.fixture(scope="module")
def router(engine, tiny_served_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch-router")
    process = start_router(tiny_served_dir, engine, tmp / "data", tmp / "router.log")
    try:
        yield process
    finally:
        process.stop()


def client(router) -> OpenAI:
    return OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0)


def line(custom_id: str, prompt: list[int], max_tokens: int, url="/v1/completions", **body):
    body = {"model": "test-model", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, **body}
    if url == "/v1/chat/completions":
        body.pop("prompt")
        body["messages"] = [{"role": "user", "content": " ".join(f"<{t}>" for t in prompt)}]
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def wait_for(c: OpenAI, batch_id: str, statuses=("completed", "failed", "cancelled", "expired"),
             timeout_s: float = 120, until=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = c.batches.retrieve(batch_id)
        if batch.status in statuses or (until is not None and until(batch)):
            return batch
        time.sleep(0.1)
    pytest.fail(f"batch {batch_id} still {batch.status} after {timeout_s} s: {batch}")


def by_custom_id(c: OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    rows = [json.loads(x) for x in c.files.content(file_id).text.splitlines()]
    found = {row["custom_id"]: row for row in rows}
    assert len(found) == len(rows), "a custom_id twice"
    return found


def test_round_trip_matches_direct_requests_and_bad_lines_go_to_the_error_file(router):
    c = client(router)
    good = [line(f"c{i}", SHARED + [30 + i], 8) for i in range(6)]
    good += [line(f"x{i}", [3, 5, 40 + i], 24) for i in range(4)]
    bad = ["{not json", line("wrong-url", [3], 4, url="/v1/chat/completions"),
           line("too-long", SHARED, 1000)]  # 8 + 1000 > 256: the API's own 400
    made = c.files.create(file=("in.jsonl", jsonl(good[:5] + bad + good[5:])), purpose="batch")
    assert (made.object, made.purpose, made.bytes) == ("file", "batch",
                                                      len(jsonl(good[:5] + bad + good[5:])))
    assert c.files.retrieve(made.id).filename == "in.jsonl"
    assert made.id in [f.id for f in c.files.list()]
    batch = c.batches.create(input_file_id=made.id, endpoint="/v1/completions",
                             completion_window="24h", metadata={"job": "t1"})
    assert (batch.status, batch.metadata) == ("validating", {"job": "t1"})
    batch = wait_for(c, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (13, 10, 3)
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at
    outputs = by_custom_id(c, batch.output_file_id)
    assert set(outputs) == {g["custom_id"] for g in good}
    for g in good:
        direct = c.completions.create(**g["body"])
        row = outputs[g["custom_id"]]
        assert row["error"] is None and row["response"]["status_code"] == 200
        assert row["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
        assert row["response"]["body"]["usage"]["completion_tokens"] == g["body"]["max_tokens"]
    errors = by_custom_id(c, batch.error_file_id)
    assert errors[None]["error"]["code"] == "invalid_json"
    assert errors["wrong-url"]["error"]["code"] == "invalid_url"
    refused = errors["too-long"]["response"]
    assert refused["status_code"] == 400 and "maximum context length is 256" in \
        refused["body"]["error"]["message"]
    metrics = httpx.get(router.url + "/metrics").text
    for state, count in (("pending", 0), ("completed", 10), ("failed", 3)):
        assert f'microserve_batch_lines{{batch="{batch.id}",state="{state}"}} {count}.0' in metrics
    listed = c.batches.list(limit=1)
    assert [b.id for b in listed.data] == [batch.id]
    assert c.files.delete(made.id).deleted
    with pytest.raises(Exception, match="404"):
        c.files.retrieve(made.id)


def completed_batch(c: OpenAI, lines: list[dict], endpoint: str) -> dict[str, dict]:
    """Run `lines` as a batch on `endpoint` to its end: every line completed; output lines by
    custom_id."""
    made = c.files.create(file=("lines.jsonl", jsonl(lines)), purpose="batch")
    batch = wait_for(c, c.batches.create(input_file_id=made.id, endpoint=endpoint,
                                         completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == len(lines), batch
    return by_custom_id(c, batch.output_file_id)


def test_chat_lines_match_direct_chat(router):
    c = client(router)
    lines = [line(f"q{i}", SHARED + [50 + i], 6, url="/v1/chat/completions") for i in range(3)]
    outputs = completed_batch(c, lines, "/v1/chat/completions")
    for x in lines:
        direct = c.chat.completions.create(**x["body"])
        got = outputs[x["custom_id"]]["response"]["body"]["choices"][0]["message"]["content"]
        assert got == direct.choices[0].message.content


def test_responses_lines_match_direct_responses(router):
    """A batch on /v1/responses (OpenAI's Batch API takes that endpoint too): each line's
    output body is the response object the same request gets directly, text and usage."""
    c = client(router)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": "test-model", "input": " ".join(f"<{t}>" for t in SHARED + [60 + i]),
                       "instructions": "Answer.", "max_output_tokens": 6, "temperature": 0}}
             for i in range(3)]  # fmt: skip
    outputs = completed_batch(c, lines, "/v1/responses")
    for x in lines:
        direct = c.responses.create(**x["body"])
        body = outputs[x["custom_id"]]["response"]["body"]
        assert body["object"] == "response" and body["status"] == direct.status
        assert body["output"][0]["content"][0]["text"] == direct.output_text
        assert body["usage"]["output_tokens"] == direct.usage.output_tokens == 6


def test_the_cli_runs_a_file_and_writes_its_output(router, tmp_path):
    lines = [line(f"k{i}", SHARED + [70 + i], 5) for i in range(4)] + ["{bad"]
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(lines))
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "batch", "run", str(path),
                           "--base-url", router.url + "/v1", "--api-key", KEY,
                           "--output", str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "batch completed: 4 completed, 1 failed of 5" in done.stderr
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["custom_id"] for row in out] == ["k0", "k1", "k2", "k3"]  # input order
    direct = client(router).completions.create(**lines[2]["body"])
    assert out[2]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    errors = (tmp_path / "in.errors.jsonl").read_text().splitlines()
    assert [json.loads(x)["error"]["code"] for x in errors] == ["invalid_json"]


def test_the_cli_can_start_a_deployment_of_its_own(router, tiny_served_dir, tmp_path):
    config, _, _ = write_config(tmp_path / "own.toml", tiny_served_dir, "data_parallel",
                                [("e", "any", ["--num-pages", "64", "--max-model-len", "256"])])
    lines = [line(f"o{i}", SHARED + [90 + i], 5) for i in range(3)]
    path = tmp_path / "own.jsonl"
    path.write_bytes(jsonl(lines))
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "batch", "run", str(path),
                           "--up", str(config)], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "MICROSERVE_API_KEY"})
    assert done.returncode == 0, done.stderr
    assert "batch completed: 3 completed, 0 failed of 3" in done.stderr
    out = [json.loads(x) for x in (tmp_path / "own.output.jsonl").read_text().splitlines()]
    direct = client(router).completions.create(**lines[1]["body"])  # another router, same model
    assert out[1]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text


class Terminal:
    """A command in a pseudo-terminal: what it prints, read up to a marker."""

    def __init__(self, argv: list[str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, on the terminal
            os.execv(sys.executable, [sys.executable, *argv])
        self.pending = b""

    def read_until(self, marker: str, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while marker.encode() not in self.pending:
            ready, _, _ = select.select([self.fd], [], [], max(0, deadline - time.monotonic()))
            if not ready:
                pytest.fail(f"no {marker!r} within {timeout_s} s; got {self.pending!r}")
            self.pending += os.read(self.fd, 4096)
        text, _, self.pending = self.pending.partition(marker.encode())
        return text.decode()

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode() + b"\n")
        self.read_until(text + "\r\n")  # the terminal's echo

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


def test_chat_streams_keeps_history_and_runs_a_batch_in_the_background(router, tmp_path):
    c = client(router)
    (tmp_path / "qs.txt").write_text("<5> <6>\n<7> <8>\n<9> <10>\n")
    term = Terminal(["-m", "launcher.cli", "chat", "--base-url", router.url + "/v1",
                     "--api-key", KEY, "--max-tokens", "6"])
    term.read_until("\n> ")
    term.type("<3> <4>")
    first = term.read_until("\r\n> ")
    messages = [{"role": "user", "content": "<3> <4>"}]
    direct = c.chat.completions.create(model="test-model", messages=messages, max_tokens=6,
                                       temperature=0).choices[0].message.content
    assert first == direct
    term.type(f"/batch {tmp_path / 'qs.txt'}")
    assert "started (3 lines from" in term.read_until("\r\n> ")
    term.type("<11>")  # answered while the batch runs, with the history before it
    second = term.read_until("\r\n")
    messages += [{"role": "assistant", "content": direct}, {"role": "user", "content": "<11>"}]
    assert second == c.chat.completions.create(model="test-model", messages=messages,
                                               max_tokens=6, temperature=0
                                               ).choices[0].message.content
    done = term.read_until("> ", timeout_s=60) + term.read_until("> ")
    assert "batch completed: 3 completed, 0 failed of 3" in done, done
    term.type("/quit")
    assert term.wait() == 0
    out = [json.loads(x) for x in (tmp_path / "qs.output.jsonl").read_text().splitlines()]
    assert [row["custom_id"] for row in out] == ["qs-0", "qs-1", "qs-2"]


def test_cancel_stops_dispatching_and_keeps_what_finished(router, engine):
    c = client(router)
    lines = [line(f"l{i}", [3, 4, 60 + i], 64) for i in range(80)]
    made = c.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = c.batches.create(input_file_id=made.id, endpoint="/v1/completions",
                             completion_window="24h")
    wait_for(c, batch.id, until=lambda b: b.request_counts.completed >= 2)
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_for(c, batch.id, timeout_s=30)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    done = batch.request_counts.completed
    assert 2 <= done < 80
    assert len(by_custom_id(c, batch.output_file_id)) == done
    assert engine.wait_idle(10)["stats"]["running"] == 0  # the running lines were aborted


def test_an_upload_past_200_mb_is_refused_from_its_length(router):
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/v1/files")  # the head alone: the answer comes before any body
    for name, value in (("Authorization", f"Bearer {KEY}"), ("Content-Length", "300000000"),
                        ("Content-Type", "multipart/form-data; boundary=b")):
        conn.putheader(name, value)
    conn.endheaders()
    answer = conn.getresponse()
    assert answer.status == 413
    assert "(300000000 bytes) is larger than the 201048576 bytes" in answer.read().decode()
    conn.close()


def test_a_router_killed_mid_batch_resumes_without_losing_or_repeating_a_line(
        engine, tiny_served_dir, tmp_path):
    lines = [line(f"r{i}", SHARED + [20 + i, i % 7], 16) for i in range(24)]
    first = start_router(tiny_served_dir, engine, tmp_path / "data", tmp_path / "r1.log",
                         "--batch-lines-per-engine", "4")
    c = client(first)
    made = c.files.create(file=("r.jsonl", jsonl(lines)), purpose="batch")
    batch = c.batches.create(input_file_id=made.id, endpoint="/v1/completions",
                             completion_window="24h")
    wait_for(c, batch.id, until=lambda b: b.request_counts.completed >= 4)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    db = sqlite3.connect(tmp_path / "data" / "batches.sqlite3")
    done_before = db.execute("SELECT COUNT(*) FROM lines WHERE state = 'done'").fetchone()[0]
    db.close()
    assert 4 <= done_before < 24
    engine.wait_idle(30)  # the engine aborted what the dead router had running
    second = start_router(tiny_served_dir, engine, tmp_path / "data", tmp_path / "r2.log")
    try:
        c = client(second)
        batch = wait_for(c, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 24, batch
        outputs = by_custom_id(c, batch.output_file_id)
        assert sorted(outputs) == sorted(x["custom_id"] for x in lines)
        served = httpx.get(second.url + "/metrics").text
        ran = [x for x in served.splitlines() if x.startswith(
            'microserve_requests_total{endpoint="/v1/completions",status="200"}')]
        assert ran == [f'microserve_requests_total{{endpoint="/v1/completions",status="200"}} '
                       f'{float(24 - done_before)}']
        direct = c.completions.create(**lines[0]["body"])
        assert outputs["r0"]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    finally:
        second.stop()
