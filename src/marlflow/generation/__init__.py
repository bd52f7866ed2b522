"""Turning prompts into completions: sampling rules, the HF backend with its CPU fast path, and vLLM.

`sampling` (stop tokens, per-call seeds, the sampling settings), `hf` (ChatEncoder, HFBackend, make_backend),
`fastgen` (own decode loop for small models on the CPU), `vllm` (VLLMBackend: one LoRA per policy, imported
only when asked for). A backend knows policies by name, never which workflow or task it serves.

May import: store, core.
"""
