"""Drives a live `strata serve` with the official `openai` Python client.

Run by tests/server_openai.rs:
    python3 tests/openai_client.py --base-url URL --model NAME --strata BIN --model-path PATH [--checks LIST]

Exits 0 when every check passes; otherwise prints each failed check and exits 1.
Exit status 3 means the `openai` module is missing.
"""

import argparse
import json
import subprocess
import sys
import threading

try:
    import openai
    from openai import OpenAI
except ImportError:
    print("openai_client.py: the `openai` module is not installed (pip install openai)")
    sys.exit(3)

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print(f"FAIL: {what}", flush=True)


def cli_generate(args, prompt, max_tokens, chat):
    """Greedy reference from `strata generate --json`."""
    cmd = [args.strata, "generate", "--model", args.model_path, "--prompt", prompt,
           "--max-tokens", str(max_tokens), "--temperature", "0", "--json"]
    if chat:
        cmd.append("--chat")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def chat_once(client, model, prompt, max_tokens, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens, temperature=0, **kw)


def test_models(client, model):
    ids = [m.id for m in client.models.list().data]
    check(ids == [model], f"/v1/models lists {ids}, want [{model!r}]")


def test_chat(args, client):
    prompt, n = "What is the capital of France?", 12
    ref = cli_generate(args, prompt, n, chat=True)
    r = chat_once(client, args.model, prompt, n)
    text = r.choices[0].message.content
    check(text == ref["text"], f"chat greedy text {text!r} != strata generate {ref['text']!r}")
    check(r.object == "chat.completion" and r.id.startswith("chatcmpl-"), f"chat object/id: {r.object} {r.id}")
    check(r.choices[0].message.role == "assistant", "chat role")
    check(r.usage.prompt_tokens == ref["prompt_tokens"],
          f"chat prompt_tokens {r.usage.prompt_tokens} != {ref['prompt_tokens']}")
    check(r.usage.completion_tokens == len(ref["token_ids"]),
          f"chat completion_tokens {r.usage.completion_tokens} != {len(ref['token_ids'])}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "chat total_tokens")
    want_reason = "length" if len(ref["token_ids"]) == n else "stop"
    check(r.choices[0].finish_reason == want_reason,
          f"chat finish_reason {r.choices[0].finish_reason} != {want_reason}")

    # Streaming: same text, one id, role only first, finish_reason only last, usage at the end.
    chunks = list(chat_once(client, args.model, prompt, n, stream=True,
                            stream_options={"include_usage": True}))
    ids = {c.id for c in chunks}
    check(len(ids) == 1, f"stream chunk ids differ: {ids}")
    choice_chunks = [c for c in chunks if c.choices]
    check(choice_chunks[0].choices[0].delta.role == "assistant", "first delta has the role")
    check(all(c.choices[0].delta.role is None for c in choice_chunks[1:]), "role only in the first delta")
    reasons = [c.choices[0].finish_reason for c in choice_chunks]
    check(reasons[-1] == want_reason and all(x is None for x in reasons[:-1]),
          f"finish_reason only in the last chunk: {reasons}")
    streamed = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    check(streamed == text, f"streamed text {streamed!r} != {text!r}")
    check(chunks[-1].choices == [] and chunks[-1].usage is not None, "last chunk carries only usage")
    if chunks[-1].usage is not None:
        check(chunks[-1].usage.prompt_tokens == ref["prompt_tokens"]
              and chunks[-1].usage.completion_tokens == len(ref["token_ids"]),
              f"stream usage {chunks[-1].usage}")
    check(all(c.usage is None for c in chunks[:-1]), "usage only in the last chunk")
    return [c.choices[0].delta.content or "" for c in choice_chunks]


def test_completions(args, client):
    prompt, n = "The three primary colors are", 10
    ref = cli_generate(args, prompt, n, chat=False)
    r = client.completions.create(model=args.model, prompt=prompt, max_tokens=n, temperature=0)
    check(r.choices[0].text == ref["text"], f"completion text {r.choices[0].text!r} != {ref['text']!r}")
    check(r.object == "text_completion", f"completion object {r.object}")
    check(r.usage.prompt_tokens == ref["prompt_tokens"]
          and r.usage.completion_tokens == len(ref["token_ids"]), f"completion usage {r.usage}")
    chunks = list(client.completions.create(model=args.model, prompt=prompt, max_tokens=n,
                                            temperature=0, stream=True))
    check(len({c.id for c in chunks}) == 1, "completion stream ids")
    streamed = "".join(c.choices[0].text for c in chunks)
    check(streamed == ref["text"], f"completion stream {streamed!r} != {ref['text']!r}")
    reasons = [c.choices[0].finish_reason for c in chunks]
    check(reasons[-1] in ("stop", "length") and all(x is None for x in reasons[:-1]),
          f"completion stream finish reasons {reasons}")


def test_logprobs(args, client):
    """Both endpoints' log-probabilities as the client parses them: greedy, equal to the
    plain CLI run's (`generate --json` "logprobs", the same backend: bitwise); the top
    alternatives sorted, the chosen token the most likely; echo scores the prompt."""
    prompt, n = "The three primary colors are", 6
    ref = cli_generate(args, prompt, n, chat=False)
    r = client.completions.create(model=args.model, prompt=prompt, max_tokens=n, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    check(lp is not None and lp.token_logprobs == ref["logprobs"],
          f"completion logprobs {lp and lp.token_logprobs} != CLI {ref['logprobs']}")
    check(lp is not None and "".join(lp.tokens) == r.choices[0].text, "tokens spell the text")
    for lps, top in zip(lp.token_logprobs, lp.top_logprobs):
        # The legacy API keys alternatives by their text: tokens that decode to the same
        # text (a random model's partial UTF-8 bytes) collapse into one entry, the last
        # one's. Only an uncollapsed position says which token is the top one.
        check(1 <= len(top) <= 3, f"top_logprobs entries: {top}")
        if len(top) == 3:
            check(max(top.values()) == lps, f"greedy token is the top one: {top}")
    e = client.completions.create(model=args.model, prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1)
    elp = e.choices[0].logprobs
    check(e.choices[0].text == prompt and elp.token_logprobs[0] is None
          and all(x is not None and x <= 0 for x in elp.token_logprobs[1:])
          and len(elp.tokens) == ref["prompt_tokens"], f"echo: {e.choices[0]}")
    ref = cli_generate(args, prompt, n, chat=True)
    c = chat_once(client, args.model, prompt, n, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    check([t.logprob for t in content] == ref["logprobs"],
          f"chat logprobs {[t.logprob for t in content]} != CLI {ref['logprobs']}")
    for t in content:
        alts = [a.logprob for a in t.top_logprobs]
        check(len(alts) == 2 and alts == sorted(alts, reverse=True) and alts[0] == t.logprob
              and bytes(t.bytes).decode("utf-8", "replace") == t.token, f"chat entry {t}")
    streamed = [t.logprob for ch in chat_once(client, args.model, prompt, n, logprobs=True,
                                               stream=True)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    check(streamed == ref["logprobs"], f"streamed chat logprobs {streamed}")


def test_stop_strings(args, client, pieces):
    """A stop string made of the end of one streamed piece and the start of the next:
    it is split across tokens. The text stops right before it."""
    full = "".join(pieces)
    k = next((i for i in range(1, len(pieces) - 1)
              if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2), None)
    if k is None:
        check(False, f"no two adjacent pieces of 2+ characters in {pieces}")
        return
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    want = full[:full.index(stop)]
    r = chat_once(client, args.model, "What is the capital of France?", 12, stop=[stop, "zzzz-never"])
    check(r.choices[0].message.content == want,
          f"stop {stop!r}: got {r.choices[0].message.content!r}, want {want!r}")
    check(r.choices[0].finish_reason == "stop", f"stop string finish_reason {r.choices[0].finish_reason}")
    chunks = list(chat_once(client, args.model, "What is the capital of France?", 12,
                            stop=stop, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(streamed == want, f"streamed stop {stop!r}: got {streamed!r}, want {want!r}")


def test_concurrent(args, client):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(16)]

    def one(p):
        return client.completions.create(model=args.model, prompt=p, max_tokens=4, temperature=0)

    sequential = [one(p) for p in prompts]
    results = [None] * len(prompts)

    def worker(i):
        try:
            results[i] = one(prompts[i])
        except Exception as e:  # recorded as a failure below
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (s, c) in enumerate(zip(sequential, results)):
        if isinstance(c, Exception):
            check(False, f"concurrent request {i} failed: {c}")
            continue
        check(c.choices[0].text == s.choices[0].text,
              f"concurrent request {i}: {c.choices[0].text!r} != sequential {s.choices[0].text!r}")
        check(c.usage == s.usage, f"concurrent request {i} usage {c.usage} != {s.usage}")


def expect_error(status, fn, what, contains=()):
    try:
        fn()
    except openai.APIStatusError as e:
        check(e.status_code == status, f"{what}: status {e.status_code}, want {status}")
        body = e.body if isinstance(e.body, dict) else {}
        msg = body.get("message", "") if "message" in body else str(body)
        for c in contains:
            check(c in msg, f"{what}: message {msg!r} lacks {c!r}")
        return
    check(False, f"{what}: no error, want {status}")


def test_errors(args, client):
    msgs = [{"role": "user", "content": "hi"}]
    expect_error(404, lambda: client.chat.completions.create(model="no-such-model", messages=msgs),
                 "unknown model")
    expect_error(400, lambda: client.chat.completions.create(model=args.model, messages=msgs, n=2),
                 "n=2")
    expect_error(400, lambda: client.chat.completions.create(model=args.model, messages=msgs,
                                                             temperature=-1), "temperature -1")
    expect_error(400, lambda: client.completions.create(model=args.model, prompt="hello",
                                                        max_tokens=10**6),
                 "max_tokens over the context", contains=("1000000", "1024"))
    expect_error(400, lambda: client.chat.completions.create(model=args.model, messages=[]),
                 "empty messages")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--strata", required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--checks", default="models,chat,stop,completions,logprobs,errors,concurrent",
                    help="which checks to run, comma-separated (default: all)")
    args = ap.parse_args()
    checks = set(args.checks.split(","))
    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=300)
    print(f"openai {openai.__version__} against {args.base_url}", flush=True)
    if "models" in checks:
        test_models(client, args.model)
    if "chat" in checks or "stop" in checks:
        pieces = test_chat(args, client)
        if "stop" in checks:
            test_stop_strings(args, client, pieces)
    if "completions" in checks:
        test_completions(args, client)
    if "logprobs" in checks:
        test_logprobs(args, client)
    if "errors" in checks:
        test_errors(args, client)
    if "concurrent" in checks:
        test_concurrent(args, client)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed", flush=True)
        sys.exit(1)
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
