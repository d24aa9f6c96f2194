"""The OpenAI-compatible judge client against a real HTTP server on loopback."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest

from omnirl.reward.scorers import ScoreBatch, build_reward
from omnirl.reward.scorers.remote_judge import JudgeAnswerError, JudgeError, parse_score
from omnirl.reward.scoring import parse_scorer_spec, score_groups


class Judge(BaseHTTPRequestHandler):
    """Answers per the prompt: 'score N' -> 'SCORE: N'; 'flaky' -> 503 twice; 'slow' sleeps."""

    attempts: ClassVar[dict[str, int]] = {}
    seen: ClassVar[list[dict]] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Judge.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        content = body["messages"][0]["content"]
        text = next(c["text"] for c in content if c["type"] == "text")
        assert next(c for c in content if c["type"] == "image_url")["image_url"]["url"].startswith(
            "data:image/png;base64,"
        )
        Judge.attempts[text] = Judge.attempts.get(text, 0) + 1
        if "flaky" in text and Judge.attempts[text] <= 2:
            return self._reply(503, {"error": "busy"})
        if "slow" in text:
            time.sleep(1.0)
        if "garbage" in text:
            answer = "I like it a lot."
        elif "broken" in text:
            return self._reply(200, {"unexpected": True})
        else:
            answer = f"Looks fine.\nSCORE: {text.split('score ')[1].split()[0]}"
        self._reply(200, {"choices": [{"message": {"role": "assistant", "content": answer}}]})

    def _reply(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def images(n):
    return np.random.default_rng(0).integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)


def judge(url, **options):
    return build_reward("remote_judge", url=url, model="qwen-vl", instruction="{prompt}", **options)


def test_scores_are_parsed_and_normalised(judge_url):
    reward = judge(judge_url, api_key="k")
    out = reward(ScoreBatch(images(3), ["score 7", "score 10", "score 2.5"], [{}] * 3))
    assert out["remote_judge"] == pytest.approx([0.7, 1.0, 0.25])
    last = Judge.seen[-1]
    assert last["path"] == "/v1/chat/completions" and last["model"] == "qwen-vl"
    assert last["auth"] == "Bearer k"


def test_server_errors_are_retried_with_backoff(judge_url):
    reward = judge(judge_url, retries=3, backoff_s=0.01)
    assert reward(ScoreBatch(images(1), ["flaky score 4"], [{}]))["remote_judge"] == [0.4]
    assert Judge.attempts["flaky score 4"] == 3
    with pytest.raises(JudgeError, match="HTTP 503"):
        judge(judge_url, retries=1, backoff_s=0.01)(ScoreBatch(images(1), ["flaky score 5"], [{}]))


def test_a_timeout_is_a_judge_error(judge_url):
    reward = judge(judge_url, timeout_s=0.2, retries=1, backoff_s=0.01)
    with pytest.raises(JudgeError, match="2 attempt"):
        reward(ScoreBatch(images(1), ["slow score 3"], [{}]))


@pytest.mark.parametrize("prompt", ["garbage", "broken"])
def test_malformed_answers_raise_a_clear_error(judge_url, prompt):
    with pytest.raises(JudgeAnswerError):
        judge(judge_url)(ScoreBatch(images(1), [prompt], [{}]))


def test_parse_score_format():
    assert parse_score("reason...\nScore = 8", 10) == 0.8
    assert parse_score("SCORE: 3\nthen SCORE: 9", 10) == 0.9  # the last one wins
    with pytest.raises(JudgeAnswerError, match="outside"):
        parse_score("SCORE: 11", 10)


def test_a_bad_answer_refuses_its_group_through_the_scoring_path(judge_url):
    from test_multi_reward_scoring import make_group

    scorers = parse_scorer_spec(f"remote_judge(url={judge_url};model=m;instruction={{prompt}})")
    results = score_groups(
        [make_group(0, "score 6"), make_group(1, "garbage")], scorers, scorer_id="r"
    )
    assert results[0].total == pytest.approx([0.6] * 3)
    assert "g1" in str(results[1]) and "JudgeAnswerError" in str(results[1])
