"""Speculative decoding: drafters propose tokens, one verify step checks them, results never change.

`config.py` (the vLLM-style `--speculative-config`), `drafters.py` (the `Drafter` protocol, prompt lookup
and the adversarial drafters), `acceptance.py` (the accept rule), `planner.py` (when drafting pays).
The engine side lives in engine/llm_engine.py; the rules that keep a rejected token invisible are in
docs/contract.md §13.
"""
