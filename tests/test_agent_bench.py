"""benchmarks/agent_bench.py (a script, run on the GPU by hand): its arguments, its id <-> text tokenizer, the agent
step it builds and its plain-HTTP client (the GPU box has no `openai`) against a stub SSE server. Its --smoke run
(the real server on tiny shapes) takes ~25 s on the CPU, so it is not run here."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("agent_bench", os.path.join(ROOT, "benchmarks", "agent_bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments(bench):
    a = bench.parse_args(["--random-27b"])
    assert a.histories == [32768, 131072] and a.new_tokens == 1024 and a.max_batch == 1
    assert a.out == bench.DEFAULT_OUT and a.out.endswith("benchmarks/results/agent_27b_h200.json")
    assert a.max_context >= 131072 + 1024 + a.max_tokens
    assert set(a.lengths) == {32768 - 256, 32768, 32768 + 1024, 131072 - 256, 131072, 131072 + 1024}
    s = bench.parse_args(["--smoke"])
    assert s.random_27b and s.out is None and max(s.histories) < 1024
    assert bench.parse_args(["--histories", "4096", "--out", "x.json"]).out == "x.json"
    with pytest.raises(SystemExit):
        bench.parse_args(["--histories", "100", "--max-tokens", "200"])


def test_id_tokenizer_round_trip(bench):
    tok = bench.IdTokenizer(248320)
    ids = [0, 1, 55295, 55296, 57343, 100000, 248319]  # (ids whose code points would be surrogates below 0x10000)
    text = tok.decode(ids)
    assert len(text) == len(ids) and tok.encode(text) == ids
    assert json.loads(json.dumps(text)) == text


def test_agent_step_is_previous_prompt_completion_and_new(bench):
    tok = bench.IdTokenizer(5000)
    args = bench.parse_args(["--histories", "300", "--new-tokens", "40", "--max-tokens", "20"])
    sent = []

    def complete(base, model, ids, max_tokens):
        sent.append((list(ids), max_tokens))
        text = tok.decode([7] * max_tokens)
        usage = {"completion_tokens": max_tokens, "prompt_tokens_details": {"cached_tokens": len(sent)}}
        return {"ttft_s": 0.5, "wall_s": 1.0, "text": text, "usage": usage}
    r = bench.agent_runs(complete, "http://x/v1", "m", tok, 300, args, seed=0)
    (fresh, _), (prev, n_prev), (step, n_step) = sent
    assert len(fresh) == 340 and len(prev) == 280 and n_prev == 20 and n_step == args.step_max_tokens
    assert step[:280] == prev and step[280:300] == [7] * 20 and len(step) == 340
    assert fresh[:8] != prev[:8]  # (another conversation)
    assert r["history"] == 300 and r["cached"]["cached_tokens"] == 3 and r["fresh"]["ttft_s"] == 0.5


def test_urllib_client_reads_the_stream(bench):
    seen = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen["path"] = self.path
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for obj in ({"choices": [{"text": "ab"}]}, {"choices": [{"text": "c"}]},
                        {"choices": [], "usage": {"completion_tokens": 3,
                                                  "prompt_tokens_details": {"cached_tokens": 7}}}):
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = bench.complete_urllib(f"http://127.0.0.1:{srv.server_port}/v1", "m", [1, 2, 3], 5)
    finally:
        srv.shutdown()
    assert seen["path"] == "/v1/completions" and seen["body"]["prompt"] == [1, 2, 3]
    assert seen["body"]["stream"] and seen["body"]["max_tokens"] == 5
    assert r["text"] == "abc" and r["ttft_s"] is not None and bench._fields(r["usage"]) == (7, 3)
