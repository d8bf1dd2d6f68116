"""What the serving tests share: a scripted engine, test tokenizers, and real `linearize serve` processes.

`ScriptedEngine` has the real engine's interface (`submit`, `stats`, `stop`, requests with `tokens()`,
`cancel()`, `finish_reason`) and no model: each request yields `reply` (cut at `max_tokens`), so what the
web layer makes of the tokens can be checked exactly. `Server` runs the real thing on a tiny model.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "tiny-lizard"


class ScriptedRequest:
    def __init__(self, prompt_ids: list[int], params, script: list[int], delay: float, fail_after: int | None):
        self.prompt_ids, self.params = list(prompt_ids), params
        self.finish_reason: str | None = None
        self.cancelled = False
        self.sent = 0
        self._script = script[:params.max_tokens]
        self._ended_by = "length" if len(script) >= params.max_tokens else "stop"
        self._delay, self._fail_after = delay, fail_after

    def cancel(self) -> None:
        self.cancelled = True

    async def tokens(self):
        for token in self._script:
            if self._fail_after is not None and self.sent >= self._fail_after:
                self.finish_reason = "error"
                raise RuntimeError("the step failed")
            await asyncio.sleep(self._delay)
            if self.cancelled:
                self.finish_reason = "cancelled"
                return
            self.sent += 1
            yield token
        self.finish_reason = "cancelled" if self.cancelled else self._ended_by


class ScriptedEngine:
    def __init__(self, reply: list[int], *, delay: float = 0.0):
        self.reply, self.delay = list(reply), delay
        self.requests: list[ScriptedRequest] = []
        self.refuse: Exception | None = None  # raised by the next submit
        self.fail_after: int | None = None  # tokens a request yields before the engine fails on it
        self.stopped_with: list[bool] = []
        self.prefix_cache: dict = {"enabled": True, "entries": 0, "bytes": 0, "query_tokens": 0, "hit_tokens": 0}

    def submit(self, prompt_ids: list[int], params) -> ScriptedRequest:
        if self.refuse is not None:
            raise self.refuse
        request = ScriptedRequest(prompt_ids, params, self.reply, self.delay, self.fail_after)
        self.requests.append(request)
        return request

    def stats(self) -> dict:
        running = sum(r.finish_reason is None for r in self.requests)
        return {"running": running, "waiting": 0, "slots": 4, "mode": "slots", "prefix_cache": self.prefix_cache}

    def cancel_all(self) -> None:
        for request in self.requests:
            request.cancel()

    def stop(self, drain: bool = True) -> None:
        self.stopped_with.append(drain)


def byte_tokenizer():
    """A byte-level tokenizer with one token per byte and no merges: a character of several bytes always
    spans several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


# A template of the tiny tokenizers' characters only (they have no newline).
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}<assistant>"


def exact_tokenizer(vocab_size: int):
    """One visible character per token id over the whole vocabulary and no special tokens, so that a
    text encodes back to exactly the ids it was decoded from: printable ASCII for ids 4 to 98 (as
    `tiny_tokenizer`), letters from U+00C0 on for the rest."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = {i: chr(28 + i) if 4 <= i <= 98 else chr(0xC0 + i) for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel({c: i for i, c in chars.items()}, unk_token=chars[3]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A `linearize serve` process on 127.0.0.1 and a free port; its log goes to a file (a pipe nobody
    reads would fill up with access lines and stall it)."""

    def __init__(self, model: Path, log: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # One thread: the tiny model's steps are faster so, and the test's clients share these cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        argv = [sys.executable, "-m", "linearize.cli", "serve", "--model", str(model), "--port", str(self.port),
                "--served-model-name", SERVED_NAME, *flags]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(timeout=120)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the server did not answer within {timeout} s:\n{self.log.read_text()}")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_for(self, condition, timeout: float = 20) -> dict:
        """Poll /health until `condition(stats)` holds; returns those stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.health()
            if condition(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"/health still says {stats} after {timeout} s")
            time.sleep(0.1)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
