"""A small inference service's day: caller threads sharing one model work through the request
streams, with and without the online corpus; throughput of each, and the corpus's memory at the end.

    .venv/bin/python scripts/online_corpus_server.py [--model embedded] [--dtype auto] [--threads 4] [--requests 200] [--new-tokens 64]

The requests are the streams shipped with hf-selfspec (`--prompts streams` of the bench), both
splits, each stream in order, taken round-robin across the streams as a service's mixed traffic
arrives, and repeated from the start until `--requests`. The caller threads take them in that
order, each the next one free, and start together; the figure is all new tokens over the wall
time until the last call ends. The same requests run twice: under the model's profile alone,
then under it with `online_corpus=True`, the corpus empty at the start. Every output with the
corpus is checked against the same request's output without it (exactly in float32, a near-tie
at most in reduced precision): the corpus may change the speed, never the text.
"""

from __future__ import annotations

import resource
import threading
import time
from itertools import zip_longest

import torch

from concurrent_callers import load_model, model_parser  # this script's neighbour in scripts/

import hf_selfspec
from hf_selfspec.consistency import check_greedy_consistency
from hf_selfspec.measure import timed_generate
from hf_selfspec.prompts import STREAMS, encode_prompt, load_prompts


def _traffic(count: int) -> list:
    """`count` requests: the streams interleaved, each in its own order, repeated as needed."""
    streams: dict[str, list] = {}
    for prompt in load_prompts(STREAMS):
        streams.setdefault(prompt.stream, []).append(prompt)
    interleaved = [p for row in zip_longest(*streams.values()) for p in row if p is not None]
    return [interleaved[i % len(interleaved)] for i in range(count)]


def _serve(model, requests, threads: int, new_tokens: int, kwargs: dict):
    """Tokens per second of `threads` callers taking `requests` in order, and each request's run."""
    runs: list = [None] * len(requests)
    next_request = iter(range(len(requests)))
    taking = threading.Lock()
    start = threading.Barrier(threads)

    def caller() -> None:
        start.wait()
        while True:
            with taking:
                index = next(next_request, None)
            if index is None:
                return
            runs[index] = timed_generate(model, requests[index], max_new_tokens=new_tokens, do_sample=False,
                                         output_logits=True, **kwargs)

    workers = [threading.Thread(target=caller) for _ in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - started
    return sum(len(run.new_tokens) for run in runs) / seconds, runs


def main(argv: list[str] | None = None) -> None:
    parser = model_parser(__doc__.split("\n\n")[0])
    for flag, default in (("--threads", 4), ("--requests", 200), ("--new-tokens", 64)):
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args)
    requests = [encode_prompt(tokenizer, prompt) for prompt in _traffic(args.requests)]
    without, references = _serve(model, requests, args.threads, args.new_tokens, {})
    resident_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    corpus = hf_selfspec.online_corpus(model)
    corpus.clear()
    learning, runs = _serve(model, requests, args.threads, args.new_tokens, {"online_corpus": True})
    for reference, run in zip(references, runs):
        verdict = check_greedy_consistency(run.new_tokens, reference.new_tokens, reference.logits, model.dtype)
        if not verdict.consistent:
            raise SystemExit(f"an output with the online corpus left the one without it ({verdict})")
    resident_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{model.dtype}, {len(requests)} requests x up to {args.new_tokens} new tokens, {args.threads} threads, "
          f"{torch.get_num_threads()} torch thread(s)")
    print("| online corpus | tokens/s | ratio |")
    print("| --- | --- | --- |")
    print(f"| off | {without:.1f} | 1.00x |")
    print(f"| on | {learning:.1f} | {learning / without:.2f}x |")
    print(f"corpus at the end: {corpus.texts} texts, {corpus.tokens} tokens (bound {corpus.max_tokens}), "
          f"{corpus.indexed_occurrences} index entries; peak resident memory {resident_before / 1024:.0f} MiB "
          f"before the corpus run, {resident_after / 1024:.0f} MiB after")


if __name__ == "__main__":
    main()
