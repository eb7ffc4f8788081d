"""Logprobs as OpenAI shows them: `TokenText` (token id -> its text and UTF-8 bytes) and the
`/v1/completions` and `/v1/chat/completions` logprobs objects. The values are the log-softmax of
the model's logits (see `runner/sampler.py`)."""
from __future__ import annotations


class TokenText:
    """Token id -> the text OpenAI's logprobs show, and its UTF-8 bytes. For a byte-level BPE token
    that is part of a character, the text is `bytes:\\xNN...` (as vLLM writes it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_of = None
        dec = tokenizer.decoder
        if dec is not None and type(dec).__name__ == "ByteLevel":
            self._byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            raw = self.tokenizer.id_to_token(token) or ""
            if self._byte_of is not None and all(c in self._byte_of for c in raw):
                data = bytes(self._byte_of[c] for c in raw)
            else:
                data = text.encode("utf-8", "surrogatepass")
            if "\ufffd" in text:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
            hit = self._cache[token] = (text, list(data))
        return hit


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def completion_logprobs(token_text: TokenText, ids: list[int], lps: list, offset: int) -> dict:
    """`lps[i]`: (logprob of ids[i], [(token id, logprob), ...]), or None where there is none (a prompt's
    first token: null logprob and null top logprobs); `offset`: the text offset of ids[0]."""
    tokens, offsets = [], []
    for t in ids:
        offsets.append(offset)
        s = token_text(t)[0]
        tokens.append(s)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [None if x is None else x[0] for x in lps],
            "top_logprobs": [None if x is None else {token_text(i)[0]: v for i, v in x[1]} for x in lps],
            "text_offset": offsets}


def echo_logprobs(token_text: TokenText, prompt_ids: list[int], prompt_lps: list, ids: list[int], lps: list,
                  gen_offset: int) -> dict:
    """The logprobs of an echoed choice: every prompt token (from 0), then the generated ones (from
    `gen_offset`, where the generated text starts)."""
    head = completion_logprobs(token_text, prompt_ids, prompt_lps, 0)
    tail = completion_logprobs(token_text, ids, lps, gen_offset)
    return {k: head[k] + tail[k] for k in head}


def chat_logprobs(token_text: TokenText, ids: list[int], lps: list, top_n: int) -> dict:
    content = []
    for t, (lp, top) in zip(ids, lps):
        s, b = token_text(t)
        content.append({"token": s, "logprob": lp, "bytes": b, "top_logprobs": [
            {"token": token_text(i)[0], "logprob": v, "bytes": token_text(i)[1]} for i, v in top[:top_n]]})
    return {"content": content}
