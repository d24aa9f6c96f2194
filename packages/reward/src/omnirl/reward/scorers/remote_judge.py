"""A remote vision-language judge behind an OpenAI-compatible chat-completions endpoint.

For each image: ``POST {url}/chat/completions`` with one user message holding the image as
a ``data:image/png;base64,...`` URL and the instruction (``instruction`` with ``{prompt}``
replaced by the sample's prompt). The answer must contain ``SCORE: <number>`` (case
insensitive; the last such line wins); the number is divided by ``max_score`` to give the
reward. Transport errors, timeouts and HTTP 429 / 5xx are retried with exponential backoff
(``retries`` times); an answer without a parsable score raises :class:`JudgeAnswerError`
naming the answer, which refuses the group. Calls for one batch run concurrently on a small
thread pool (``concurrency``).

Serving a judge, e.g. with vLLM's OpenAI-compatible server::

    vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8000 --max-model-len 8192
    uv run reward ... --scorer 'remote_judge(url=http://HOST:8000/v1;model=Qwen/Qwen2.5-VL-7B-Instruct)'
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from PIL import Image

from omnirl.reward.scorers.jpeg import as_uint8_batch
from omnirl.reward.scorers.registry import ScoreBatch, register_reward

DEFAULT_INSTRUCTION = (
    'You are judging an image generated for the prompt: "{prompt}". Rate how well the image '
    "matches the prompt and how good it looks, from 0 (worst) to 10 (best). Answer with a "
    "short reason, then a last line of the form 'SCORE: <number>'."
)
SCORE_PATTERN = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


class JudgeError(RuntimeError):
    """The judge could not be reached (after retries) or answered with an HTTP error."""


class JudgeAnswerError(ValueError):
    """The judge answered, but not in the documented format."""


def parse_score(answer: str, max_score: float) -> float:
    """The last ``SCORE: x`` of ``answer`` divided by ``max_score``; JudgeAnswerError otherwise."""
    found = SCORE_PATTERN.findall(answer)
    if not found:
        raise JudgeAnswerError(f"no 'SCORE: <number>' in the judge's answer {answer[:200]!r}")
    value = float(found[-1])
    if not math.isfinite(value) or not 0.0 <= value <= max_score:
        raise JudgeAnswerError(f"judge score {value} is outside [0, {max_score}]")
    return value / max_score


def png_data_url(image) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@register_reward("remote_judge")
class RemoteJudge:
    """``remote_judge(url=http://HOST:PORT/v1;model=NAME[;api_key=;timeout_s=60;retries=3;...])``."""

    components = ("remote_judge",)
    reads = frozenset({"images", "prompt"})
    batchable = True
    thread_safe = True

    def __init__(
        self,
        url: str,
        model: str,
        api_key: str = "",
        instruction: str = DEFAULT_INSTRUCTION,
        max_score: float = 10.0,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        concurrency: int = 8,
        max_tokens: int = 256,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote_judge url must be http(s)://..., got {url!r}")
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.instruction = model, api_key, instruction
        self.max_score, self.timeout_s = float(max_score), float(timeout_s)
        self.retries, self.backoff_s = int(retries), float(backoff_s)
        self.concurrency, self.max_tokens = max(1, int(concurrency)), int(max_tokens)

    def request_body(self, image, prompt: str) -> bytes:
        content = [
            {"type": "image_url", "image_url": {"url": png_data_url(image)}},
            {"type": "text", "text": self.instruction.replace("{prompt}", prompt)},
        ]
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
        }
        return json.dumps(body).encode()

    def _post(self, body: bytes) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.endpoint, body, headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
                if exc.code != 429 and exc.code < 500:
                    break  # a client error does not get better by retrying
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            except json.JSONDecodeError as exc:
                raise JudgeAnswerError(f"judge answered with non-JSON: {exc}") from exc
        raise JudgeError(f"judge {self.endpoint} failed after {attempt + 1} attempt(s): {last}")

    def judge(self, image, prompt: str) -> float:
        reply = self._post(self.request_body(image, prompt))
        try:
            answer = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise JudgeAnswerError(f"not a chat-completions reply: {str(reply)[:200]}") from None
        if not isinstance(answer, str):
            raise JudgeAnswerError(f"judge message content is not text: {str(answer)[:200]}")
        return parse_score(answer, self.max_score)

    def __call__(self, batch: ScoreBatch) -> dict[str, list[float]]:
        images = as_uint8_batch(batch.images)
        with ThreadPoolExecutor(min(self.concurrency, len(images)) or 1) as pool:
            scores = list(pool.map(self.judge, images, batch.prompts))
        return {"remote_judge": scores}
