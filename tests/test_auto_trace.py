"""bench/scripts/auto_trace.py: an `auto` run's strategy_trace read back phase by phase, on a
made-up run whose every figure is known."""

from __future__ import annotations

import json

from bench.scripts.auto_trace import main, phase_bounds, summarize


def engine(step_s, share, queue=0, decoding=0):
    return {"step_s": step_s, "prompt_share": share, "queue": queue, "decoding": decoding}


RUN = {
    "strategy": "auto",
    "phases": [{"workload": "chat", "rate_per_gpu": 28.0, "seconds": 2.0},
               {"workload": "synthetic", "rate_per_gpu": 9.0, "seconds": 3.0}],
    "strategy_trace": [
        {"t": 0.5, "engines": {"p": engine(0.005, 0.0), "d": engine(0.007, 0.01, 0, 40)},
         "holding_s": {}, "flips": 0},
        {"t": 1.5, "engines": {"p": engine(0.006, 0.0), "d": engine(0.008, 0.01, 0, 42)},
         "holding_s": {"decode_bound": 1.0}, "flips": 0},
        {"t": 2.5, "engines": {"p": engine(0.030, 0.6, 3000, 10), "d": engine(0.020, 0.5)},
         "holding_s": {"interference": 0.5}, "flips": 1},
        {"t": 3.5, "engines": {"p": engine(0.040, 0.7, 5000, 12), "d": engine(0.010, 0.3)},
         "holding_s": {"interference": 1.5}, "flips": 1},
        {"t": 4.5, "engines": {"p": engine(0.050, 0.8, 4000, 14), "d": engine(0.012, 0.4)},
         "holding_s": {}, "flips": 2},
    ],
}


def test_phases_are_consecutive_and_the_last_takes_the_drain():
    assert phase_bounds(RUN) == [("chat@28", 0.0, 2.0), ("synthetic@9", 2.0, float("inf"))]
    assert phase_bounds({"phases": []}) == [("run", 0.0, float("inf"))]


def test_each_phase_gets_medians_and_rule_shares_and_each_flip_its_phase():
    assert summarize(RUN) == [
        "auto: 5 samples",
        "  phase chat@28 (0-2 s, 2 samples)",
        "    d: step 7.5 ms, prompts 0.01 of its time, queue 0 tokens, decoding 41",
        "    p: step 5.5 ms, prompts 0.00 of its time, queue 0 tokens, decoding 0",
        "    decode_bound holding in 50% of samples",
        "    interference holding in 0% of samples",
        "  phase synthetic@9 (2-inf s, 3 samples)",
        "    d: step 12.0 ms, prompts 0.40 of its time, queue 0 tokens, decoding 0",
        "    p: step 40.0 ms, prompts 0.70 of its time, queue 4000 tokens, decoding 12",
        "    decode_bound holding in 0% of samples",
        "    interference holding in 67% of samples",
        "  flip 1 seen at 2.5 s (synthetic@9, 0.5 s into it)",
        "  flip 2 seen at 4.5 s (synthetic@9, 2.5 s into it)",
    ]


def test_a_flip_in_a_phase_whose_name_came_before_counts_from_its_own_start_and_is_named():
    """chat, synthetic, chat: a flip in the second chat phase is timed from that phase's
    start, not the first's; a trace that kept what flipped names the engine, roles and rule."""
    run = {"strategy": "auto",
           "phases": [{"workload": "chat", "rate_per_gpu": 28.0, "seconds": 2.0},
                      {"workload": "synthetic", "rate_per_gpu": 9.0, "seconds": 3.0},
                      {"workload": "chat", "rate_per_gpu": 28.0, "seconds": 2.0}],
           "strategy_trace": [
               {"t": 4.5, "engines": {"p": engine(0.05, 0.8)}, "holding_s": {}, "flips": 1},
               {"t": 6.0, "engines": {"p": engine(0.007, 0.1)}, "holding_s": {}, "flips": 2,
                "flipped": [{"engine": "p", "from": "prefill", "to": "decode",
                             "reason": "decode_bound", "flipped": True}]}]}
    assert summarize(run)[-1] == ("  flip 2 seen at 6.0 s (chat@28, 1.0 s into it): p prefill "
                                  "-> decode by decode_bound")


def test_a_run_without_a_trace_says_so_and_the_cli_picks_runs_by_label(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"runs": [RUN, {"strategy": "dp", "phases": []}]}))
    main([str(path), "--strategy", "dp"])
    assert capsys.readouterr().out == "dp: no strategy_trace (not `auto`, or --trace-s 0)\n"
    main([str(path), "--strategy", "auto"])
    assert capsys.readouterr().out.splitlines()[0] == "auto: 5 samples"
