"""bench.peers: the parts that carry vLLM to a machine without a registry round-trip exactly, the
ratio table points every row the right way, and the microserve half runs end to end on
random:tiny (a real `microserve engine` and a real `microserve up`, real HTTP)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import parts
from bench.peers.__main__ import table


def blob(n: int, seed: int) -> bytes:
    out, block = bytearray(), str(seed).encode()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block
    return bytes(out[:n])


@pytest.fixture
def three_files(tmp_path: Path) -> list[Path]:
    src = tmp_path / "src"
    src.mkdir()
    files = []
    for name, size in (("a.whl", 300_000), ("b.whl", 10), ("c.whl", 1_000_000)):
        (src / name).write_bytes(blob(size, size))
        files.append(src / name)
    return files


def test_split_then_join_round_trips(tmp_path, three_files):
    out = tmp_path / "peers"
    manifest = parts.split(three_files, out, 256 * 1024)
    bundle = manifest["bundle"]["size"]
    # a tar of the three: 512-byte headers, data padded to 512, two zero blocks at the end
    assert bundle % 10240 == 0 and bundle >= 1_300_010
    names = [p["name"] for p in manifest["parts"]]
    assert names == [f"bundle.tar.{i:02d}" for i in range(-(-bundle // (256 * 1024)))]
    assert [p["size"] for p in manifest["parts"]][:-1] == [256 * 1024] * (len(names) - 1)
    assert sum(p["size"] for p in manifest["parts"]) == bundle
    assert not (out / "bundle.tar").exists()
    assert json.loads((out / "manifest.json").read_text()) == manifest

    # the parts arrive over several calls, into a folder that is emptied between them
    stash, arrived = tmp_path / "stash", tmp_path / "arrived"
    arrived.mkdir()
    (arrived / names[0]).write_bytes((out / "parts" / names[0]).read_bytes())
    assert parts.stash_arrived(manifest, [arrived], stash) == names[1:]
    (arrived / names[0]).unlink()
    for name in names[1:]:
        (arrived / name).write_bytes((out / "parts" / name).read_bytes())
    assert parts.stash_arrived(manifest, [arrived], stash) == []

    unpacked = parts.join(manifest, stash, tmp_path / "wheels")
    assert [p.name for p in unpacked] == ["a.whl", "b.whl", "c.whl"]
    for original, copy in zip(three_files, unpacked):
        assert copy.read_bytes() == original.read_bytes()
    assert not (stash / "bundle.tar").exists()


def test_a_damaged_part_is_refused_and_reported_missing(tmp_path, three_files, capsys):
    out = tmp_path / "peers"
    manifest = parts.split(three_files, out, 512 * 1024)
    damaged = out / "parts" / "bundle.tar.01"
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert parts.stash_arrived(manifest, [out / "parts"], tmp_path / "stash") == ["bundle.tar.01"]
    assert "bundle.tar.01: sha256 differs from the manifest" in capsys.readouterr().err
    assert parts.main(["join", "--manifest", str(out / "manifest.json"), "--parts",
                       str(out / "parts"), "--stash", str(tmp_path / "stash"), "--out",
                       str(tmp_path / "wheels")]) == 2
    assert not (tmp_path / "wheels").exists()


def test_split_refuses_two_files_of_one_name(tmp_path, three_files):
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.whl").write_bytes(b"x")
    with pytest.raises(ValueError, match="two files share a name"):
        parts.split([three_files[0], other / "a.whl"], tmp_path / "peers", 1024)


def test_table_orients_every_ratio_so_above_one_is_microserve_ahead():
    samples = {
        "vllm": [{"decode batch 1 @ 1024 ms/token": 6.0, "prefill 8x4096 tokens/s": 40_000.0},
                 {"decode batch 1 @ 1024 ms/token": 6.4, "prefill 8x4096 tokens/s": 42_000.0},
                 {"decode batch 1 @ 1024 ms/token": 7.0, "prefill 8x4096 tokens/s": 30_000.0}],
        "engine": [{"decode batch 1 @ 1024 ms/token": 5.0, "prefill 8x4096 tokens/s": 32_000.0}],
    }
    markdown, summary = table(samples, ["vllm", "engine"])
    assert summary["decode batch 1 @ 1024 ms/token"]["engine/vllm"] == pytest.approx(6.4 / 5.0)
    assert summary["prefill 8x4096 tokens/s"]["engine/vllm"] == pytest.approx(0.8)
    assert markdown.splitlines()[:3] == [
        "| figure | vllm | engine | engine / vllm |", "|---|---|---|---|",
        "| decode batch 1 @ 1024 ms/token | 6.4 [6–7] | 5 [5–5] | 1.280x |"]
    assert markdown.splitlines()[3] == ("| prefill 8x4096 tokens/s | 40,000 [30,000–42,000] | "
                                        "32,000 [32,000–32,000] | 0.800x |")


EXPECTED_ROWS = [
    "start-up s", "first request TTFT ms", "first request e2e ms",
    "decode batch 1 @ 32 ms/token", "prefill 2x32 tokens/s", "decode 4 seqs @ 16 tokens/s",
    "bench.serve 8x16/4 total tokens/s", "bench.serve 8x16/4 TTFT p99 ms",
    "bench.serve 8x16/4 TPOT p99 ms",
    *(f"poisson {r}/s {m} {q} ms" for r in (4, 8, 16) for m in ("TTFT", "TPOT")
      for q in ("p50", "p99")),
]  # fmt: skip


def test_microserve_half_end_to_end_on_random_tiny(tmp_path):
    """One round of the engine and of `microserve up` on random:tiny with --tiny sizes: every
    row in the table with a number on both sides, and no process of it left."""
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers", "--skip-vllm", "--model", "random:tiny", "--tiny",
         "--rounds", "1", "--workdir", str(work), "--out", str(tmp_path / "peers.md"),
         "--variant", "small=--max-num-batched-tokens 256",
         "--engine-arg=--cpu-threads=1"],  # as the suite's daemons (tests/daemons.py)
        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (tmp_path / "peers.md").read_text().splitlines()
    assert lines[0] == "| figure | engine | up | engine@small |"
    # the variant is an engine of its own, with its arguments after the shared ones
    assert "max_num_batched_tokens=256," in (work / "engine-small.log").read_text()
    assert "max_num_batched_tokens=256," not in (work / "engine.log").read_text()
    rows = [line.split(" | ")[0].removeprefix("| ") for line in lines[2:]]
    assert rows == EXPECTED_ROWS
    for line in lines[2:]:
        cells = line.strip("| ").split(" | ")[1:]
        assert all(float(cell.split(" [")[0].replace(",", "")) > 0 for cell in cells), line
    result = json.loads((tmp_path / "peers.json").read_text())
    assert [len(result["samples"][side]) for side in ("engine", "up", "engine@small")] == [1, 1, 1]
    # each Poisson run's requests, one line each in the order sent (bench.serve --requests-out)
    for side in ("engine", "up", "engine@small"):
        for rate in ("4", "8", "16"):
            sent = [json.loads(line) for line in
                    (work / f"requests-{side}-r1-{rate}per-s.jsonl").read_text().splitlines()]
            assert [r["i"] for r in sent] == list(range(6)), (side, rate)
            assert [r["sent_s"] for r in sent] == sorted(r["sent_s"] for r in sent)
            assert all((r["prompt_tokens"], r["output_tokens"]) == (16, 4)
                       and 0 < r["ttft_ms"] <= r["e2e_ms"] for r in sent), sent
    mark = f"BENCH_PEERS_RUN={work}".encode()
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and mark in _environ(pid)]
    assert left == []


def _environ(pid: str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def test_variants_are_sides_of_their_own_and_checked(capsys):
    from bench.peers.__main__ import parse as parse_args

    args = parse_args(["--variant", "big=--max-num-seqs 1024 --max-num-batched-tokens 8192"])
    assert args.sides == ["vllm", "engine", "up", "engine@big"]
    assert args.variants == {"engine@big": ["--max-num-seqs", "1024",
                                            "--max-num-batched-tokens", "8192"]}
    assert parse_args(["--variant", "big=-x 1", "--sides", "vllm,engine@big"]).sides == [
        "vllm", "engine@big"]
    for bad in ("big", "=--x 1", "big="):
        with pytest.raises(SystemExit):
            parse_args(["--variant", bad])
        assert f"--variant {bad!r}: give NAME=ARGS" in capsys.readouterr().err
    # named in --variant but left out of --sides: refused, not silently skipped
    with pytest.raises(SystemExit):
        parse_args(["--variant", "big=-x 1", "--variant", "p=-y 2", "--sides", "vllm,engine@p"])
    assert ("--variant engine@big: not in --sides vllm,engine@p; add it there"
            in capsys.readouterr().err)


def test_poisson_tail_groups_first_tokens_by_their_recent_neighbours(tmp_path):
    """bench/scripts/poisson_tail.py on a crafted run: a burst of three (each later one waits
    longer) and two lone requests; an aborted line and a failed one are left out."""
    from bench.scripts.poisson_tail import read, tail

    lines = [{"i": 0, "sent_s": 0.0, "ttft_ms": 40.0}, {"i": 1, "sent_s": 1.0, "ttft_ms": 41.0},
             {"i": 2, "sent_s": 1.02, "ttft_ms": 70.0}, {"i": 3, "sent_s": 1.05, "ttft_ms": 99.0},
             {"i": 4, "aborted": True}, {"i": 5, "error": "500 b''"},
             {"i": 6, "sent_s": 3.0, "ttft_ms": 39.0}]
    path = tmp_path / "requests-engine-r1-16per-s.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    got = tail(read(path), window_ms=100, top=2)
    assert (got["requests"], got["ttft_p50_ms"], got["ttft_p99_ms"]) == (5, 41.0, 99.0)
    assert got["mean_ttft_ms_by_recent"] == {"0": 40.0, "1": 70.0, "2": 99.0}
    assert got["slowest"] == [
        {"i": 3, "sent_s": 1.05, "ttft_ms": 99.0, "recent": 2, "recent_ttft_ms": [41.0, 70.0]},
        {"i": 2, "sent_s": 1.02, "ttft_ms": 70.0, "recent": 1, "recent_ttft_ms": [41.0]}]
