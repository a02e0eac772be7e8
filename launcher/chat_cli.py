"""`microserve chat`: FineInfer's two modes (seed 004) in one terminal program.

    microserve chat [--base-url URL] [--api-key KEY] [--system TEXT] [--max-tokens N]

    > What is the capital of France?
    Paris.
    > /batch questions.txt          runs in the background; the chat goes on
    microserve: batch batch-... started (12 lines from questions.txt)
    > ...
    microserve: batch completed: 12 completed, 0 failed of 12 (questions.output.jsonl)

Chat mode streams each answer and keeps the conversation's history (/reset forgets it). Batch
mode submits a file to the router's Batch API from a background thread and says when it is
done: an OpenAI batch JSONL file as it is, or a text file whose every line is one prompt (made
into chat lines). Chat answers go first: they are live requests, which the router's admission
puts ahead of batch lines (router/batches/admission.py). /quit or Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import httpx

from launcher.batch_cli import client, download, follow, submit, summary

HELP = ("commands: /batch FILE (a batch JSONL file, or one prompt per line) runs in the "
        "background; /reset forgets the conversation; /quit leaves")


def chat_options(p: argparse.ArgumentParser) -> None:
    from launcher.batch_cli import DEFAULT_BASE_URL

    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the router's OpenAI API")
    p.add_argument("--api-key", default=None, help="the router's --api-key")
    p.add_argument("--system", default=None, help="a system message opening the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="per answer")
    p.add_argument("--temperature", type=float, default=0.0)


def batch_lines(name: str, data: bytes, model: str, max_tokens: int) -> bytes:
    """An OpenAI batch file as it is; a text file as one chat line per non-empty line."""
    first = next((line for line in data.splitlines() if line.strip()), b"")
    if first.lstrip().startswith(b"{"):
        return data
    prompts = [line.decode() for line in data.splitlines() if line.strip()]
    return "".join(json.dumps({
        "custom_id": f"{Path(name).stem}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": prompt}]}}) + "\n"
        for i, prompt in enumerate(prompts)).encode()


class Chat:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.http = client(args.base_url, args.api_key)
        self.http.timeout = httpx.Timeout(600, connect=10)
        self.model = self.http.get("/models").json()["data"][0]["id"]
        self.history: list[dict] = []
        self.jobs: list[threading.Thread] = []
        # Held while an answer streams: a batch's report waits for the answer's end rather than
        # cutting into it.
        self.screen = threading.Lock()

    def run(self) -> None:
        print(f"microserve chat: {self.model} at {self.args.base_url}; {HELP}", flush=True)
        while True:
            try:
                text = input("> ").strip()
            except EOFError:
                break
            if text in ("/quit", "/exit"):
                break
            if text == "/reset":
                self.history = []
            elif text.startswith("/batch"):
                self.start_batch(text.removeprefix("/batch").strip())
            elif text.startswith("/"):
                print(HELP, flush=True)
            elif text:
                self.answer(text)
        print(flush=True)

    def answer(self, text: str) -> None:
        system = [{"role": "system", "content": self.args.system}] if self.args.system else []
        self.history.append({"role": "user", "content": text})
        body = {"model": self.model, "messages": system + self.history, "stream": True,
                "max_tokens": self.args.max_tokens, "temperature": self.args.temperature}
        reply = []
        with self.screen, self.http.stream("POST", "/chat/completions", json=body) as answer:
            if answer.status_code != 200:
                answer.read()
                self.history.pop()
                print(f"microserve: {answer.status_code} {answer.text}", flush=True)
                return
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                for choice in chunk.get("choices", []):
                    piece = choice["delta"].get("content") or ""
                    reply.append(piece)
                    print(piece, end="", flush=True)
            print(flush=True)
        self.history.append({"role": "assistant", "content": "".join(reply)})

    def start_batch(self, name: str) -> None:
        path = Path(name).expanduser()
        try:
            data = batch_lines(name, path.read_bytes(), self.model, self.args.max_tokens)
            batch = submit(self.http, path.name, data)
        except (OSError, ValueError) as e:
            print(f"microserve: {e}", flush=True)
            return
        print(f"microserve: batch {batch['id']} started "
              f"({batch['request_counts']['total']} lines from {name})", flush=True)
        job = threading.Thread(target=self._finish, args=(batch, path), daemon=True)
        job.start()
        self.jobs.append(job)

    def _finish(self, batch: dict, path: Path) -> None:
        # Its own client: httpx clients are not shared across threads here.
        with client(self.args.base_url, self.args.api_key) as http:
            batch = follow(http, batch)
            written = download(http, batch, path.with_suffix(".output.jsonl"),
                               path.with_suffix(".errors.jsonl"))
        where = ", ".join(str(p) for p in written)
        with self.screen:
            print(f"\nmicroserve: {summary(batch)} ({where})\n> ", end="", flush=True)


def run_chat(args: argparse.Namespace) -> None:
    chat = Chat(args)
    try:
        chat.run()
    except KeyboardInterrupt:
        print(flush=True)
    finally:
        chat.http.close()
    if any(job.is_alive() for job in chat.jobs):
        print("microserve: batches still running on the router; `microserve batch` or "
              "GET /v1/batches finds them", file=sys.stderr)
